"""Tensor-parallel plans: built-in, from config, and the errors for bad ones."""
import pytest

from parallel.config import Config, ConfigError, validate
from parallel.models import MODELS
from parallel.strategies.tensor import resolve_plan


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
    from parallel.config import build_meta_model

    plan = resolve_plan(build_meta_model(cfg.model), cfg)
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
