"""Pipeline schedules: names, stage placement, constraints and analytic bubbles.

The schedules themselves are PyTorch's (torch.distributed.pipelining); this file
holds what the framework needs to know about them before any worker starts.
"""
from __future__ import annotations

from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

# Canonical names, as PyTorch spells them. Looked up case-insensitively.
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
# Backward split into the input's and the weights' halves (zero-bubble schedules)
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def canonical(name: str) -> str | None:
    """The canonical spelling of a schedule name, or None when unknown."""
    return {s.lower(): s for s in SCHEDULES}.get(name.lower())


def schedule_class(name: str):
    return get_schedule_class(canonical(name))


def is_multi_stage(name: str) -> bool:
    """True for schedules that run several stages per rank (interleaved, looped, V)."""
    return not issubclass(schedule_class(name), PipelineScheduleSingle)


def default_stages_per_rank(name: str) -> int:
    return 2 if is_multi_stage(name) else 1


def stage_ranks(name: str, pp: int, stages_per_rank: int) -> list[int]:
    """rank_of[stage] for every stage.

    Looped placement (interleaved and looped schedules): stage s on rank s % pp.
    V placement (ZBV, DualPipeV): rank r holds stages r and 2pp-1-r, so the first
    and the last stage share rank 0.
    """
    n = pp * stages_per_rank
    if canonical(name) in V_SHAPED:
        return [s if s < pp else n - 1 - s for s in range(n)]
    return [s % pp for s in range(n)]


def check(name: str, pp: int, stages_per_rank: int, microbatches: int) -> str | None:
    """Why this combination cannot run, or None. Mirrors the checks PyTorch makes at runtime."""
    c = canonical(name)
    n = pp * stages_per_rank
    if not is_multi_stage(c) and stages_per_rank != 1:
        return f"{c} runs one stage per rank; strategy.stages_per_rank must be 1"
    if c in V_SHAPED and stages_per_rank != 2:
        return f"{c} is V-shaped and needs exactly 2 stages per rank"
    if c == "DualPipeV" and microbatches < n:
        return f"DualPipeV needs at least as many microbatches as stages ({n})"
    if c in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            return (f"{c} runs microbatches in rounds of {pp} (the pipeline degree); "
                    f"{microbatches} microbatches do not split into {rounds} equal rounds")
    return None


def analytic_bubble(name: str, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """The idle share of a rank for equal stage times and free communication.

    GPipe, 1F1B: (p-1) / (m+p-1). Interleaved and looped schedules with v stages
    per rank shrink the warm-up by v: (p-1) / (v*m + p-1). Zero-bubble schedules
    split backward into input and weight halves and fill the warm-up with weight
    work; with forward = backward-input = backward-weight time their bubble is
    (p-1) / (3*v*m + p-1) (InterleavedZeroBubble), and about zero for the
    V-shaped ones once m >= 2p (ZBV, DualPipeV).
    """
    c, p, v, m = canonical(name), pp, stages_per_rank, microbatches
    if p == 1:
        return 0.0
    if c in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    if c in ("Interleaved1F1B", "LoopedBFS"):
        return (p - 1) / (v * m + p - 1)
    if c == "InterleavedZeroBubble":
        return (p - 1) / (3 * v * m + p - 1)
    # V-shaped: the warm-up is filled unless there are too few microbatches.
    return 0.0 if m >= 2 * p else (2 * p - m) / (3 * v * m + 2 * p - m)
