"""strategy=data (every ZeRO level) trains the same model to the same numbers as strategy=single."""
import pytest

from tests import cli

ARGS = ["data.task=regression", "model.args.depth=2"]


@pytest.fixture
def single(reference):
    return reference(cli.FAST + ARGS)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_matches_single(single, tmp_path, zero):
    cli.run(cli.FAST + ARGS + ["nproc=2", "strategy=data", f"strategy.zero={zero}", f"run_dir={tmp_path}"],
            cwd=tmp_path)
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
