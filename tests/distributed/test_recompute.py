"""strategy.activations=checkpoint (blocks recomputed in backward) under every strategy: the training of
single without it, in less memory."""
import pytest

from tests import cli

# Activations dominate at this batch, so recomputing them shows in the measured peak.
BIG = ["trainer.batch_size=512"]

CASES = {
    "single": (1, ["strategy=single"]),
    "data_zero3": (2, ["strategy=data", "strategy.zero=3"]),
    "pipeline": (2, ["strategy=pipeline"]),
    "hybrid_dp_tp_zero3": (4, ["strategy=hybrid", "strategy.dp=2", "strategy.tp=2", "strategy.zero=3"]),
}


@pytest.fixture
def single(reference):
    return reference(cli.FAST + BIG)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_recomputed_activations_train_as_single_in_less_memory(single, tmp_path, case):
    world, args = CASES[case]
    recomputed = tmp_path / "recomputed"
    common = cli.FAST + BIG + args + [f"nproc={world}"]
    cli.run(common + ["strategy.activations=checkpoint", f"run_dir={recomputed}"], cwd=tmp_path)
    cli.assert_same_training(recomputed, single)
    if case not in ("single", "data_zero3"):
        return
    # Less memory than the same run keeping its activations (single: the reference run itself).
    plain = single
    if case != "single":
        plain = tmp_path / "plain"
        cli.run(common + [f"run_dir={plain}"], cwd=tmp_path)
    less = cli.metrics(recomputed)[-1]["mem_peak_bytes_per_rank"]
    more = cli.metrics(plain)[-1]["mem_peak_bytes_per_rank"]
    assert all(a < b for a, b in zip(less, more)), (less, more)


def test_tiers_below_the_device_are_offloads_own(tmp_path):
    proc = cli.run(["strategy=data", "nproc=2", "strategy.activations=cpu", f"run_dir={tmp_path}"], cwd=tmp_path,
                   check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "strategy.activations='cpu'" in proc.stderr and "['device', 'checkpoint']" in proc.stderr
