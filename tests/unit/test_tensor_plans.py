"""Tensor-parallel plans: built-in, from config, and the errors for bad ones."""
import pytest
import torch
from torch import nn

from parallel.config import Config, ConfigError
from parallel.models import MODELS
from parallel.strategies.tensor import infer_plan, resolve_plan
from parallel.validate import validate


def _cfg(model="mlp", args=None, target=None, plan=(), tp=2) -> Config:
    cfg = Config()
    cfg.strategy.name, cfg.strategy.tp, cfg.strategy.tp_plan = "model", tp, list(plan)
    cfg.model.name, cfg.model._target_ = model, target
    cfg.model.args = args if args is not None else {"in_features": 32, "out_features": 4}
    return cfg


def test_mlp_plan_pairs_linears_colwise_then_rowwise():
    plan = MODELS["mlp"](32, 4, 64, depth=3).tp_plan(2)
    assert plan == {"inp": "colwise", "blocks.0.fc": "rowwise", "blocks.1.fc": "colwise",
                    "blocks.2.fc": "rowwise", "head": "replicate"}


def test_gpt_plan_shards_attention_and_mlp_and_gathers_the_head():
    plan = MODELS["gpt"](layers=1).tp_plan(2)
    assert plan["blocks.0.attn.q"] == "colwise" and plan["blocks.0.attn.out"] == "rowwise"
    assert plan["blocks.0.mlp.up"] == "colwise" and plan["blocks.0.mlp.down"] == "rowwise"
    assert plan["head"] == "colwise_gather"
    assert MODELS["gpt"](layers=1, tie_embeddings=True).tp_plan(2)["head"] == "replicate"


def test_user_plan_patterns_expand_over_module_names():
    cfg = _cfg("custom", {}, "tests.user_model.feed_forwards", ["pairs.*.up:colwise", "pairs.*.down:rowwise"])
    validate(cfg, 2)
    from parallel.models.build import build_meta_model

    plan = resolve_plan(build_meta_model(cfg.model), 2, cfg.strategy.tp_plan)
    assert plan == {"pairs.0.up": "colwise", "pairs.1.up": "colwise", "pairs.0.down": "rowwise",
                    "pairs.1.down": "rowwise"}


BAD = [
    (dict(model="gpt", args={"heads": 3, "dim": 48}), 2, "strategy.tp"),  # 3 heads over tp 2
    (dict(args={"in_features": 32, "out_features": 4, "hidden": 64}), 3, "strategy.tp"),  # 64 over tp 3
    (dict(target="tests.user_model.feed_forwards", model="custom", args={}, plan=["nothing.*:colwise"]), 2,
     "strategy.tp_plan"),
    (dict(target="tests.user_model.feed_forwards", model="custom", args={}, plan=["pairs.*.up:diagonal"]), 2,
     "strategy.tp_plan"),
    (dict(target="tests.user_model.feed_forwards", model="custom", args={}, plan=["pairs.*.up"]), 2,
     "strategy.tp_plan"),
    (dict(model="cnn", args={"in_features": 64, "out_features": 10}), 2, "strategy.tp_plan"),  # no plan
    (dict(target="tests.user_model.feed_forwards", model="custom", args={}, plan=["pairs:colwise"]), 2,
     "strategy.tp_plan"),  # a ModuleDict is not a Linear
]


@pytest.mark.parametrize("kwargs,world,key", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_plans_fail_naming_the_key(kwargs, world, key):
    kwargs = dict(kwargs)
    cfg = _cfg(**kwargs, tp=None)
    with pytest.raises(ConfigError) as info:
        validate(cfg, world)
    assert str(info.value).startswith(key), str(info.value)


def test_plan_needs_strategy_model():
    cfg = _cfg(plan=["inp:colwise"])
    cfg.strategy.name = "data"
    with pytest.raises(ConfigError, match="strategy.tp_plan"):
        validate(cfg, 2)


class _Gated(nn.Module):
    """up -> softmax -> down -> a -> gelu -> b: softmax mixes features, so up and down must not be
    paired; down feeds a directly, so they pair, which leaves b whole."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        x = self.down(torch.softmax(self.up(x), dim=-1))
        return self.b(torch.nn.functional.gelu(self.a(x)) * 2)


class _Branches(nn.Module):
    """a and b both read x: b runs right after a with matching widths, but does not take a's output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) + self.b(x)


def test_inferred_plan_pairs_linears_joined_by_elementwise_ops_only():
    from tests.user_model import feed_forwards

    with torch.device("meta"):
        plan = infer_plan(feed_forwards(), (torch.zeros(2, 32, device="meta"),))
        gated = infer_plan(_Gated(), (torch.zeros(2, 8, device="meta"),))
        with pytest.raises(ConfigError, match="none could be inferred"):
            infer_plan(_Branches(), (torch.zeros(2, 8, device="meta"),))
    assert plan == {"pairs.0.up": "colwise", "pairs.0.down": "rowwise", "pairs.1.up": "colwise",
                    "pairs.1.down": "rowwise"}
    assert gated == {"down": "colwise", "a": "rowwise"}


class _Masked(nn.Module):
    """up -> gelu -> times a mask of its own width -> down: the mask is whole on every rank, so up's slice of
    features cannot meet it: nothing pairs."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.mask = nn.Parameter(torch.ones(16))

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)) * self.mask)


def test_a_swiglu_mlp_is_inferred_with_gate_and_up_colwise_and_down_rowwise():
    """w2(silu(w1(x)) * w3(x)): two Linears feed the third through elementwise ops; the old rule (the Linear that
    ended last feeds the next) paired w3 and w2 alone and left w1 whole, which failed at the first step."""
    from tests.user_model import swiglu

    with torch.device("meta"):
        plan = infer_plan(swiglu(), (torch.zeros(2, 32, device="meta"),))
        with pytest.raises(ConfigError, match="none could be inferred"):
            infer_plan(_Masked(), (torch.zeros(2, 8, device="meta"),))
    assert plan == {f"blocks.{i}.{name}": style for i in (0, 1)
                    for name, style in (("w1", "colwise"), ("w3", "colwise"), ("w2", "rowwise"))}


def test_sequence_parallel_needs_a_model_with_a_sequence_plan():
    cfg = _cfg(args={"in_features": 32, "out_features": 4, "hidden": 64})
    cfg.strategy.sequence_parallel = True
    with pytest.raises(ConfigError, match="strategy.sequence_parallel"):
        validate(cfg, 2)


def test_fused_qkv_with_grouped_query_attention_is_inferred_with_its_attention_whole():
    """torchtitan's Llama 3 layout: wqkv's output is viewed and split into q, k and v (no elementwise op), so the
    attention stays whole; each SwiGLU feed-forward pairs (tests/distributed/test_tensor_parallel.py trains it)."""
    from tests.user_model import titan_llama

    with torch.device("meta"):
        plan = infer_plan(titan_llama(), (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    assert plan == {f"layers.{i}.feed_forward.{name}": style for i in (0, 1)
                    for name, style in (("w1", "colwise"), ("w3", "colwise"), ("w2", "rowwise"))}


TITAN = dict(model="custom", target="tests.user_model.titan_llama", args={})
REFUSED = [  # (a plan whose every style fits its module, the start of the error's text past the key)
    (dict(target="tests.user_model.swiglu", model="custom", args={}, plan=["blocks.*.w1:colwise",
                                                                          "blocks.*.w2:rowwise"]),
     "a rank's forward in blocks.0 (SwiGLUBlock, which holds blocks.0.w1:colwise, blocks.0.w2:rowwise) under tp 2 "
     "fails (RuntimeError: Attempting to broadcast a dimension of length 64"),  # w3, SwiGLU's up, left whole
    (dict(TITAN, plan=["layers.*.attention.wqkv:colwise"]),
     "a rank's forward in layers.0.attention.wo (Linear, which the plan leaves whole) under tp 2 fails "
     "(RuntimeError: a and b must have same reduction dim"),  # the fused projection's output split, wo whole
    (dict(TITAN, plan=["lm_head:colwise"]),
     "a rank's forward of TitanLlama under tp 2 gives outputs of shapes (2, 16, 32) where the whole model's are "
     "(2, 16, 64): a layer's output left split reaches the output"),
]


@pytest.mark.parametrize("kwargs,rule", REFUSED, ids=["swiglu_up_whole", "wqkv_without_wo", "logits_split"])
def test_a_plan_that_does_not_fit_the_forward_is_refused_naming_the_layers(kwargs, rule):
    """Rehearsed on fake tensors before any worker starts (Note [plan rehearsal]); the error names where it failed,
    the plan's entries there and the plan tried."""
    cfg = _cfg(**kwargs)
    if kwargs.get("target") == TITAN["target"]:
        cfg.data.task, cfg.data.seq_len = "lm", 16
    with pytest.raises(ConfigError) as info:
        validate(cfg, 2)
    text = str(info.value)
    assert text.startswith(f"strategy.tp_plan={kwargs['plan']!r}: {rule}"), text
    assert text.endswith(f"[the plan tried: {', '.join(kwargs['plan'])}]") and "\n" not in text, text
