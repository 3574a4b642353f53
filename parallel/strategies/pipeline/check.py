"""strategy=pipeline's own settings, checked once before any worker starts (called by parallel.validate)."""
from __future__ import annotations

from torch import nn

from parallel.config import Config, fail, positive
from parallel.runtime import Runtime
from parallel.strategies.pipeline import schedules
from parallel.strategies.pipeline.split import plan_split


def check_pipeline(cfg: Config, per_rank: int) -> None:
    """Microbatches, stages per rank and the schedule fit the per-rank batch and each other."""
    s, t = cfg.strategy, cfg.trainer
    positive("strategy.microbatches", s.microbatches)
    positive("strategy.stages_per_rank", s.stages_per_rank)
    if per_rank % s.microbatches:
        fail("strategy.microbatches", s.microbatches,
             f"must divide the per-rank batch {per_rank} (= trainer.batch_size {t.batch_size} / dp {s.dp})",
             [d for d in range(1, per_rank + 1) if per_rank % d == 0])
    if t.grad_accum != 1:
        fail("trainer.grad_accum", t.grad_accum,
             "must be 1 under strategy=pipeline: microbatches already accumulate gradients",
             "raise strategy.microbatches instead")
    why = schedules.check(s.schedule, s.pp, s.stages_per_rank, s.microbatches)
    if why:
        fail(f"strategy.schedule={s.schedule} with strategy.stages_per_rank={s.stages_per_rank} and "
             f"strategy.microbatches", s.microbatches, why)


def check_split(model: nn.Module, cfg: Config) -> None:
    """The model (on meta) traces into the configured stages; bad split points are named.

    The same plan_split a worker runs, with blocks weighed by FLOPs: timing them
    here would only slow the check, and the balanced split it finds is not kept
    (nor traced again when the boundaries' trace already answers for it).
    """
    plan_split(model, cfg, cfg.strategy.dp, Runtime(time_blocks=False), trace_split=False)
