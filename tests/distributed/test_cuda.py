"""The CUDA path (nccl, one GPU per rank, allocator peak, bf16 autocast); skipped without CUDA."""
import pytest
import torch

from tests import cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.timeout(300)
def test_data_zero3_on_cuda_trains_and_reports_allocator_peak(tmp_path):
    n = min(2, torch.cuda.device_count())
    cli.run(cli.FAST + [f"nproc={n}", "strategy=data", "strategy.zero=3", "trainer.device=cuda",
                        "memory.fraction=0.5", f"run_dir={tmp_path}"], cwd=tmp_path)
    records = cli.metrics(tmp_path)
    assert all(r["mem_peak_bytes"] > 0 for r in records)
    assert len(records[-1]["mem_peak_bytes_per_rank"]) == n
    assert records[-1]["loss"] < records[0]["loss"]


@pytest.mark.timeout(300)
def test_fp32_on_cuda_matches_cpu_single(tmp_path):
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    cli.run(cli.FAST + ["trainer.device=cpu", f"run_dir={cpu}"], cwd=tmp_path)
    cli.run(cli.FAST + ["trainer.device=cuda", "trainer.precision=fp32", f"run_dir={gpu}"], cwd=tmp_path)
    # Different kernels: close, not bit-equal.
    torch.testing.assert_close(cli.losses(gpu), cli.losses(cpu), rtol=1e-3, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("activations", ["device", "cpu"])
def test_offload_to_pinned_host_memory_matches_single_on_cuda(tmp_path, activations):
    """Weights and optimizer state in pinned host memory, copies on a side stream."""
    common = cli.FAST + ["trainer.device=cuda", "trainer.precision=fp32"]
    ref, off = tmp_path / "single", tmp_path / "offload"
    cli.run(common + [f"run_dir={ref}"], cwd=tmp_path)
    cli.run(common + ["strategy=offload", "strategy.params=cpu", "strategy.optimizer=cpu",
                      f"strategy.activations={activations}", f"run_dir={off}"], cwd=tmp_path)
    cli.assert_same_training(off, ref)
    assert cli.metrics(off)[-1]["offload_params_bytes"] > 0


@pytest.mark.timeout(300)
def test_checkpoint_saved_on_cuda_resumes_on_the_cpu(tmp_path):
    """A data zero=3 checkpoint written from GPU memory over nccl continues in one CPU process."""
    n = min(2, torch.cuda.device_count())
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
