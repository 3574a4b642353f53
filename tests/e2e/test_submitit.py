"""Hydra's submitit launcher: the SLURM config composes, and a job's tasks run as the workers of one run."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import parallel.config  # noqa: F401  (registers the config schema)
from tests import cli

CONF = str(Path(cli.ROOT) / "conf")


def test_slurm_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.nodes=2",
                                           "hydra.launcher.tasks_per_node=4"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)


@pytest.mark.timeout(300)
def test_tasks_of_a_submitit_job_are_the_workers(reference, tmp_path):
    """The local executor runs a job's tasks as processes, as SLURM would on a node."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    ref = reference(cli.FAST)
    sweep = tmp_path / "sweep"
    cli.run(["-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", "strategy=data",
             f"hydra.sweep.dir={sweep}"] + cli.FAST, cwd=tmp_path, timeout=240)
    (job,) = [p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")]
    cli.assert_same_training(job, ref)
    assert len(cli.metrics(job)[-1]["mem_peak_bytes_per_rank"]) == 2  # two tasks, one run
