"""Plans of CUDA runs made on this CPU-only host (Note [planning for CUDA] in parallel/planning/cuda.py): bf16 autocast's
tensors, the caching allocator's rounding, cuBLAS workspaces, torch.optim's foreach step, offload's pinned host
memory, and strategy=auto choosing for a GPU it does not see."""
import json

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from parallel.config import Config, ConfigError
from parallel.memory.tracker import LiveTensorBytes
from parallel.planning.auto import choose, device_budget
from parallel.planning.cuda import HOPPER_WORKSPACE, OLDER_WORKSPACE, CudaAccount, allocated, cublas_workspace, pinned
from parallel.planning.planner import KINDS, plan
from parallel.validate import validate

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="planning without a GPU")
FP32_WEIGHTS = 19012 * 4  # the default mlp: 19,012 fp32 parameters


def _plan(device: str, batch: int = 32, world: int = 1, model: dict | None = None, **strategy):
    cfg = Config()
    cfg.trainer.device, cfg.trainer.batch_size = device, batch
    for key, value in (model or {}).items():
        setattr(cfg.model, key, value)
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    validate(cfg, world)
    return plan(cfg, world)


def test_the_caching_allocator_rounds_every_request_up_to_512_bytes():
    assert [allocated(n) for n in (0, 1, 511, 512, 513, 2**20 + 1)] == [0, 512, 512, 512, 1024, 2**20 + 512]
    tracker = LiveTensorBytes("cpu", block=512)
    kept = [torch.zeros(1), torch.zeros(129)]  # 4 and 516 bytes
    tracker.track(kept)
    assert tracker.current == 512 + 1024
    assert LiveTensorBytes("cpu").size(torch.zeros(129).untyped_storage()) == 516  # the CPU's count: as they are
    assert [pinned(n) for n in (0, 4096, 4097)] == [0, 4096, 8192]  # the host allocator: powers of two


def test_cublas_workspace_is_torchs_choice():
    assert cublas_workspace({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})[0] == HOPPER_WORKSPACE
    assert cublas_workspace({"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"})[0] == OLDER_WORKSPACE
    if not torch.cuda.is_available():  # no GPU to ask: the GPUs the project runs on (H100, H200)
        size, source = cublas_workspace({})
        assert size == HOPPER_WORKSPACE and "Hopper" in source


@no_gpu
def test_a_cuda_plan_runs_here_with_bf16_activations_rounding_and_workspaces():
    """A matmul-heavy model at a batch where activations dominate: bf16 autocast saves about half the bytes of
    the fp32 CPU run; the forward's and backward's threads each hold a cuBLAS workspace at the backward peak."""
    model = {"args": {"hidden": 512}}
    (cpu,) = _plan("cpu", batch=4096, model=model)
    (cuda,) = _plan("cuda", batch=4096, model=model)
    assert 0.45 <= cuda.activations / cpu.activations <= 0.6, (cuda.activations, cpu.activations)
    assert cuda.peak_phase == "backward" and cuda.workspaces == 2 * HOPPER_WORKSPACE
    assert cuda.temp >= cuda.workspaces and cuda.rounding > 0 and cuda.fp32_on_cuda == {}
    assert sum(getattr(cuda, k) for k in KINDS) == cuda.total
    assert (cpu.workspaces, cpu.rounding, cpu.host_pinned, cpu.reserved, cpu.reserved_expandable) == (0,) * 5


@no_gpu
def test_a_cuda_plan_holds_what_the_caching_allocator_reserves():
    """The tiny gpt's step replayed through the simulated caching allocator (Note [caching allocator]): reserved
    holds the total, in whole 2 MiB; the two 32 MiB cuBLAS workspaces are segments of their own by default and
    40 MiB of 20 MiB pages each with expandable segments; plan.json has both."""
    cfg = Config()
    cfg.model.name, cfg.data.task, cfg.data.seq_len, cfg.trainer.batch_size = "gpt", "lm", 16, 8
    cfg.model.args = {"vocab_size": 64, "seq_len": 16, "dim": 32, "heads": 4, "layers": 2}
    cfg.trainer.device = "cuda"
    validate(cfg, 1)
    (cuda,) = plan(cfg, 1)
    assert cuda.total <= cuda.reserved < cuda.total + 4 * 2**20 and cuda.reserved % 2**20 == 0
    assert cuda.reserved_expandable >= 2 * 40 * 2**20 > cuda.reserved
    record = {k: v for k, v in vars(cuda).items() if k not in ("by_module", "calls", "tally")}  # as plan.json
    assert json.loads(json.dumps(record))["reserved"] == cuda.reserved


@no_gpu
def test_a_cuda_plan_steps_the_optimizer_as_torch_does_on_cuda():
    """torch.optim's foreach AdamW on CUDA holds the square roots of all second moments at once: a temporary the
    size of the weights at the optimizer's peak, where the CPU's per-tensor loop holds one tensor's."""
    (cpu,) = _plan("cpu")
    (cuda,) = _plan("cuda")
    assert cpu.peak_phase == cuda.peak_phase == "optimizer"
    assert cpu.temp < FP32_WEIGHTS <= cuda.temp - cuda.workspaces < 2 * FP32_WEIGHTS


@no_gpu
def test_offload_for_cuda_streams_its_blocks_from_pinned_host_memory():
    """Under a GPU the tier below is pinned host memory: weights, AdamW's two moments and the gradients waiting
    for the clipped step live there (counted apart, powers of two), and the device holds the buffer pool."""
    (single,) = _plan("cuda", batch=512)
    (off,) = _plan("cuda", batch=512, name="offload")
    assert 4 * FP32_WEIGHTS <= off.host_pinned <= 4 * 2 * FP32_WEIGHTS
    assert off.params < FP32_WEIGHTS // 2  # the block bound at the peak, not the whole model
    assert off.total - off.workspaces < single.total - single.workspaces
    (cpu_off,) = _plan("cpu", batch=512, name="offload")
    assert cpu_off.host_pinned == 0  # on the CPU the tier below is the disk


def softmax_head(features: int = 32, outputs: int = 4) -> nn.Module:
    """A model whose softmax takes the bf16 output of a matrix product: CUDA's autocast runs it in fp32."""
    return nn.Sequential(nn.Linear(features, outputs), nn.Softmax(-1))


def test_cpu_autocast_runs_what_cudas_runs_in_fp32_so_while_planning():
    """softmax on a bf16 input: fp32 under CUDA's autocast, bf16 under the CPU's; the plan's kernels make the CPU's
    do as CUDA's, in forward and in the recomputation of a checkpointed block, and are gone on exit."""
    account = CudaAccount(FakeTensorMode(), 0)
    layer, x = nn.Linear(8, 8), torch.randn(2, 8)
    with account.autocast_as_on_cuda():
        with torch.autocast("cpu", torch.bfloat16):
            y = checkpoint(lambda t: layer(t).softmax(-1), x, use_reentrant=False)
        assert y.dtype == torch.float32
        y.sum().backward()  # recomputed as in forward (checkpoint compares the two)
    with torch.autocast("cpu", torch.bfloat16):
        assert layer(x).softmax(-1).dtype == torch.bfloat16
    assert account.fp32_on_cuda == {"softmax": 1}  # forward's call, not the recomputation's


@no_gpu
@pytest.mark.parametrize("activations", ["device", "checkpoint"])
def test_ops_cuda_runs_in_fp32_are_named(activations):
    (p,) = _plan("cuda", model={"name": "custom", "_target_": f"{__name__}.softmax_head"}, activations=activations)
    assert p.fp32_on_cuda == {"softmax": 1}  # a step's forward calls it once
    (mlp,) = _plan("cuda")
    assert mlp.fp32_on_cuda == {}


@no_gpu
def test_auto_plans_a_cuda_run_without_a_gpu(tmp_path):
    cfg = Config()
    cfg.strategy.name, cfg.trainer.device = "auto", "cuda"
    with pytest.raises(ConfigError, match="memory.budget"):
        device_budget(cfg, 1)  # the GPU's memory is not here to read
    cfg.memory.budget = "80GB"
    validate(cfg, 1)
    chosen, found = choose(cfg, 1, tmp_path, progress=lambda line: None)
    assert chosen.strategy.name == "single" and chosen.trainer.device == "cuda"
    planned = [c for c in found if c.peak is not None]
    assert len(planned) == 4 and all(c.peak >= 2 * HOPPER_WORKSPACE for c in planned)  # planned as CUDA runs
