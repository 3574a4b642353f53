"""trainer.compile's checks and plans, without compiling (parallel/strategies/compile.py)."""
import dataclasses

import pytest
import torch

from parallel.blocks import repeated_blocks
from parallel.config import Config, ConfigError
from parallel.models.build import build_meta_model
from parallel.planning.planner import plan
from parallel.strategies.compile import CompileClock
from parallel.validate import validate


def gpt_cfg(**strategy) -> Config:
    cfg = Config()
    cfg.model.name, cfg.model.args = "gpt", {"vocab_size": 64, "seq_len": 16, "dim": 32, "heads": 4, "layers": 2,
                                             "mlp_ratio": 4}
    cfg.data.task, cfg.data.seq_len, cfg.data.vocab_size = "lm", 16, 64
    cfg.trainer.compile = True
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    return cfg


def test_the_repeated_blocks_are_the_items_of_the_lists():
    assert repeated_blocks(build_meta_model(gpt_cfg().model)) == ["blocks.0", "blocks.1"]
    assert repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) == ["0", "1"]
    assert repeated_blocks(torch.nn.Linear(2, 2)) == []


@pytest.mark.parametrize("strategy,world", [("single", 1), ("data", 2), ("model", 2), ("pipeline", 2)])
def test_compiling_strategies_pass(strategy, world):
    validate(gpt_cfg(name=strategy), world)


def test_offload_is_a_config_error_naming_the_strategy():
    with pytest.raises(ConfigError) as info:
        validate(gpt_cfg(name="offload"), 1)
    message = str(info.value)
    assert message.startswith("trainer.compile=True") and "strategy=offload" in message, message
    assert "trainer.compile=false" in message


def test_a_model_without_repeated_blocks_is_a_config_error():
    cfg = Config()
    cfg.model.name, cfg.model.args = "local", {}
    cfg.data.features, cfg.data.classes, cfg.data.task = 40, 4, "classification"
    cfg.trainer.compile = True
    with pytest.raises(ConfigError) as info:
        validate(cfg, 1)
    message = str(info.value)
    assert message.startswith("trainer.compile=True") and "model=local" in message and "none" in message, message


def test_the_planner_plans_a_compiled_run_as_the_eager_one():
    strategy, world = "single", 1
    clock = CompileClock()
    try:
        compiled, eager = gpt_cfg(name=strategy), gpt_cfg(name=strategy)
        eager.trainer = dataclasses.replace(eager.trainer, compile=False)
        for cfg in (compiled, eager):
            validate(cfg, world)
        got, want = plan(compiled, world), plan(eager, world)
    finally:
        clock.close()
    assert [dataclasses.asdict(p) for p in got] == [dataclasses.asdict(p) for p in want]
    assert clock.count == 0  # nothing was compiled (Note [regional compilation])


def test_blocks_of_torchs_own_classes_are_a_config_error():
    cfg = Config()
    cfg.model.name, cfg.model.args = "cnn", {}
    cfg.trainer.compile = True
    assert repeated_blocks(build_meta_model(cfg.model)) == ["blocks.0", "blocks.1"]  # each an nn.Sequential
    with pytest.raises(ConfigError) as info:
        validate(cfg, 1)
    message = str(info.value)
    assert message.startswith("trainer.compile=True") and "Sequential" in message, message
