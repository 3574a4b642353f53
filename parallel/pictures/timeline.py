"""The pipeline timeline: every rank's chunks of one step over measured time (Note [pipeline timeline] in
parallel/strategies/pipeline/timeline.py).

One row per rank, top to bottom; each chunk a bar coloured by its kind and
labelled with its stage and microbatch where the bar is wide enough; the rest of
the rank's schedule, where it computed nothing, shaded as waiting (for a send or
a receive, or the loss); before and after its schedule the rank is idle (the
optimizer step, data, another rank still working). Plain numbers in, a
matplotlib Figure (Agg) or PNG bytes out.
"""
from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# kind -> (colour, legend entry)
KINDS = {
    "forward": ("#4c72b0", "forward"),
    "backward": ("#dd8452", "backward"),
    "backward_weight": ("#55a868", "weight gradient"),
}
WAIT = ("#d9d9d9", "waiting (send/recv, loss)")
IDLE = ("#ffffff", "idle (outside the schedule)")
WIDTH_IN, ROW_IN, DPI = 12.0, 0.55, 100
MARGINS_IN = (0.8, 0.2, 0.4, 0.85)  # left, right, top (the title), bottom (the axis' label and the legend)
CHAR_PX = 6.5  # about the width of one character of the labels' font, in pixels


def draw(rows: list[list[tuple[str, int, int, float, float]]], spans: list[tuple[float, float]],
         title: str = "") -> "Figure":
    """The timeline of one step.

    Args:
        rows: per rank (in rank order), its chunks as (kind, stage index,
            microbatch, start, end), in seconds from the step's start; kind
            is one of KINDS.
        spans: per rank, (start, end) of its schedule in the same seconds.
        title: the figure's title.
    """
    # Imported here: matplotlib takes most of a second to import, which every process that imports the pipeline
    # engine would pay; only the logging rank draws.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    height = MARGINS_IN[2] + MARGINS_IN[3] + ROW_IN * len(rows)
    fig = Figure(figsize=(WIDTH_IN, height), dpi=DPI)
    FigureCanvasAgg(fig)
    # Fixed margins: a layout engine would draw the figure once more to measure it.
    left, right, top, bottom = MARGINS_IN
    fig.subplots_adjust(left=left / WIDTH_IN, right=1 - right / WIDTH_IN, top=1 - top / height, bottom=bottom / height)
    ax = fig.add_subplot()
    n = len(rows)
    ax.barh(range(n), [e - s for s, e in spans], left=[s for s, _ in spans], height=0.8, color=WAIT[0],
            hatch="//", edgecolor="#bbbbbb", linewidth=0)
    end = max([e for _, e in spans] + [c[4] for row in rows for c in row] + [1e-9])
    px_per_s = (WIDTH_IN - left - right) * DPI / end
    for kind, (colour, _) in KINDS.items():
        bars = [(r, c) for r, row in enumerate(rows) for c in row if c[0] == kind]
        if not bars:
            continue
        ax.barh([r for r, _ in bars], [c[4] - c[3] for _, c in bars], left=[c[3] for _, c in bars], height=0.8,
                color=colour, edgecolor="white", linewidth=0.5, label=kind)
        for r, (_, stage, mb, start, stop) in bars:
            label = _label(stage, mb, (stop - start) * px_per_s)
            if label:
                ax.text((start + stop) / 2, r, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, end)
    ax.set_xlabel("seconds from the step's start")
    if title:
        ax.set_title(title)
    legend = [Patch(facecolor=c, label=name) for c, name in KINDS.values()]
    legend += [Patch(facecolor=WAIT[0], hatch="//", edgecolor="#bbbbbb", label=WAIT[1]),
               Patch(facecolor=IDLE[0], edgecolor="#999999", label=IDLE[1])]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    return fig


def _label(stage: int, microbatch: int, width_px: float) -> str:
    """The longest label that fits a bar `width_px` wide: stage and microbatch, the microbatch, or none."""
    for label in (f"s{stage} m{microbatch}", f"{microbatch}"):
        if len(label) * CHAR_PX + 4 <= width_px:
            return label
    return ""


def png(fig: "Figure") -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, pil_kwargs={"compress_level": 1})  # flat colours: small anyway
    return buf.getvalue()
