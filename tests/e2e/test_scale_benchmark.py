"""benchmarks/scale.py as a user runs it: --smoke plans its rows with a 2-block Llama (tiny sequence) in seconds.

The full script (every row) is run by hand; here two planned rows: offload on the H100's profile, against
benchmarks/results/gpu_h100.json, and the 405B's layout, a Hugging Face Llama under dp x tp x pp (its tensor
parallelism over the pipeline's traced blocks: Note [tensor parallelism over traced blocks])."""
import json
import subprocess
import sys

import pytest

from tests import cli

SCRIPT = str(cli.ROOT / "benchmarks" / "scale.py")


@pytest.mark.timeout(60)
def test_smoke_plans_the_405b_layout_and_a_row_of_the_projects_own_gpu_runs(tmp_path):
    out = tmp_path / "scale.json"
    proc = cli.run_script(SCRIPT, ["--smoke", "--only", "titan-405b-512,697m-offload-h100", "--out", str(out)],
                          cwd=cli.ROOT, timeout=50)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and result["date"] and result["skipped"]
    layout, offload = result["rows"]
    assert layout["row"] == "titan-405b-512" and layout["planned"], layout.get("reason")
    assert layout["predicted_tokens_per_s"] > 0 and layout["predicted_memory_bytes"] > 0
    assert offload["planned"] and offload["hardware"] == "h100" and offload["predicted_memory_field"] == "total"
    assert offload["predicted_tokens_per_s"] > 0 and offload["predicted_memory_bytes"] > 0 and offload["fits"]
    assert offload["published_memory_kind"] == "allocated" and offload["published_tokens_per_s"] > 0
    assert "tokens_ratio" not in offload  # tiny sizes: no figures to compare
    assert "not planned" not in proc.stdout and "predicted to fit (2 of 2)" in proc.stdout


def test_smoke_never_writes_into_the_results():
    # a new interpreter: the usage error comes before anything is imported
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", "benchmarks/results/scale.json"], cwd=cli.ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "never writes into benchmarks/results" in proc.stderr
