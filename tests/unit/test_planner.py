"""The planner's communication count in one process (fake tensors, fake process group): every collective counted
as the bytes that leave the rank (Note [comm bytes]), so data parallelism's gradients, FSDP's gathers and
reduce-scatters, expert parallelism's all-to-alls and context parallelism's exchange are in a plan's comm_bytes,
as Note [auto] states them."""
import pytest
import torch

from parallel.config import Config
from parallel.models.build import build_meta_model
from parallel.planning.planner import plan
from parallel.strategies.data import blocks_of
from parallel.validate import validate

BATCH, SEQ, DIM, LAYERS = 8, 16, 32, 2
MOE = {"vocab_size": 64, "seq_len": SEQ, "dim": DIM, "heads": 4, "layers": LAYERS, "experts": 4, "top_k": 2}
GPT = {"vocab_size": 64, "seq_len": SEQ, "dim": DIM, "heads": 4, "layers": LAYERS}


def _config(model: str, args: dict, **strategy) -> Config:
    cfg = Config()
    cfg.model.name, cfg.model.args, cfg.data.task = model, dict(args), "lm"
    cfg.data.seq_len, cfg.trainer.batch_size = SEQ, BATCH
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    return cfg


def _planned(model: str, args: dict, world: int, **strategy):
    cfg = _config(model, args, **strategy)
    validate(cfg, world)
    (only,) = plan(cfg, world)  # no pipeline: every rank has the one role
    return only


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# The loss's token count of the step (an int64: Note [global loss]), all-reduced over the data-parallel ranks.
COUNT = 8


@pytest.mark.parametrize("world", [2, 4])
def test_data_zero_0_sends_the_gradients_all_reduced(world):
    """DDP's buckets all-reduced over W ranks send 2 (W - 1) / W x the gradients, and nothing else but the
    loss's count, all-reduced by the same rule."""
    grads = _bytes(build_meta_model(_config("gpt", GPT).model))
    sent = _planned("gpt", GPT, world, name="data", zero=0).comm_bytes
    assert sent == 2 * (world - 1) * grads // world + 2 * (world - 1) * COUNT // world


def test_data_zero_3_sends_the_gathers_and_reduce_scatters():
    """FSDP2 over W = 2: each block gathered in forward and again in backward, the root (which keeps its
    parameters from forward to backward) once, each sending (W - 1) / W of the full weights; every gradient
    reduce-scattered, sending (W - 1) / W of it."""
    model = build_meta_model(_config("gpt", GPT).model)
    blocks = sum(_bytes(b) for b in blocks_of(model))
    root = _bytes(model) - blocks
    gathers, reduce_scatters = (2 * blocks + root) // 2, (blocks + root) // 2
    assert _planned("gpt", GPT, 2, name="data", zero=3).comm_bytes == gathers + reduce_scatters + COUNT


def test_hybrid_sharding_sends_the_groups_gathers_and_the_replicas_all_reduce():
    """HSDP, 4 ranks in 2 groups of 2 (Note [hybrid sharding] in parallel/dims.py): zero 3's gathers and
    reduce-scatters over a group of 2, then each gradient shard all-reduced across the 2 groups, sending
    2 (R - 1) / R x the shard; the loss's count over all 4 ranks."""
    model = build_meta_model(_config("gpt", GPT).model)
    blocks = sum(_bytes(b) for b in blocks_of(model))
    root = _bytes(model) - blocks
    gathers, reduce_scatters, shards = (2 * blocks + root) // 2, (blocks + root) // 2, (blocks + root) // 2
    planned = _planned("gpt", GPT, 4, name="data", zero=3, dp_replicate=2)
    assert planned.work["comm"]["allreduce/2"][1] == shards  # handed the shards: 1 / 2 of the gradients
    assert planned.comm_bytes == gathers + reduce_scatters + 2 * (2 - 1) * shards // 2 + 2 * 3 * COUNT // 4


def _all_to_all_formula(dp: int, ep: int) -> int:
    """Note [auto]: per MoE layer 4 x n x k x d x b x (ep - 1) / ep, plus the counts' E x 8 x (ep - 1) / ep."""
    n, k, experts, fp32 = BATCH // (dp * ep) * SEQ, MOE["top_k"], MOE["experts"], 4
    return LAYERS * (4 * n * k * DIM * fp32 + experts * 8) * (ep - 1) // ep


@pytest.mark.parametrize("world,strategy", [(2, {"name": "expert"}), (4, {"name": "hybrid", "dp": 2, "ep": 2})],
                         ids=["ep2", "dp2_ep2"])
def test_expert_parallel_plans_count_the_all_to_alls(world, strategy):
    p = _planned("moe", MOE, world, **strategy)
    assert p.all_to_all_bytes == _all_to_all_formula(strategy.get("dp", 1), 2)
    assert p.comm_bytes > p.all_to_all_bytes  # part of comm, beside the gradients' all-reduce


def test_a_data_parallel_plan_of_the_same_model_has_no_all_to_all():
    p = _planned("moe", MOE, 2, name="data")
    assert p.all_to_all_bytes == 0 and p.comm_bytes > 0


def test_context_parallel_plans_count_the_key_value_exchange():
    """cp 2 against data 2 (the same gradients all-reduced): the difference is the exchange of Note [auto]."""
    cp, heads = 2, GPT["heads"]
    # Keys and values of a rank's 2L = SEQ / cp tokens, all samples (cp ranks read the same ones), fp32.
    local = 2 * BATCH * heads * (SEQ // cp) * (DIM // heads) * 4
    # Per layer: all-gathered in forward and in backward (each rank sends its chunk to the cp - 1 others), the
    # gradients of every chunk all-reduced (cp x local, of which 2 (cp - 1) / cp leave the rank).
    exchange = LAYERS * (2 * (cp - 1) * local + 2 * (cp - 1) * cp * local // cp)
    got = _planned("gpt", GPT, 2, name="context").comm_bytes - _planned("gpt", GPT, 2, name="data").comm_bytes
    assert got == exchange


def test_a_plan_leaves_no_auxiliary_weight_behind():
    """After a plan, a model trained in the same process (a user's own loop) weighs its auxiliary terms itself
    (Note [auxiliary weight] in parallel/aux_weight.py): the planned step's weight was handed to the planned
    model's layers, and nothing of it stays in the process."""
    from parallel.models.moe import build_moe

    def router_grad() -> torch.Tensor:
        torch.manual_seed(0)
        model = build_moe(vocab_size=16, seq_len=8, dim=16, heads=2, layers=1, experts=4, top_k=2, aux_coef=0.5)
        model(torch.randint(0, 16, (3, 8))).sum().backward()
        return model.blocks[0].mlp.router.weight.grad

    before = router_grad()
    _planned("moe", MOE, 2, name="expert")
    torch.testing.assert_close(router_grad(), before, rtol=0, atol=0)
