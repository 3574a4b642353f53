"""The locally connected model (`model=local`) under every strategy, against single."""
import pytest

from tests import cli

# A smaller feature size than the default 5000 (100 positions), and a learning rate its loss tolerates.
LOCAL = ["model=local", "data.features=200", "optim.lr=1e-3", "trainer.steps=4"]

CASES = {
    "positions_split_over_two_ranks": ["nproc=2", "strategy=model"],
    "data_zero3": ["nproc=2", "strategy=data", "strategy.zero=3"],
    "pipeline": ["nproc=2", "strategy=pipeline"],
    "offload": ["strategy=offload"],
}


@pytest.fixture
def single(reference):
    return reference(cli.FAST + LOCAL)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", list(CASES))
def test_local_model_matches_single(single, tmp_path, case):
    cli.run(cli.FAST + LOCAL + CASES[case] + [f"run_dir={tmp_path}"], cwd=tmp_path)
    cli.assert_same_training(tmp_path, single)
    if case == "positions_split_over_two_ranks":  # the layer's weights are split: half per rank
        per_rank = cli.metrics(tmp_path)[-1]["param_bytes_per_rank"]
        positions = 100
        local = positions * 4 * 4 + positions * 4  # weight (P, 4, 1) and bias (1, P), float32
        rest = (4 * 2 + 4 + positions + 1) * 4  # conv and head, whole on every rank
        assert per_rank == [local // 2 + rest] * 2


def test_positions_must_divide_by_tp(tmp_path):
    proc = cli.run(LOCAL + ["data.features=202", "nproc=2", "strategy=model", f"run_dir={tmp_path}"],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "101 output positions, which do not divide by tp 2" in proc.stderr
