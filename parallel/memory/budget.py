"""The memory group's settings: the per-rank budget the planner and strategy=auto plan against, and the
CUDA memory fraction."""
from __future__ import annotations

from parallel.config import MemoryConfig, fail
from parallel.units import parse_bytes


def check_memory(m: MemoryConfig) -> None:
    if m.budget is not None:
        try:
            if parse_bytes(m.budget) <= 0:
                raise ValueError
        except ValueError:
            fail("memory.budget", m.budget, "must be a positive size", "e.g. 512MB, 80GB, 1.5GiB, 1000000")
    if m.fraction is not None and not 0 < m.fraction <= 1:
        fail("memory.fraction", m.fraction, "must be in (0, 1]")


def budget_bytes(m: MemoryConfig) -> int | None:
    """memory.budget in bytes; None when unset."""
    return parse_bytes(m.budget) if m.budget is not None else None
