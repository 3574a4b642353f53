"""Hydra's submitit launcher: the SLURM config composes, and a job's tasks run as the workers of one run."""
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import parallel.config  # noqa: F401  (registers the config schema)
from tests import cli
from tests import preempting as preemption

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
def test_tasks_of_a_submitit_job_are_the_workers_and_a_preempted_job_requeues(reference, tmp_path, monkeypatch):
    """The local executor runs a job's tasks as processes, as SLURM would on a node. Submitit's signal reaches
    task 0 in step 3 (tests/preempting.py): with trainer.requeue the job requeues itself through submitit's
    checkpoint protocol, and its tasks start again and go on from step 3 (Note [preemption])."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    # Submitit's tasks are new interpreters started elsewhere: the signalling loss (tests.preempting) is
    # importable from the repository's root.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(cli.ROOT), os.environ.get("PYTHONPATH")])))
    run_dir, sweep = tmp_path / "run", tmp_path / "sweep"
    cli.run(["-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", f"hydra.sweep.dir={sweep}",
             "hydra.sweep.subdir=job", "trainer.requeue=true", f"run_dir={run_dir}",
             f"+loss.args.once={tmp_path / 'sent'}"] + preemption.BASE + preemption.STRATEGIES["data zero 3"][1:] +
            preemption.signalling(run_dir, "SIGUSR2", "self", 0), cwd=tmp_path, timeout=280)
    (log,) = sweep.glob(".submitit/*/*_0_log.out")
    text = log.read_text()
    assert "preempted by SIGUSR2: stopped after step 3" in text and "handing the job to submitit" in text
    assert "Requeued job" in text and "resumed from" in text and "step-000003" in text, text[-3000:]
    preemption.assert_continues(run_dir, reference(preemption.BASE + preemption.STRATEGIES["data zero 3"]))
    assert len(cli.metrics(run_dir)[-1]["mem_peak_bytes_per_rank"]) == 2  # two tasks, one run
