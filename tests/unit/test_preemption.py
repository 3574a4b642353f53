"""Preemption's pieces without a run (Note [preemption]): a signal delivered twice counts once, a second one or
trainer.preempt_timeout_s stops at once; what the launcher makes of its workers' exit statuses; the warning of
trainer.requeue outside SLURM. Runs: tests/e2e/test_preemption.py."""
import logging
import os
import subprocess

import pytest

from parallel import preemption
from tests import cli


def script(tmp_path, code: str, *args) -> subprocess.CompletedProcess:
    """`code` run as a script of its own with `args`: a process of its own, the zygote's child (tests/cli.py)."""
    path = tmp_path / "script.py"
    path.write_text(code)
    return cli.run_script(str(path), list(map(str, args)), cwd=cli.ROOT, timeout=50)


# A worker of one process watching for signals: SIGUSR1 twice at once, the agreement once the watcher thread has
# it (waited for, not slept: a loaded machine may take a while), then SIGTERM `gap` s later.
WORKER = """
import os, signal, sys, time
import torch.distributed as dist
from parallel import preemption
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
with preemption.watching(float(sys.argv[1])) as watch:
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while not watch.signum and time.monotonic() < deadline:
        time.sleep(0.001)
    print("agreed", watch.agreed(), flush=True)
    time.sleep(float(sys.argv[2]))
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
print("not stopped", flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout_s,gap,status,why", [
    # The gap counts from when the watcher thread had the first signal: at least SAME_SIGNAL_S (1 s) between
    # the two as it sees them, however late it saw the first.
    (30, 1.2, 128 + 15, "a second signal (SIGTERM): stopping at once, without saving"),
    # 3 s for the main thread to print once the watcher has the signal; the SIGTERM 30 s later never comes.
    (3, 30, 128 + 10, "trainer.preempt_timeout_s=3 passed since SIGUSR1: stopping at once, without saving"),
], ids=["second signal", "timeout"])
def test_a_second_signal_or_the_timeout_stops_at_once(tmp_path, timeout_s, gap, status, why):
    proc = script(tmp_path, WORKER, timeout_s, gap)
    assert proc.stdout == "agreed 10\n", proc.stdout + proc.stderr  # SIGUSR1 twice at once: one signal
    assert proc.returncode == status and why in proc.stderr, proc.stderr


def test_launcher_reads_its_workers_exit_statuses():
    assert preemption.all_preempted([75, 75]) and preemption.all_preempted([75])
    assert not preemption.all_preempted([75, 1]) and not preemption.all_preempted([])
    assert preemption.stopped_at_once([143, 143]) == "SIGTERM"
    assert preemption.stopped_at_once([138, -15]) == "SIGUSR1"
    assert preemption.stopped_at_once([143, 1]) is None


def test_requeue_outside_slurm_is_a_warning(monkeypatch, caplog):
    for key in ("SLURM_JOB_ID", "SUBMITIT_EXECUTOR"):
        monkeypatch.delenv(key, raising=False)
    with caplog.at_level(logging.WARNING, logger="parallel"):
        preemption.check_requeue(False)
        assert not caplog.records
        preemption.check_requeue(True)
    assert "trainer.requeue=true: not in a SLURM job" in caplog.text and "nothing is requeued" in caplog.text
    caplog.clear()
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    with caplog.at_level(logging.WARNING, logger="parallel"):
        preemption.check_requeue(True)
    assert not caplog.records
    assert os.environ["SLURM_JOB_ID"] == "12"


def test_short_steps_are_checked_every_few_steps_about_preempt_check_s_apart():
    assert preemption.checks_every(0.5, 0.1) == 1 and preemption.checks_every(0.1, 0.1) == 1
    assert preemption.checks_every(0.004, 0.1) == 25 and preemption.checks_every(0.001, 0) == 1
    assert preemption.checks_every(1e-7, 0.1) == preemption.MAX_EVERY


# One process checking after each step with preempt_check_s argv[1], its steps argv[2] s long by the clock it
# gives the Watch (Watch's `clock`: only the test moves it), a signal sent in step argv[3] and waited for until
# the watcher thread has it: the boundaries it agrees at, and what each one sees.
CADENCE = """
import os, signal, sys, time
import torch.distributed as dist
from parallel import preemption
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
now = [0.0]
with preemption.watching(30, float(sys.argv[1]), clock=lambda: now[0]) as watch:
    checked = []
    for step in range(1, 13):
        if step == int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 30
            while not watch.signum and time.monotonic() < deadline:
                time.sleep(0.001)
        now[0] += float(sys.argv[2])
        if watch.due(step):
            checked.append((step, watch.agreed(step)))
print(checked, flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check_s,step_s,expected", [
    (0.0, 0.25, [(s, 15 if s >= 8 else 0) for s in range(1, 13)]),
    # Steps of 0.25 s against 1.25 s (binary fractions: 1.25 / 0.25 is 5 exactly): the first two boundaries
    # (the first only starts the clock), then every 5th; the signal of step 8 is seen at the next check.
    (1.25, 0.25, [(1, 0), (2, 0), (7, 0), (12, 15)]),
    # Steps as long as preempt_check_s or longer: every boundary.
    (0.25, 0.5, [(s, 15 if s >= 8 else 0) for s in range(1, 13)]),
], ids=["every boundary", "every few", "long steps"])
def test_the_ranks_agree_at_every_boundary_or_every_few(tmp_path, check_s, step_s, expected):
    proc = script(tmp_path, CADENCE, check_s, step_s, 8)
    assert proc.returncode == 0, proc.stderr
    assert eval(proc.stdout) == expected
