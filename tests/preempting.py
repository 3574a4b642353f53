"""A loss that preempts its own run: signals sent from inside a training step, so that they land in the middle of
that step whatever the machine's speed (importable by the workers as tests.preempting.signalling_mse)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_sent = [False]


def signalling_mse(out, target, metrics: str = "", at: int = 0, signals: str = "SIGTERM", to: str = "self",
                   rank: int = -1, once: str = "") -> torch.Tensor:
    """Mean squared error. In step `at` of a run logging every step to `metrics` (its metrics.jsonl, which
    then holds at - 1 records), it sends each signal of `signals` (comma-separated, 1.5 s apart: a second
    signal) to this process (`to=self`: what SLURM does to every task) or to its parent (`to=parent`: the
    launcher, or torchrun's agent), then stays 1 s in the step. Steps are read from the file, not counted
    here: a pipeline calls the loss before training, to time its blocks.

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
                    time.sleep(1.5)
                os.kill(pid, getattr(signal, name))
            time.sleep(1.0)
    return F.mse_loss(out.float(), target.float())
