"""BatchNorm under parallelism without processes (Note [batch norm] in parallel/batchnorm.py): the warning at start,
turning layers into SyncBatchNorm, and running statistics kept across a recomputation."""
import pytest
import torch
from torch.distributed._composable import checkpoint

from parallel.batchnorm import SyncBatchNorm, batchnorm_warning, recompute_contexts, sync_batchnorm
from parallel.config import Config
from parallel.validate import resolve
from tests.hf_models import batchnorm_cnn


def resolved(world: int, trainer: dict | None = None, **strategy) -> Config:
    cfg = Config()
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    for key, value in (trainer or {}).items():
        setattr(cfg.trainer, key, value)
    return resolve(cfg, world)


@pytest.mark.parametrize("cfg,says", [
    (resolved(2, name="data"), ["per data-parallel rank", "over 16 samples", "sync_batchnorm=true"]),
    (resolved(2, name="pipeline"), ["per pipeline microbatch (strategy.microbatches=4)", "over 8 samples"]),
    (resolved(2, name="hybrid", dp=2, sync_batchnorm=True, trainer={"grad_accum": 2}),
     ["per accumulation micro-step (trainer.grad_accum=2)", "over 16 samples"]),
])
def test_the_run_says_when_batchnorm_sees_less_than_the_global_batch(cfg, says):
    warning = batchnorm_warning(batchnorm_cnn(), cfg)
    assert warning.startswith("BatchNorm statistics (stem.1, blocks.0.1, blocks.1.1)"), warning
    assert all(s in warning for s in says), warning


@pytest.mark.parametrize("cfg", [resolved(1), resolved(2, name="data", sync_batchnorm=True), resolved(2, name="model"),
                                 resolved(1, name="offload")], ids=["single", "synced", "tensor", "offload"])
def test_no_warning_where_batchnorm_sees_the_global_batch(cfg):
    assert batchnorm_warning(batchnorm_cnn(), cfg) is None


def test_no_warning_without_batchnorm():
    from parallel.models.mlp import build_mlp

    assert batchnorm_warning(build_mlp(in_features=32, out_features=4), resolved(2, name="data")) is None


def test_sync_batchnorm_keeps_names_tensors_and_hooks():
    model = batchnorm_cnn()
    checkpoint(model.stem[1])  # recomputation's hooks, applied before (as under a pipeline)
    before = dict(model.named_parameters()) | dict(model.named_buffers())
    assert sync_batchnorm(model, group=None) == 3
    assert all(type(m) is SyncBatchNorm for m in (model.stem[1], model.blocks[0][1], model.blocks[1][1]))
    after = dict(model.named_parameters()) | dict(model.named_buffers())
    assert {k: id(v) for k, v in after.items()} == {k: id(v) for k, v in before.items()}
    assert checkpoint.state(model.stem[1]) is not None
    x = torch.randn(4, 64)
    torch.manual_seed(0)
    reference = batchnorm_cnn()  # outside a process group it is the plain BatchNorm
    reference.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), reference(x))


def test_recomputed_block_moves_running_statistics_once():
    torch.manual_seed(0)
    plain, recomputed = batchnorm_cnn(), batchnorm_cnn()
    recomputed.load_state_dict(plain.state_dict())
    for block in recomputed.blocks:
        checkpoint(block, context_fn=recompute_contexts(block))
    x = torch.randn(8, 64)
    for model in (plain, recomputed):
        model(x).sum().backward()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(recomputed.state_dict()[name], value, rtol=0, atol=0, msg=name)
