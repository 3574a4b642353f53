"""The divergence guard: a step whose loss or gradient norm is not finite never reaches the weights.

# Note [non-finite steps]
A run that diverges (a learning rate too high, a bad batch, an overflow) makes
NaN or inf first in a loss, then in every gradient its backward touches. Left
alone, the optimizer writes them into the weights and the next checkpoint
writes them over the good ones. So every step is checked after the gradient
norm and before the optimizer step (parallel/trainer.py `train_step`):

  what is read    the global gradient norm that `engine.clip` computes on every
                  rank already (summed over every shard, stage and tp piece: the
                  same value on every rank), and this rank's share of the loss.
                  A non-finite loss makes non-finite gradients, which the
                  data-parallel reduction and the norm's own sum carry to every
                  rank, so every rank sees a non-finite norm at the same step and
                  takes the same decision without a collective of its own.
  what it costs   one read of a device scalar per step (a host sync on CUDA,
                  before the optimizer step is queued; nothing on the CPU, where
                  the values are already on the host): benchmarks/overhead_parts.py,
                  rung `guard`.
  stop (default)  the run ends before the optimizer step and before that step's
                  checkpoint: one line, `error: non-finite loss (nan) at step S on
                  rank R (grad_norm nan); the last good checkpoint is ...`, exit
                  status 1, every checkpoint written before it kept. The ranks
                  agree on the line with one gather of which ranks' losses were
                  finite (only at that step), and rank 0 prints it.
  skip            the step is dropped: gradients zeroed, no optimizer step (its
                  state, AdamW's step count included, untouched), no schedule
                  step, so the weights and the optimizer state after it equal
                  those before it; the next step reads the next batch.
                  metrics.jsonl counts them (`skipped_steps`, in total so far).
                  After `trainer.nonfinite_limit` skipped steps in a row, the run
                  stops as under stop.

A loss that is not finite while the gradient norm is (only a loss whose backward
ignores its value can do that) is seen by its own rank alone, which cannot drop
a step the others apply: that rank stops the run under either setting.

Offload steps its own optimizer (parallel/strategies/offload/adamw.py): with clipping its
step runs after this check, like every other engine's; without clipping its
blocks step during backward, so each block's gradients are checked before its
step there, and a non-finite one stops every later block's step (under skip the
engine steps after backward instead, so that a skipped step leaves every block
as it was).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.checkpoint import newest_complete
from parallel.config import RunError, TrainerConfig
from parallel.metrics import gather_floats, log

# A worker's exit status when it stopped for a non-finite step (rank 0 has printed the line).
NON_FINITE = 4


class AgreedStop(RunError):
    """A check of the step stopped the run; the message is the run's one line (parallel/launcher.py prints it).

    Args:
        says: this rank prints the line (rank 0 when every rank stopped at the step; else the rank that saw it).
        agreed: every rank stopped at this step (so they may meet in a last barrier).
    """

    def __init__(self, message: str, says: bool, agreed: bool):
        super().__init__(message)
        self.says, self.agreed = says, agreed


class NonFinite(AgreedStop):
    """A step's loss or gradient norm was not finite (Note [non-finite steps])."""


class Guard:
    """Checks each step before its optimizer step (Note [non-finite steps]).

    Args:
        t: the trainer settings (nonfinite, nonfinite_limit).
        run_dir: the run directory (its checkpoints are named in the stop line).
    """

    def __init__(self, t: TrainerConfig, run_dir: Path):
        self.mode, self.limit, self.run_dir = t.nonfinite, t.nonfinite_limit, run_dir
        self.skipped = 0  # steps skipped in the whole run (this process's part of it)
        self.in_a_row = 0

    def check(self, step: int, loss: torch.Tensor, norm: torch.Tensor) -> bool | NonFinite:
        """True: the step may apply. False: drop it (skip). A NonFinite: stop the run (raised by the caller
        once the loop's files are closed)."""
        both = torch.stack([loss.detach().float().reshape(()), norm.detach().float().reshape(()).to(loss.device)])
        loss_ok, norm_ok = torch.isfinite(both).tolist()  # one read of the device (Note [non-finite steps])
        if loss_ok and norm_ok:
            self.in_a_row = 0
            return True
        if norm_ok:  # this rank alone knows: it cannot skip a step the others apply
            rank = dist.get_rank()
            return NonFinite(f"non-finite loss ({float(loss):g}) at step {step} on rank {rank} (grad_norm "
                             f"{float(norm):g}, finite); {self._last_good()}", says=True, agreed=False)
        self.in_a_row += 1
        if self.mode == "skip" and self.in_a_row < self.limit:
            self.skipped += 1
            log.warning("step %d skipped: non-finite grad_norm (%g); %d in a row (trainer.nonfinite_limit=%d)",
                        step, float(norm), self.in_a_row, self.limit)
            return False
        return self._stop(step, loss, norm)

    def _stop(self, step: int, loss: torch.Tensor, norm: torch.Tensor) -> NonFinite:
        """Every rank is here (the norm is the same on all): name the first rank whose loss was not finite."""
        losses = gather_floats([float(loss)])
        bad = [r for r, value in enumerate(losses) if not math.isfinite(value)]
        if bad:
            what = f"non-finite loss ({losses[bad[0]]:g}) at step {step} on rank {bad[0]} (grad_norm {float(norm):g})"
        else:
            what = f"non-finite grad_norm ({float(norm):g}) at step {step} (the loss finite on every rank)"
        if self.mode == "skip":
            what += f", {self.in_a_row} steps in a row (trainer.nonfinite_limit={self.limit})"
        return NonFinite(f"{what}; {self._last_good()}", says=dist.get_rank() == 0, agreed=True)

    def _last_good(self) -> str:
        path, _ = newest_complete(self.run_dir)
        if path is None:
            return "no checkpoint was written before it"
        return f"the last good checkpoint is {path}"

    def record(self) -> dict:
        """metrics.jsonl's count of skipped steps (under trainer.nonfinite=skip)."""
        return {"skipped_steps": self.skipped} if self.mode == "skip" else {}
