"""auto.png: strategy=auto's ranked candidates, their predicted step times and whether they fit in memory.

One row per planned candidate, in the order given (the ranking: those that fit, fastest first, then those
over the budget). Left: the cost model's predicted step time (Note [auto] in parallel/planning/auto.py), stacked
as compute, pipeline bubble, communication and offload transfers. Right: the planned peak per rank
against the budget. The chosen candidate is marked; those over the budget are hatched and faded.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from parallel.pictures.memory import unit_for
from parallel.units import human_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TERMS = ("compute", "bubble", "comm", "transfers")
COLORS = ("#4c72b0", "#c44e52", "#dd8452", "#8172b3")


def candidates_figure(names: list[str], times: list[dict], peaks: list[int], fits: list[bool],
                      chosen: int | None, budget: int, skipped: int = 0) -> Figure:
    """The chart of the planned candidates.

    Args:
        names: one per candidate, ranked.
        times: for each, seconds per term of TERMS (more keys are ignored).
        peaks: for each, its largest rank's planned peak, bytes.
        fits: for each, whether that peak is within the budget.
        chosen: the index of the candidate that runs, or None.
        budget: bytes per rank.
        skipped: candidates that could not be planned (not drawn; the title counts them).
    """
    n = len(names)
    # Imported here: matplotlib takes most of a second to import, which every run importing this module
    # (the launcher, plan.py) would pay without drawing.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    fig = Figure(figsize=(11.0, 1.2 + 0.32 * max(n, 1)), layout="constrained")
    left, right = fig.subplots(1, 2, sharey=True, width_ratios=(2.6, 1.4))
    rows = list(range(n))
    labels = [("\u2192 " if i == chosen else "") + name for i, name in enumerate(names)]  # an arrow: chosen
    start = [0.0] * n
    for term, color in zip(TERMS, COLORS):
        widths = [t.get(term, 0.0) * 1e3 for t in times]
        bars = left.barh(rows, widths, left=start, color=color, label=term, height=0.7)
        _fade(bars, fits)
        start = [s + w for s, w in zip(start, widths)]
    left.set_yticks(rows, labels, fontsize=8)
    for i, tick in enumerate(left.get_yticklabels()):
        if i == chosen:
            tick.set_fontweight("bold")
    left.invert_yaxis()  # the best first, at the top
    left.set_xlabel("predicted step time (ms)")
    _peaks(right, rows, peaks, fits, budget)
    more = f"; {skipped} more could not be planned (auto.json says why)" if skipped else ""
    fig.suptitle(f"strategy=auto: {n} candidates planned, {sum(fits)} fit{more}", fontsize=10)
    handles, names = _handles(left, right)
    if not all(fits):
        handles.append(Patch(facecolor="#cccccc", hatch="//", alpha=0.45))
        names.append("over the budget")
    fig.legend(handles, names, loc="outside lower center", ncol=len(handles), fontsize=8)
    return fig


def _handles(*axes) -> tuple[list, list]:
    pairs = [pair for ax in axes for pair in zip(*ax.get_legend_handles_labels())]
    return [h for h, _ in pairs], [label for _, label in pairs]


def _peaks(ax, rows: list[int], peaks: list[int], fits: list[bool], budget: int) -> None:
    """Each candidate's peak against the budget; on a log scale when the budget dwarfs every peak (the
    device's whole memory, say), so that the peaks stay readable."""
    scale, unit = unit_for(max(peaks + [budget, 1]))
    log = budget > 4 * max(peaks + [1])
    start = min(peaks + [budget]) / scale / 3 if log else 0.0
    bars = ax.barh(rows, [p / scale - start for p in peaks], left=start, height=0.7,
                   color=["#55a868" if f else "#c44e52" for f in fits])
    _fade(bars, fits)
    for row, peak in zip(rows, peaks):
        ax.text(peak / scale, row, f" {human_bytes(peak)}", va="center", fontsize=7)
    ax.axvline(budget / scale, color="black", linestyle="--", linewidth=1.2, label="budget")
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(f"planned peak per rank ({unit}{', log' if log else ''})")


def _fade(bars, fits: list[bool]) -> None:
    for bar, fit in zip(bars, fits):
        if not fit:
            bar.set_alpha(0.45)
            bar.set_hatch("//")


def write_candidates(path: str | Path, names: list[str], times: list[dict], peaks: list[int], fits: list[bool],
                     chosen: int | None, budget: int, skipped: int = 0) -> Path:
    """Draw `candidates_figure` into the PNG file `path` and return it."""
    candidates_figure(names, times, peaks, fits, chosen, budget, skipped).savefig(path, dpi=100)
    return Path(path)
