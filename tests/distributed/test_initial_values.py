"""model.init=name (each tensor seeded by its name, one at a time on every rank: the path for a model too large
for one host) starts every strategy from the same weights as single with the same setting, and from other
weights than the default model.init=module, which is the user's own `torch.manual_seed(seed); factory()`."""
import pytest

from tests import cli

GPT = ["model=gpt", "data.task=lm", "model.args.dim=32", "model.args.heads=4", "data.seq_len=16",
       "trainer.batch_size=16", "trainer.steps=3", "model.init=name"]


@pytest.fixture
def single(reference):
    return reference(cli.FAST + GPT)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", [["nproc=2", "strategy=data", "strategy.zero=3"], ["nproc=2", "strategy=model"],
                                      ["nproc=2", "strategy=pipeline"]], ids=["data_zero3", "model", "pipeline"])
def test_name_init_is_the_same_under_every_strategy(single, tmp_path, strategy):
    cli.run(cli.FAST + GPT + strategy + [f"run_dir={tmp_path}"], cwd=tmp_path)
    cli.assert_same_training(tmp_path, single)


def test_name_init_differs_from_the_models_own(single, reference):
    """Both start from PyTorch's default scales, drawn from other generators: the first losses differ."""
    by_module = cli.losses(reference(cli.FAST + [a for a in GPT if a != "model.init=name"]))
    assert abs(cli.losses(single)[0] - by_module[0]) > 1e-4
