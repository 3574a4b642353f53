"""data=custom: a user's map-style Dataset, a Hugging Face datasets.Dataset and an IterableDataset train under
every strategy as under strategy=single (the global batch of step k the same on any world size)."""
import pytest

from tests import cli

MAP = ["data=custom", "data._target_=tests.user_data.regression", "model.args.depth=2"]


@pytest.fixture
def map_single(reference):
    return reference(cli.FAST + MAP)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", [["strategy=data", "strategy.zero=0"], ["strategy=data", "strategy.zero=3"]])
def test_map_style_matches_single(map_single, tmp_path, strategy):
    cli.run(cli.FAST + MAP + ["nproc=2", *strategy, f"run_dir={tmp_path}"], cwd=tmp_path)
    cli.assert_same_training(tmp_path, map_single)
