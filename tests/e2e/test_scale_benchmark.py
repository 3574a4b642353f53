"""benchmarks/scale.py as a user runs it: --smoke plans its rows with a 2-block Llama (tiny sequence) in seconds.

The full script (every row) is run by hand; here one planned row (offload on the H100's profile, against
benchmarks/results/gpu_h100.json) and one layout the project refuses (a Hugging Face Llama under tp x pp,
a config error the row reports as not planned)."""
import json
import subprocess
import sys

import pytest

from tests import cli

SCRIPT = str(cli.ROOT / "benchmarks" / "scale.py")


@pytest.mark.timeout(60)
def test_smoke_plans_a_row_and_reports_a_refused_one(tmp_path):
    out = tmp_path / "scale.json"
    proc = cli.run_script(SCRIPT, ["--smoke", "--only", "titan-405b-512,697m-offload-h100", "--out", str(out)],
                          cwd=cli.ROOT, timeout=50)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and result["date"] and result["skipped"]
    refused, offload = result["rows"]
    assert refused["row"] == "titan-405b-512" and not refused["planned"]
    assert refused["reason"].startswith("config error: strategy.tp=2")
    assert offload["planned"] and offload["hardware"] == "h100" and offload["predicted_memory_field"] == "total"
    assert offload["predicted_tokens_per_s"] > 0 and offload["predicted_memory_bytes"] > 0 and offload["fits"]
    assert offload["published_memory_kind"] == "allocated" and offload["published_tokens_per_s"] > 0
    assert "tokens_ratio" not in offload  # tiny sizes: no figures to compare
    assert "not planned: config error" in proc.stdout and "predicted to fit (1 of 1)" in proc.stdout


def test_smoke_never_writes_into_the_results():
    # a new interpreter: the usage error comes before anything is imported
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", "benchmarks/results/scale.json"], cwd=cli.ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "never writes into benchmarks/results" in proc.stderr
