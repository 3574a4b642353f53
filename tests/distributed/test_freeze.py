"""model.freeze: the matched weights stay as initialized and hold no optimizer state, and every strategy trains
the rest to the same numbers as strategy=single with the same patterns."""
import pytest
import torch

from parallel.config import ModelConfig
from parallel.models.build import build_model
from parallel.models.recipe import model_recipe
from tests import cli

# A whole block and one tensor of the root (so FSDP units hold frozen and trainable parameters together).
FREEZE = ["model.freeze=[blocks.0.*,head.bias]", "model.args.depth=2"]
FROZEN = {"blocks.0.fc.weight", "blocks.0.fc.bias", "head.bias"}


@pytest.fixture
def single(reference):
    return reference(cli.FAST + FREEZE)


def test_frozen_weights_stay_as_initialized_without_optimizer_state(single):
    recipe = model_recipe(ModelConfig(args={"in_features": 32, "out_features": 4, "depth": 2}))
    initial = build_model(recipe, seed=0).state_dict()
    final = cli.final_weights(single)
    for name, value in initial.items():
        if name in FROZEN:
            torch.testing.assert_close(final[name], value, rtol=0, atol=0, msg=name)
        else:
            assert not torch.equal(final[name], value), f"{name} did not train"
    trainable = sum(v.numel() for n, v in initial.items() if n not in FROZEN)
    # AdamW keeps two fp32 moments per trainable weight (its step counters are scalars, not counted).
    assert cli.metrics(single)[-1]["optim_state_bytes_per_rank"] == [2 * 4 * trainable]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", [["nproc=2", "strategy=data", "strategy.zero=3"],
                                      ["nproc=2", "strategy=data", "strategy.zero=0"],
                                      ["nproc=2", "strategy=pipeline"],
                                      ["nproc=2", "strategy=model"],
                                      ["strategy=offload"]],
                         ids=["data_zero3", "data_zero0", "pipeline", "model", "offload"])
def test_every_strategy_trains_the_rest_as_single(single, tmp_path, strategy):
    cli.run(cli.FAST + FREEZE + strategy + [f"run_dir={tmp_path}"], cwd=tmp_path)
    cli.assert_same_training(tmp_path, single)
