"""The planner's communication count in one process (fake tensors, fake process group): expert parallelism's
all-to-alls and context parallelism's exchange are in a plan's comm_bytes, as Note [auto] states them."""
import pytest

from parallel.config import Config
from parallel.planner import plan
from parallel.validate import validate

BATCH, SEQ, DIM, LAYERS = 8, 16, 32, 2
MOE = {"vocab_size": 64, "seq_len": SEQ, "dim": DIM, "heads": 4, "layers": LAYERS, "experts": 4, "top_k": 2}
GPT = {"vocab_size": 64, "seq_len": SEQ, "dim": DIM, "heads": 4, "layers": LAYERS}


def _planned(model: str, args: dict, world: int, **strategy):
    cfg = Config()
    cfg.model.name, cfg.model.args, cfg.data.task = model, dict(args), "lm"
    cfg.data.seq_len, cfg.trainer.batch_size = SEQ, BATCH
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    validate(cfg, world)
    (only,) = plan(cfg, world)  # no pipeline: every rank has the one role
    return only


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
    # Per layer: all-gathered in forward and in backward (cp outputs + the input each), gradients of every
    # chunk all-reduced (cp x local, counted twice).
    exchange = LAYERS * (2 * (cp + 1) * local + 2 * cp * local)
    got = _planned("gpt", GPT, 2, name="context").comm_bytes - _planned("gpt", GPT, 2, name="data").comm_bytes
    assert got == exchange
