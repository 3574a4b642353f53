"""benchmarks/gpu.py as a user runs it: --smoke gives every row of the GPU table on the CPU with tiny sizes.

Each command is a child of the zygote (tests/cli.py `run_script`); --smoke then forks its own runs from it, with
the framework imported (benchmarks/gpu.py `forked_proc`)."""
import json
import math

import pytest
import torch

from tests import cli

SCRIPT = str(cli.ROOT / "benchmarks" / "gpu.py")


@pytest.mark.timeout(300)
def test_smoke_fills_every_row(tmp_path):
    out = tmp_path / "gpu.json"
    proc = cli.run_script(SCRIPT, ["--smoke", "--prefetch", "1,2", "--out", str(out)], cwd=cli.ROOT, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and result["torch"] == torch.__version__ and result["device"].startswith("cpu")
    rows = result["rows"]
    assert list(rows) == ["single_vs_hand", "offload", "capped", "planner", "compile"]
    for name in ("single_vs_hand", "offload"):  # each side trains the same model on the same batches
        row = rows[name]
        assert row["median_ratio"] > 0 and not row["failed_pairs"], row
        assert row["loss_rel_diff"] < 1e-4, row
    hand = rows["single_vs_hand"]
    assert hand["single_step_s"] > 0 and hand["hand_step_s"] > 0
    assert hand["mfu"] > 0 and hand["hand_mfu"] > 0 and hand["tokens_per_s"] > 0 and hand["hand_tokens_per_s"] > 0
    off = rows["offload"]
    assert off["copy_bytes_per_s"] > 0 and off["bytes_moved_per_step"] >= 0 and off["transfer_bound_s"] >= 0
    assert off["mem_peak_bytes"]["offload"] > 0 and isinstance(off["meets_target"], bool)
    other = off["other_prefetch"]["2"]  # --prefetch's second value, in the same rounds against the same single
    assert off["prefetch"] == 1 and other["median_ratio"] > 0 and other["loss_rel_diff"] < 1e-4, off
    assert other["mem_peak_bytes"] > off["mem_peak_bytes"]["offload"]  # 4 more pool buffers
    capped = rows["capped"]  # the out-of-memory half needs CUDA; the offload run trains uncapped on the CPU
    assert capped["fraction"] == "needs CUDA" and capped["single"] == "needs CUDA"
    assert capped["offload_checkpoint"]["trained"] and capped["offload_checkpoint"]["mem_peak_bytes"] > 0
    configs = rows["planner"]["configs"]
    assert set(configs) == {"single", "offload", "single_checkpoint"}
    for c in configs.values():
        assert c["predicted_bytes"] > 0 and c["measured_bytes"] > 0 and math.isfinite(c["error_pct"]), configs
    assert "skipped" in rows["compile"]  # a cold compile costs more than the whole smoke run
    for line in ("torch " + torch.__version__, "single_vs_hand", "framework / hand-written", "needs CUDA",
                 "largest |error|", "strategy.prefetch=2: "):
        assert line in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="says so only where there is no GPU")
def test_without_a_gpu_says_so_in_one_line(tmp_path):
    proc = cli.run_script(SCRIPT, ["--out", str(tmp_path / "gpu.json")], cwd=cli.ROOT)
    assert proc.returncode == 1 and not (tmp_path / "gpu.json").exists()
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "needs a CUDA GPU" in proc.stderr
    assert "--smoke" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("value", ["1,x", "1,1", "-1"])
def test_a_bad_prefetch_list_is_a_usage_error(value):
    proc = cli.run_script(SCRIPT, ["--smoke", "--prefetch", value], cwd=cli.ROOT)
    assert proc.returncode == 2 and "--prefetch:" in proc.stderr and "Traceback" not in proc.stderr


def test_smoke_never_overwrites_the_gpu_results():
    proc = cli.run_script(SCRIPT, ["--smoke", "--out", "benchmarks/results/gpu.json"], cwd=cli.ROOT)
    assert proc.returncode == 2 and "never writes the GPU results" in proc.stderr
