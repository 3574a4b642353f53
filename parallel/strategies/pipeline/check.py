"""strategy=pipeline's own settings, checked once before any worker starts (called by parallel.validate)."""
from __future__ import annotations

from torch import nn

from parallel.blocks import nested
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
    split = plan_split(model, cfg, cfg.strategy.dp, Runtime(time_blocks=False), trace_split=False)
    inner = [n for n in split.blocks if nested(model, n)]
    if cfg.strategy.name == "hybrid" and inner:
        # Hybrid stages swap the model's own blocks in for the traced ones (stages.eager_blocks): a nested
        # block's traced call passes what the trace found it needs, in the trace's order, not its signature.
        fail("strategy", "hybrid", f"tensor- and data-parallel pipeline stages take blocks the model's forward "
             f"calls itself; {type(model).__name__}'s sit inside other modules ({', '.join(inner[:3])}, ...)",
             "strategy=pipeline, or strategy=hybrid with strategy.pp=1")
