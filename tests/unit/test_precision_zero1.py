"""Mixed precision and ZeRO 1 in plans (one process, fake tensors): what bf16 halves (FSDP2's gathers, a bf16
gradient reduction) and what ZeRO 1 shards (the optimizer state, wherever strategy.zero is accepted), Note
[mixed precision] in parallel/strategies/data.py and Note [ZeRO 1] in parallel/optim.py."""
import pytest

from parallel.models.build import build_meta_model
from parallel.planning.planner import plan
from parallel.strategies.data import blocks_of
from parallel.validate import validate
from tests.unit.test_planner import COUNT, GPT, MOE, _bytes, _config


def _plan(model: str, args: dict, world: int, trainer: dict | None = None, **strategy):
    cfg = _config(model, args, **strategy)
    for key, value in (trainer or {}).items():
        setattr(cfg.trainer, key, value)
    validate(cfg, world)
    return plan(cfg, world)


def test_bf16_zero_3_gathers_bf16_copies_and_reduces_fp32_gradients():
    """Data zero 3 over 2 ranks at bf16: the gathers (each block twice, the root once) carry bf16 copies, half
    the fp32 bytes; the reduce-scatters stay fp32 (trainer.reduce_precision=fp32): about 2/3 of the fp32 plan."""
    model = build_meta_model(_config("gpt", GPT).model)
    blocks = sum(_bytes(b) for b in blocks_of(model))
    root = _bytes(model) - blocks
    gathers, reduce_scatters = (2 * blocks + root) // 2, (blocks + root) // 2
    (fp32,) = _plan("gpt", GPT, 2, name="data", zero=3)
    (bf16,) = _plan("gpt", GPT, 2, {"precision": "bf16"}, name="data", zero=3)
    assert fp32.comm_bytes == gathers + reduce_scatters + COUNT
    assert bf16.comm_bytes == gathers // 2 + reduce_scatters + COUNT
    assert 0.6 < bf16.comm_bytes / fp32.comm_bytes < 0.7
    (low,) = _plan("gpt", GPT, 2, {"precision": "bf16", "reduce_precision": "bf16"}, name="data", zero=3)
    assert low.comm_bytes == (gathers + reduce_scatters) // 2 + COUNT
    # The fp32 master weights stay: a rank holds its fp32 shard, whatever the precision.
    assert bf16.params >= fp32.params // 2 > 0


def test_bf16_gradient_reduction_under_ddp_sends_half():
    grads = _bytes(build_meta_model(_config("gpt", GPT).model))
    (fp32,) = _plan("gpt", GPT, 2, name="data", zero=0)
    (bf16,) = _plan("gpt", GPT, 2, {"reduce_precision": "bf16"}, name="data", zero=0)
    # A ring all-reduce over 2 ranks sends 2 (W - 1) / W = 1 x what it reduces; the loss's count stays an int64.
    assert fp32.comm_bytes == grads + COUNT
    assert bf16.comm_bytes == grads // 2 + COUNT


# name -> (model, args, world, strategy)
ZERO1 = {
    "data": ("gpt", GPT, 2, {"name": "data"}),
    "context": ("gpt", GPT, 2, {"name": "context"}),
    "hybrid_dp2_tp2": ("gpt", GPT, 4, {"name": "hybrid", "dp": 2, "tp": 2}),
    "hybrid_dp2_pp2": ("gpt", GPT, 4, {"name": "hybrid", "dp": 2, "pp": 2}),
}


@pytest.mark.parametrize("case", list(ZERO1))
def test_zero_1_halves_the_optimizer_state_on_two_data_parallel_ranks(case):
    model, args, world, strategy = ZERO1[case]
    zero0 = _plan(model, args, world, zero=0, **strategy)
    zero1 = _plan(model, args, world, zero=1, **strategy)
    for r0, r1 in zip(zero0, zero1):  # a pipeline plans each stage's role
        assert r0.params == r1.params and r0.grads == r1.grads  # zero 1 shards the optimizer state alone
        assert 0.4 < r1.optimizer / r0.optimizer < 0.6, (r0.optimizer, r1.optimizer)


def test_zero_1_under_expert_parallelism_shards_the_dense_state_over_dp_x_ep():
    """ep 2 on 2 ranks: the dense weights are held by both ranks (dp x ep), and ZeRO 1 halves their AdamW state
    (two fp32 tensors per weight); each rank's experts are its own (dp 1), and their state stays whole."""
    model = build_meta_model(_config("moe", MOE).model)
    dense = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." not in n)
    (zero0,) = _plan("moe", MOE, 2, name="expert", zero=0)
    (zero1,) = _plan("moe", MOE, 2, name="expert", zero=1)
    saved = zero0.optimizer - zero1.optimizer
    assert abs(saved - dense) < 0.05 * dense, (saved, dense)  # 2 x dense / 2, to the owners' balance
