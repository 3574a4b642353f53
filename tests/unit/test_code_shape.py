"""The shape of the code holds: layers import downward only (import-linter contracts in pyproject.toml),
ruff's rules pass, and no file or function in parallel/ or launch/ outgrows one sitting (500 / 60 lines)."""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]'")
    return path


def test_layers_import_downward_only_and_no_module_cycles():
    proc = subprocess.run([_tool("lint-imports")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 kept, 0 broken" in proc.stdout


def test_ruff_is_clean():
    proc = subprocess.run([_tool("ruff"), "check", "parallel", "launch", "tests", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_files_and_functions_stay_small():
    too_long = []
    for path in [*sorted((ROOT / "parallel").rglob("*.py")), *sorted((ROOT / "launch").glob("*.py"))]:
        source = path.read_text()
        if len(source.splitlines()) > 500:
            too_long.append(f"{path.relative_to(ROOT)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not too_long, too_long
