"""strategy=data (every ZeRO level) trains the same model to the same numbers as strategy=single."""
import pytest

from tests import cli

ARGS = ["data.task=regression", "model.args.depth=2"]


@pytest.fixture
def single(reference):
    return reference(cli.FAST + ARGS)


# name -> (processes, strategy keys): every ZeRO level on 2 ranks; hybrid sharding (Note [hybrid sharding] in
# parallel/dims.py) on 4, sharded within 2 groups of 2 ranks and replicated across them.
CASES = {**{f"zero{z}": (2, [f"strategy.zero={z}"]) for z in range(4)},
         "zero3_dp_replicate2": (4, ["strategy.zero=3", "strategy.dp_replicate=2"])}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_data_parallel_matches_single(single, tmp_path, case):
    nproc, keys = CASES[case]
    cli.run(cli.FAST + ARGS + [f"nproc={nproc}", "strategy=data", *keys, f"run_dir={tmp_path}"], cwd=tmp_path)
    cli.assert_same_training(tmp_path, single)
    assert len(cli.metrics(tmp_path)) == 6


@pytest.mark.timeout(240)
def test_gradient_accumulation_matches_single(single, tmp_path):
    cli.run(cli.FAST + ARGS + ["nproc=2", "strategy=data", "strategy.zero=3", "trainer.grad_accum=4",
                               f"run_dir={tmp_path}"], cwd=tmp_path)
    cli.assert_same_training(tmp_path, single)


@pytest.mark.timeout(240)
def test_user_model_trains_under_data(reference, tmp_path):
    user = ["model=custom", "model._target_=tests.user_model.two_tower", "+model.args.width=8"]
    ref = reference(cli.FAST + user)
    dp = tmp_path / "data"
    cli.run(cli.FAST + user + ["nproc=2", "strategy=data", "strategy.zero=2", f"run_dir={dp}"], cwd=tmp_path)
    cli.assert_same_training(dp, ref)
    assert set(cli.final_weights(dp)) == {"left.0.weight", "left.0.bias", "right.0.weight", "right.0.bias",
                                          "head.weight", "head.bias"}
    loss = cli.losses(dp)
    assert loss[-1] < loss[0]
