"""A loss that preempts its own run: signals sent from inside a training step, so that they land in the middle of
that step whatever the machine's speed (importable by the workers as tests.preempting.signalling_mse); and the
runs the preemption tests share."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tests import cli

# The runs of the preemption tests (tests/e2e/test_preemption.py, test_submitit.py): signalled in step AT.
STEPS, AT = 6, 3
BASE = ["trainer.log_every=1", "trainer.progress=false", "trainer.save_final=true", "trainer.timeout_s=60",
        f"trainer.steps={STEPS}", "loss._target_=tests.preempting.signalling_mse",
        # Agreed on at every step boundary, so that the run stops after the step the signal came in (these
        # steps are shorter than the default preempt_check_s: tests/unit/test_preemption.py has that cadence).
        "trainer.preempt_check_s=0"]
STRATEGIES = {
    "data zero 3": ["nproc=2", "strategy=data", "strategy.zero=3"],
    "pipeline": ["nproc=2", "strategy=pipeline"],
    "offload": ["strategy=offload", "strategy.params=disk", "strategy.optimizer=cpu"],
}


def signalling(run_dir, signals: str, to: str, rank: int) -> list[str]:
    """The loss's arguments that send `signals` from inside step AT (tests.preempting.signalling_mse)."""
    return [f"+loss.args.at={AT}", f"+loss.args.signals='{signals}'", f"+loss.args.to={to}", f"+loss.args.rank={rank}",
            f"+loss.args.metrics={run_dir}/metrics.jsonl"]


def assert_continues(run_dir, ref_dir) -> None:
    """`run_dir` logged every step once with the uninterrupted run's losses (1e-5), and ended with its weights."""
    got, want = cli.metrics(run_dir), cli.metrics(ref_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in want], dtype=torch.float64), rtol=1e-5, atol=0)
    got_w, want_w = cli.final_weights(run_dir), cli.final_weights(ref_dir)
    assert sorted(got_w) == sorted(want_w)
    for name in want_w:
        torch.testing.assert_close(got_w[name], want_w[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


_sent = [False]


def signalling_mse(out, target, metrics: str = "", at: int = 0, signals: str = "SIGTERM", to: str = "self",
                   rank: int = -1, once: str = "") -> torch.Tensor:
    """Mean squared error. In step `at` of a run logging every step to `metrics` (its metrics.jsonl, which
    then holds at - 1 records), it sends each signal of `signals` (comma-separated: a second signal) to this
    process (`to=self`: what SLURM does to every task) or to its parent (`to=parent`: the launcher, or
    torchrun's agent), and stays in the step until this worker's watch has the first (a loaded machine's
    watcher thread may take a while: waited for, not slept); a second one goes SECOND_S after that. Steps
    are read from the file, not counted here: a pipeline calls the loss before training, to time its blocks.

    Args:
        rank: only the worker of this RANK sends (-1: every worker); the rank that logs sees the file up to
            date (another may read it a step late).
        once: a file: the signals are sent only while it does not exist, and it is written when they are (a
            requeued job trains on without them).
    """
    if at and not _sent[0] and out.requires_grad and (rank < 0 or int(os.environ.get("RANK", "0")) == rank):
        path = Path(metrics)
        logged = len(path.read_text().splitlines()) if path.exists() else 0
        if logged == at - 1 and not (once and Path(once).exists()):
            _sent[0] = True
            if once:
                Path(once).write_text("sent\n")
            pid = os.getpid() if to == "self" else os.getppid()
            for i, name in enumerate(signals.split(",")):
                if i:
                    _until_seen()
                    time.sleep(SECOND_S)
                os.kill(pid, getattr(signal, name))
            _until_seen()
    return F.mse_loss(out.float(), target.float())


# A second signal this long after this worker's watcher thread had the first: past SAME_SIGNAL_S (1 s) as every
# rank's watcher sees the two, should another rank's see the first up to 1.5 s later.
SECOND_S = 2.5


def _until_seen(limit_s: float = 60.0) -> None:
    """Wait until this worker's watch has recorded a preemption signal (parallel.preemption.seen), up to
    `limit_s`: a signal sent from a step is then one the check at its end sees (Note [preemption])."""
    from parallel import preemption

    deadline = time.monotonic() + limit_s
    while not preemption.seen() and time.monotonic() < deadline:
        time.sleep(0.001)
