"""strategy=pipeline's own settings, checked once before any worker starts (called by parallel.validate)."""
from __future__ import annotations

from torch import nn

from parallel.blocks import nested, repeated_blocks
from parallel.config import Config, fail, positive
from parallel.runtime import Runtime
from parallel.strategies.pipeline import schedules
from parallel.strategies.pipeline.split import plan_split
from parallel.torch_compat import require_release


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
    if s.schedule in schedules.V_SHAPED:  # Note [torch versions] in parallel/torch_compat.py
        require_release("2.12", "a V-shaped schedule's stage pairs", "strategy.schedule", s.schedule,
                        [n for n in schedules.SCHEDULES if n not in schedules.V_SHAPED])
    if s.schedule in schedules.SPLIT_BACKWARD and s.activations in ("checkpoint", "selective"):
        fail("strategy.activations", s.activations,
             f"under strategy.schedule={s.schedule}, whose backward runs in two halves (the input's gradient, then "
             f"the weights'): each half recomputes the blocks, and torch's checkpoint cannot enter its "
             f"recomputation a second time (AttributeError: '_GeneratorContextManager' object has no attribute "
             f"'args', torch 2.13)",
             ["strategy.activations=device", "strategy.schedule=Interleaved1F1B (or GPipe, 1F1B, LoopedBFS)"])
    why = schedules.check(s.schedule, s.pp, s.stages_per_rank, s.microbatches)
    if why:
        fail(f"strategy.schedule={s.schedule} with strategy.stages_per_rank={s.stages_per_rank} and "
             f"strategy.microbatches", s.microbatches, why)


def check_split(model: nn.Module, cfg: Config, data=None) -> None:
    """The model (on meta) traces into the configured stages; bad split points are named (`data`: what was read
    from the data, parallel.data.spec.DataSpec).

    The same plan_split a worker runs, with blocks weighed by FLOPs: timing them
    here would only slow the check, and the balanced split it finds is not kept
    (nor traced again when the boundaries' trace already answers for it).
    """
    split = plan_split(model, cfg, cfg.strategy.dp, Runtime(time_blocks=False, data=data), trace_split=False)
    inner = [n for n in split.blocks if nested(model, n)]
    if inner:
        # Note [torch versions] in parallel/torch_compat.py: such stages hand integer tensors on.
        require_release("2.12", f"a pipeline over {type(model).__name__} (blocks inside other modules)",
                        "strategy.pp", cfg.strategy.pp, ["strategy=data", "strategy=model"])
        _check_traced_blocks(model, cfg, inner)


def _check_traced_plan(cfg: Config, where: str) -> None:
    """What tensor parallelism cannot do over traced blocks is refused: sequence parallelism (Note [tensor
    parallelism over traced blocks] in parallel/strategies/tensor/traced.py)."""
    if cfg.strategy.sequence_parallel:
        fail("strategy.sequence_parallel", True, f"cuts the sequence inside the blocks, whose traced rotary "
             f"embeddings and masks are the whole sequence's; {where}, so its pipeline stages run them traced "
             f"(Note [tensor parallelism over traced blocks] in parallel/strategies/tensor/traced.py)",
             ["strategy.sequence_parallel=false", "strategy.pp=1"])


def _check_traced_blocks(model: nn.Module, cfg: Config, inner: list[str]) -> None:
    """Nested blocks stay traced in their stages (Note [own or traced blocks] in stages.py): what needs the
    model's own block code is refused, naming what works instead."""
    shown = [n for n in inner if n in repeated_blocks(model)][:2] or inner[:2]
    s, where = cfg.strategy, f"{type(model).__name__}'s blocks sit inside other modules ({', '.join(shown)}, ...)"
    why = (f"{where}, so its pipeline stages run the blocks as traced and cannot take the model's own block code "
           "(Note [own or traced blocks])")
    if cfg.trainer.compile:
        fail("trainer.compile", True, f"compiles the model's own blocks; {why}",
             ["trainer.compile=false", "strategy.pp=1"])
    if s.tp > 1:
        _check_traced_plan(cfg, where)
    if s.ep > 1:
        fail("strategy.ep", s.ep, f"expert parallelism places the model's own expert modules; {why}",
             ["strategy.ep=1", "strategy.pp=1"])
    if s.sync_batchnorm:
        fail("strategy.sync_batchnorm", True, f"swaps the model's own BatchNorm layers; {why}",
             ["strategy.sync_batchnorm=false", "strategy.pp=1"])
