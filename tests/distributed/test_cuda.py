"""The CUDA path (nccl, one GPU per rank, allocator peak, bf16 autocast); skipped without CUDA.

This process hides the GPUs; each run here that names trainer.device=cuda sees them (Note [tests on a GPU
machine] in tests/gpus.py). Runs over "up to 2" GPUs take one rank on a machine with one.
"""
import re

import pytest
import torch

from parallel.hardware import gpu_peak
from tests import cli, gpus
from tests.hf_models import args

pytestmark = pytest.mark.cuda


@pytest.mark.timeout(300)
def test_data_zero3_on_cuda_trains_and_reports_allocator_peak(tmp_path):
    n = min(2, gpus.count())
    cli.run(cli.FAST + [f"nproc={n}", "strategy=data", "strategy.zero=3", "trainer.device=cuda",
                        "memory.fraction=0.5", f"run_dir={tmp_path}"], cwd=tmp_path)
    records = cli.metrics(tmp_path)
    assert all(r["mem_peak_bytes"] > 0 for r in records)
    assert len(records[-1]["mem_peak_bytes_per_rank"]) == n
    assert records[-1]["loss"] < records[0]["loss"]
    # MFU against the table's bf16 peak of this GPU (bf16 autocast by default); none for a GPU it does not know.
    if gpu_peak(gpus.name(), "bf16") is None:
        assert "mfu" not in records[-1]
    else:
        assert all(0 < r["mfu"] <= 1 for r in records)


@pytest.mark.timeout(300)
def test_fp32_on_cuda_matches_cpu_single(tmp_path):
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    cli.run(cli.FAST + ["trainer.device=cpu", f"run_dir={cpu}"], cwd=tmp_path)
    cli.run(cli.FAST + ["trainer.device=cuda", "trainer.precision=fp32", f"run_dir={gpu}"], cwd=tmp_path)
    # Different kernels: close, not bit-equal.
    torch.testing.assert_close(cli.losses(gpu), cli.losses(cpu), rtol=1e-3, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("activations,clip", [("device", 1.0), ("cpu", 1.0), ("device", 0)])
def test_offload_to_pinned_host_memory_matches_single_on_cuda(tmp_path, activations, clip):
    """Weights and optimizer state in pinned host memory, copies on side streams (one each way). Without
    clipping each block's step runs on a stream of its own while backward goes on (Note [offload engine])."""
    common = cli.FAST + ["trainer.device=cuda", "trainer.precision=fp32", f"trainer.clip_grad_norm={clip}"]
    ref, off = tmp_path / "single", tmp_path / "offload"
    cli.run(common + [f"run_dir={ref}"], cwd=tmp_path)
    cli.run(common + ["strategy=offload", "strategy.params=cpu", "strategy.optimizer=cpu",
                      f"strategy.activations={activations}", f"run_dir={off}"], cwd=tmp_path)
    cli.assert_same_training(off, ref)
    assert cli.metrics(off)[-1]["offload_params_bytes"] > 0


@pytest.mark.timeout(300)
def test_checkpoint_saved_on_cuda_resumes_on_the_cpu(tmp_path):
    """A data zero=3 checkpoint written from GPU memory over nccl continues in one CPU process."""
    n = min(2, gpus.count())
    common = cli.FAST + ["trainer.steps=8", "trainer.checkpoint_every=4", "trainer.precision=fp32"]
    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    cli.run(common + [f"nproc={n}", "strategy=data", "strategy.zero=3", "trainer.device=cuda", f"run_dir={gpu}"],
            cwd=tmp_path)
    cli.run(common + ["trainer.device=cpu", f"trainer.resume={gpu}/checkpoints/step-000004", f"run_dir={cpu}"],
            cwd=tmp_path)
    want = {r["step"]: r["loss"] for r in cli.metrics(gpu)}
    got = {r["step"]: r["loss"] for r in cli.metrics(cpu)}
    assert sorted(got) == [5, 6, 7, 8]
    # Different kernels: close, not bit-equal.
    torch.testing.assert_close(torch.tensor([got[s] for s in got]), torch.tensor([want[s] for s in got]),
                               rtol=1e-3, atol=1e-5)


# Context parallelism on CUDA: PyTorch's ring attention (Note [context parallelism on CUDA] in
# parallel/strategies/context/cuda.py). fp32, so SDPA takes the memory-efficient kernel on both sides; its chunks
# must be whole rows of 32 tokens (seq_len 128 over cp 2: 4 chunks of 32).
CP_CUDA = ["data.task=lm", "data.seq_len=128", "trainer.device=cuda", "trainer.precision=fp32"]
CP_GPT = ["model=gpt", "model.args.dim=32", "model.args.heads=4", "model.args.seq_len=128", "model.args.layers=2"]
CP_LLAMA = [a for a in args("llama") if not a.startswith("data.")] + ["+model.args.seq_len=128"]
two_gpus = pytest.mark.cuda(2)

# name -> (model, strategy)
CP_CASES = {
    "gpt_cp2": (cli.FAST + CP_GPT, ["strategy=context"]),
    "gpt_cp2_zero3": (cli.FAST + CP_GPT, ["strategy=hybrid", "strategy.dp=1", "strategy.cp=2", "strategy.zero=3"]),
    "llama_cp2": (CP_LLAMA, ["strategy=context"]),
}


@two_gpus
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CP_CASES))
def test_context_on_two_gpus_matches_single(tmp_path, case):
    """Each sequence split over 2 GPUs (load-balanced chunks, nccl): single's losses and final weights on CUDA,
    for the built-in gpt and a Hugging Face Llama (rotary positions, grouped-query attention)."""
    model, strategy = CP_CASES[case]
    ref, cp = tmp_path / "single", tmp_path / "cp"
    cli.run(model + CP_CUDA + [f"run_dir={ref}"], cwd=tmp_path)
    cli.run(model + CP_CUDA + strategy + ["nproc=2", f"run_dir={cp}"], cwd=tmp_path)
    cli.assert_same_training(cp, ref)


@pytest.mark.timeout(300)
def test_out_of_memory_on_cuda_is_one_line_per_rank_with_the_allocator_figures(tmp_path):
    """A real out-of-memory (a petabyte asked of the device) in step 2's forward on every rank: each rank's line
    with what was allocated of the fraction, exit 1, no traceback, the snapshot written (Note [out of memory])."""
    n = min(2, gpus.count())
    proc = cli.run(cli.FAST + [f"nproc={n}", "strategy=data", "trainer.device=cuda", "memory.fraction=0.5",
                               "trainer.memory_snapshot=true", "model=custom",
                               "model._target_=tests.user_model.out_of_memory_at", "+model.args.at=2",
                               "+model.args.phase=allocate", f"run_dir={tmp_path}"], cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors, proc.stderr
    for line in errors:  # the agent may stop a rank before it has said anything: at least one line
        assert re.match(r"error: out of GPU memory on rank \d at step 2 in forward \(2: OutOfMemoryAt\): "
                        r"[\d.]+ [KMGT]?B allocated of [\d.]+ [KMGT]?B \(memory.fraction 0.5\); no plan was made",
                        line), line
        assert line.endswith(".pickle") and "; memory snapshot: " in line
    assert list((tmp_path / "memory_snapshot").glob("rank*.pickle"))
