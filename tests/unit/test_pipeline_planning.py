"""Pipeline planning without processes: schedules, balancing, and bad input."""
import pytest
import torch

from parallel.blocks import candidates
from parallel.config import Config, ConfigError
from parallel.models.build import build_meta_model
from parallel.runtime import Runtime
from parallel.strategies.pipeline import partition, plan_split, schedules, split
from parallel.validate import validate
from tests.user_model import Heavy


def test_schedule_names_are_case_insensitive_and_complete():
    assert schedules.canonical("gpipe") == "GPipe" and schedules.canonical("zbvzerobubble") == "ZBVZeroBubble"
    assert schedules.canonical("nope") is None
    assert [schedules.default_stages_per_rank(s) for s in schedules.SCHEDULES] == [1, 1, 2, 2, 2, 2, 2]


def test_stage_placement():
    assert schedules.stage_ranks("1F1B", 4, 1) == [0, 1, 2, 3]
    assert schedules.stage_ranks("Interleaved1F1B", 2, 2) == [0, 1, 0, 1]
    # V: the first and last stage share rank 0.
    assert schedules.stage_ranks("ZBVZeroBubble", 2, 2) == [0, 1, 1, 0]
    assert schedules.stage_ranks("DualPipeV", 3, 2) == [0, 1, 2, 2, 1, 0]


def test_analytic_bubble():
    assert schedules.analytic_bubble("1F1B", 2, 1, 4) == pytest.approx(1 / 5)
    assert schedules.analytic_bubble("GPipe", 4, 1, 8) == pytest.approx(3 / 11)
    assert schedules.analytic_bubble("Interleaved1F1B", 2, 2, 4) == pytest.approx(1 / 9)
    assert schedules.analytic_bubble("ZBVZeroBubble", 2, 2, 8) == 0.0
    assert schedules.analytic_bubble("1F1B", 1, 1, 4) == 0.0


def _stage_costs(costs, starts):
    bounds = starts + [len(costs)]
    return [sum(costs[bounds[i]:bounds[i + 1]]) for i in range(len(starts))]


@pytest.mark.parametrize("balance", ["params", "memory", "time"])
def test_balancer_evens_out_a_heavy_block_where_equal_layers_do_not(balance):
    # 4 + 16 x 1: an even split exists (4 + 6 | 10); an equal-layer one (9 | 8 blocks) is 12 | 8.
    with torch.device("meta"):
        model = Heavy(width=256, light=16)
    example = (torch.zeros(128, 256, device="meta"),)
    names, inputs = candidates(model, example)
    assert names == [f"blocks.{i}" for i in range(17)]
    blocks = partition.measure(model, names, inputs, repeats=7)
    costs = [partition.cost_of(b, balance) for b in blocks]
    balanced = _stage_costs(costs, partition.balance(costs, 2))
    equal = _stage_costs(costs, partition.equal_split(len(costs), 2))
    assert max(balanced) / min(balanced) <= 1.15, (balance, balanced)
    assert max(equal) / min(equal) > 1.15, (balance, equal)
    # The heavy block was measured as the heavy one.
    assert costs[0] > 3 * max(costs[1:]) * (0.5 if balance == "time" else 1)


def test_balancer_respects_a_memory_budget():
    costs = [1.0, 1.0, 1.0, 1.0]
    memory = [30, 10, 10, 10]
    assert partition.balance(costs, 2) == [0, 2]  # 2 + 2 blocks, but the first stage needs 40
    assert partition.balance(costs, 2, memory, budget=40) == [0, 2]
    assert partition.balance(costs, 2, memory, budget=35) == [0, 1]  # slower, but it fits
    with pytest.raises(ValueError, match="no split"):
        partition.balance(costs, 2, memory, budget=25)


def test_the_split_holds_what_one_rank_holds_against_the_budget():
    """A stage's memory in the split's budget check is one rank's: under strategy=hybrid with dp 4 and zero 3 a
    quarter of its weights, gradients and optimizer state; under strategy.activations=checkpoint a repeated
    block's input alone for each microbatch in flight (a budget no split fits otherwise fits then)."""
    blocks = [partition.BlockCost(f"b{i}", 10, 400, act_bytes=100, input_bytes=10, repeated=True) for i in range(4)]
    cfg = Config()
    cfg.strategy.name, cfg.strategy.dp, cfg.strategy.pp, cfg.memory.budget = "hybrid", 4, 2, "2KB"
    cfg.strategy.balance = "params"  # equal blocks: an even split where it fits
    with pytest.raises(ConfigError, match="memory.budget=2KB: no split into 2 stages fits"):
        split._balanced_starts(cfg, blocks, 2, set(range(4)), in_flight=2)  # 2 x (1600 + 200) per stage
    cfg.strategy.zero = 3
    assert split._balanced_starts(cfg, blocks, 2, set(range(4)), 2) == [0, 2]  # 2 x (400 + 200)
    cfg.strategy.zero, cfg.strategy.activations = 0, "checkpoint"
    cfg.memory.budget = "3.3KB"
    assert split._balanced_starts(cfg, blocks, 2, set(range(4)), 2) == [0, 2]  # 2 x (1600 + 20)


def _pipeline_cfg(**strategy) -> Config:
    cfg = Config()
    cfg.strategy.name = "pipeline"
    cfg.model.args = {"in_features": 32, "out_features": 4, "depth": 2}
    for k, v in strategy.items():
        setattr(cfg.strategy, k, v)
    return cfg


BAD = [
    ({"microbatches": 0}, "strategy.microbatches"),
    ({"microbatches": 5}, "strategy.microbatches"),
    ({"schedule": "zigzag"}, "strategy.schedule"),
    ({"schedule": "ZBVZeroBubble", "stages_per_rank": 1}, "strategy.schedule"),
    ({"schedule": "1F1B", "stages_per_rank": 2}, "strategy.schedule"),
    ({"schedule": "DualPipeV", "microbatches": 2}, "strategy.schedule"),
    ({"schedule": "Interleaved1F1B", "microbatches": 8, "stages_per_rank": 4}, "strategy.pp"),
    ({"split_points": ["blocks.9"]}, "strategy.split_points"),
    ({"split_points": ["inp"]}, "strategy.split_points"),
    ({"split_points": ["blocks.0", "blocks.1"]}, "strategy.split_points"),
    ({"balance": "vibes"}, "strategy.balance"),
    # a backward in two halves recomputes twice, which torch's checkpoint cannot
    ({"schedule": "ZBVZeroBubble", "stages_per_rank": 2, "activations": "checkpoint"}, "strategy.activations"),
    ({"schedule": "InterleavedZeroBubble", "stages_per_rank": 2, "activations": "selective"},
     "strategy.activations"),
    ({"dp": 2}, "strategy.dp"),
]


@pytest.mark.parametrize("changes,key", BAD, ids=[k + str(list(c.values())) for c, k in BAD])
def test_bad_pipeline_input_names_the_key(changes, key):
    with pytest.raises(ConfigError) as info:
        validate(_pipeline_cfg(**changes), world_size=2)
    assert str(info.value).startswith(key), str(info.value)


def test_grad_accum_is_refused_under_pipeline():
    cfg = _pipeline_cfg()
    cfg.trainer.grad_accum = 2
    with pytest.raises(ConfigError, match="trainer.grad_accum"):
        validate(cfg, 2)


def test_untraceable_model_says_what_to_do():
    cfg = _pipeline_cfg()
    cfg.model.name, cfg.model._target_, cfg.model.args = "custom", "tests.user_model.Branchy", {}
    with pytest.raises(ConfigError, match="cannot be traced.*strategy=data"):
        validate(cfg, 2)


def test_valid_pipeline_config_fills_derived_values():
    cfg = _pipeline_cfg(schedule="interleaved1f1b")
    validate(cfg, 2)
    s = cfg.strategy
    assert (s.schedule, s.pp, s.dp, s.stages_per_rank, s.microbatches) == ("Interleaved1F1B", 2, 1, 2, 8)


def test_split_where_integers_cross_is_refused_and_the_balancer_avoids_it():
    cfg = _pipeline_cfg(schedule="1F1B", split_points=["pos"])
    cfg.data.task, cfg.model.name = "lm", "gpt"
    cfg.model.args = {"vocab_size": 64, "seq_len": 32, "layers": 1}
    with pytest.raises(ConfigError, match=r"strategy.split_points.*integer tensors"):
        validate(cfg, 2)
    cfg.strategy.split_points = []
    split = plan_split(build_meta_model(cfg.model), cfg, 1, Runtime(time_blocks=False))
    assert split.starts[1] != "pos"


@pytest.fixture
def traces(monkeypatch):
    """Every trace of a split from here on, with no boundaries known yet (Note [a split's boundaries, once])."""
    from parallel.strategies.pipeline import split as split_module

    traced = []
    real = split_module.trace
    monkeypatch.setattr(split_module, "trace", lambda *a: traced.append(1) or real(*a))
    monkeypatch.setattr(split_module, "_KNOWN_BOUNDARIES", {})
    return traced


def _boundaries_of(model, cfg: Config, dp: int = 1):
    from parallel.strategies.pipeline import split as split_module

    example = split_module.example_microbatch(cfg, dp)
    names, _ = candidates(model, *split_module.by_name(example))
    return split_module._boundaries(model, example, names)


def test_a_splits_boundaries_are_traced_once_for_each_model_and_microbatch_shape(traces, monkeypatch):
    """Note [a split's boundaries, once]: the config check's trace serves the workers forked after it; a model
    that differs in its shapes, a plain attribute or its class's forward, or another microbatch shape, traces
    anew."""
    cfg = _pipeline_cfg(schedule="1F1B")
    cfg.data.task, cfg.model.name = "lm", "gpt"
    cfg.model.args = {"vocab_size": 64, "seq_len": 32, "layers": 2, "dim": 32, "heads": 4}
    validate(cfg, 2)  # the config check, as the launcher makes it before forking the workers
    assert len(traces) == 1
    first = _boundaries_of(build_meta_model(cfg.model), cfg)  # a worker's: the same model, built again
    assert first[1] and len(traces) == 1
    _boundaries_of(build_meta_model(cfg.model), cfg, dp=2)  # microbatches half as large
    cfg.model.args["dim"] = 64
    wider = build_meta_model(cfg.model)
    _boundaries_of(wider, cfg)
    wider.blocks[0].attn.heads = 8  # a plain attribute the forward reads
    _boundaries_of(wider, cfg)
    assert len(traces) == 4
    monkeypatch.setattr(type(wider.blocks[0]), "forward", lambda self, x: x)
    _boundaries_of(wider, cfg)
    assert len(traces) == 5


def test_an_attribute_whose_text_fails_leaves_the_split_to_be_traced(traces):
    """A model holding an attribute whose repr raises is traced each time (Note [a split's boundaries, once])."""

    class Unprintable:
        def __repr__(self):
            raise RuntimeError("no text")

    cfg = _pipeline_cfg()
    validate(cfg, 2)
    traces.clear()
    model = build_meta_model(cfg.model)
    model.note = Unprintable()
    assert _boundaries_of(model, cfg) == _boundaries_of(model, cfg)
    assert len(traces) == 2
