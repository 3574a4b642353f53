"""memory.png: each rank's (or rank role's) planned peak memory as stacked bars by kind, against the budget.

launch/plan.py draws it beside plan.json from the planner's breakdown (Note [planner] in
parallel/planning/planner.py): params, grads, optimizer, activations and temp at each role's peak.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure


KINDS = ("params", "grads", "optimizer", "activations", "temp")
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")
_UNITS = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB"), (1, "B"))


def unit_for(largest: float) -> tuple[float, str]:
    """The unit (bytes per unit, its name) in which `largest` bytes reads as 1 to 1000 (powers of 1000, as
    the planner's table prints them)."""
    return next(((size, name) for size, name in _UNITS if largest >= size), _UNITS[-1])


def memory_figure(labels: list[str], kinds: dict[str, list[int]], budget: int | None = None,
                  title: str = "") -> Figure:
    """Stacked bars, one per role, of bytes by kind, and a dashed line at `budget`.

    Args:
        labels: one per bar, e.g. 'rank 0' or 'ranks 0-3'.
        kinds: for each of KINDS, one byte count per bar.
        budget: bytes per rank (memory.budget), or None for no line.
        title: the picture's title.
    """
    totals = [sum(kinds[k][i] for k in KINDS) for i in range(len(labels))]
    scale, unit = unit_for(max(totals + [budget or 0, 1]))
    # Imported here: matplotlib takes most of a second to import, which every run importing this module
    # (the launcher, plan.py) would pay without drawing.
    from matplotlib.figure import Figure
    fig = Figure(figsize=(max(6.5, 2.5 + 0.9 * len(labels)), 4.5), layout="constrained")
    ax = fig.add_subplot()
    bottom = [0.0] * len(labels)
    for kind, color in zip(KINDS, COLORS):
        heights = [v / scale for v in kinds[kind]]
        ax.bar(labels, heights, bottom=bottom, color=color, label=kind, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    if budget is not None:
        ax.axhline(budget / scale, color="black", linestyle="--", linewidth=1.2,
                   label=f"memory.budget {budget / scale:.3g} {unit}")
    ax.set_ylabel(f"peak memory per rank ({unit})")
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelrotation=30 if len(labels) > 6 else 0)
    pad = max(0.0, (3 - len(labels)) / 2)  # one or two bars as narrow as one of three, centred
    ax.set_xlim(-0.5 - pad, len(labels) - 0.5 + pad)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), reverse=True)  # as stacked
    return fig


def write_memory(path: str | Path, labels: list[str], kinds: dict[str, list[int]], budget: int | None = None,
                 title: str = "") -> Path:
    """Draw `memory_figure` into the PNG file `path` and return it."""
    memory_figure(labels, kinds, budget, title).savefig(path, dpi=100)
    return Path(path)
