"""Preemption from the command line (Note [preemption]): a signal in the middle of a step stops every rank after
that step with a complete checkpoint of it and exit status 75, and the same command goes on from it with the
uninterrupted run's losses and weights; a second signal stops at once without saving. The signals are sent
from inside step 3 by the run's loss (tests/preempting.py). A preempted submitit job requeuing itself:
tests/e2e/test_submitit.py."""
import pytest

from parallel.checkpoint import newest_complete
from parallel.preemption import PREEMPTED
from tests import cli
from tests.preempting import AT, BASE, STRATEGIES, assert_continues, signalling

# (strategy, signal, sent to, by rank, extra overrides): the launcher forwards it to both workers; to the last
# pipeline stage alone, the other rank stops at the same step by the agreement; the single process's own, with
# trainer.requeue outside SLURM (a warning, nothing requeued).
CASES = [
    ("data zero 3", "SIGTERM", "parent", 0, []),
    ("pipeline", "SIGUSR1", "self", 1, []),
    ("offload", "SIGTERM", "self", -1, ["trainer.requeue=true"]),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,sig,to,rank,extra", CASES, ids=[f"{c[0]}: {c[1]} to {c[2]}" for c in CASES])
def test_signal_mid_step_saves_that_step_and_the_run_goes_on(tmp_path, reference, name, sig, to, rank, extra):
    run_dir = tmp_path / "run"
    args = BASE + STRATEGIES[name] + [f"run_dir={run_dir}"]
    proc = cli.run(args + extra + signalling(run_dir, sig, to, rank), cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == PREEMPTED == 75, out[-3000:]
    assert "Traceback" not in out and "leaked semaphore" not in out, out[-3000:]
    newest, _ = newest_complete(run_dir)  # complete: every file of trainer.json has its size
    assert newest is not None and newest.name == f"step-{AT:06d}", out[-3000:]
    assert f"saved step {AT} in {newest}" in proc.stderr
    assert [r["step"] for r in cli.metrics(run_dir)] == list(range(1, AT + 1))
    assert not (run_dir / "final_model.pt").exists()
    logs = {p.name: p.read_text() for p in (run_dir / "logs").iterdir()}
    for text in logs.values():  # every rank stopped at the same step, signalled or not
        assert f"preempted by {sig}: stopped after step {AT}" in text
    if to == "self" and rank >= 0:  # the others had no signal: they stopped by the agreement
        assert [n for n, text in logs.items() if f"{sig}: the run stops after this step" in text] == [f"rank{rank}.log"]
    if extra:
        assert "trainer.requeue=true: not in a SLURM job" in out and "nothing requeued" in out

    resumed = cli.run(args, cwd=tmp_path)  # the same command: trainer.resume=auto by default
    assert f"resumed from {newest}" in resumed.stdout + resumed.stderr
    assert_continues(run_dir, reference(BASE + STRATEGIES[name]))


@pytest.mark.timeout(120)
def test_second_signal_stops_at_once_without_saving(tmp_path):
    run_dir = tmp_path / "run"
    proc = cli.run(BASE + STRATEGIES["data zero 3"] + [f"run_dir={run_dir}", "trainer.checkpoint_every=2"] +
                   signalling(run_dir, "SIGTERM,SIGTERM", "parent", 0), cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 130, out[-3000:]
    assert "a second signal (SIGTERM): stopping at once, without saving" in proc.stderr
    assert "interrupted (SIGTERM): every worker stopped" in proc.stderr
    assert "Traceback" not in out and "leaked semaphore" not in out, out[-3000:]
    newest, _ = newest_complete(run_dir)
    assert newest.name == "step-000002"  # the one before the signals; none of step 3
    assert [r["step"] for r in cli.metrics(run_dir)] == [1, 2]


@pytest.mark.timeout(180)
def test_torchrun_forwards_sigusr1_when_told_and_the_workers_save(tmp_path):
    """SIGUSR1 to torchrun's agent, which forwards it with --signals-to-handle naming it (docs/checkpoints.md); torchrun itself
    then ends by its own SignalException."""
    run_dir = tmp_path / "run"
    launcher = cli.torchrun(2) + ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
    proc = cli.run(BASE + STRATEGIES["data zero 3"][1:] + [f"run_dir={run_dir}"] +
                   signalling(run_dir, "SIGUSR1", "parent", 0), cwd=tmp_path, launcher=launcher, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "SignalException" in out, out[-3000:]
    newest, _ = newest_complete(run_dir)
    assert newest is not None and newest.name == f"step-{AT:06d}", out[-3000:]
    for log in (run_dir / "logs").iterdir():
        assert f"preempted by SIGUSR1: stopped after step {AT}" in log.read_text()
    assert "leaked semaphore" not in out and "Fatal Python error" not in out
