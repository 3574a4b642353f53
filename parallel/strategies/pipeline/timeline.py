"""Every rank's chunks of one step, gathered for the pipeline timeline picture.

# Note [pipeline timeline]
Each stage records the interval of every chunk it runs (stages.TimedStage: a
list append per chunk), and the engine keeps them per step: those of the most
recent step run neither under the trainer's memory watch (on the CPU a dispatch
per op, which slows every chunk: `is_in_torch_dispatch_mode` tells) nor under
the profiler (trainer.profile), or else the latest step's. At a logged step `gather` (collective) brings every rank's
intervals to every rank and hands the metrics a `Picture` that the logging rank
draws (parallel/pictures/timeline.py) into `<run_dir>/pipeline_timeline.png`
and TensorBoard's image `pipeline/timeline`.

Ranks' clocks (time.perf_counter) are put on one time line by a barrier: every
rank leaves it within about one message latency of the others, and each rank
sends its times relative to the moment it left. Ranks on other hosts, with
unrelated clocks, line up the same way. The step's start is the earliest start
of a schedule among the ranks.

The intervals are host times around each chunk's call: on CUDA a chunk's
kernels may run after its call returns, so there a bar is when the chunk was
issued, which tracks the device while the schedule waits on its transfers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch.distributed as dist
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from parallel import profiling
from parallel.metrics import Picture, gather_floats, gather_ints
from parallel.pictures import timeline

KINDS = tuple(timeline.KINDS)  # chunk kinds, sent as their index
HEADER = 4  # numbers sent before the chunks: the schedule's start and end, steps ago, watched


@dataclass
class StepChunks:
    """One step of this rank: its schedule's (start, end) and its chunks (kind, stage, mb, start, end)."""

    start: float
    end: float
    chunks: list[tuple[str, int, int, float, float]]
    index: int  # which step of this engine it was (counted from 1)
    watched: bool  # run under the memory watch or the profiler


class Timeline:
    """Keeps the step to draw and gathers it at a logged step (Note [pipeline timeline]).

    Args:
        title: what the picture's title says after the step (the schedule, the microbatches).
    """

    def __init__(self, title: str):
        self.title = title
        self.steps = 0
        self.latest: StepChunks | None = None
        self.unwatched: StepChunks | None = None

    def record(self, start: float, end: float, chunks: list) -> None:
        """A step has run its schedule from `start` to `end` (perf_counter seconds) with these chunks."""
        self.steps += 1
        watched = is_in_torch_dispatch_mode() or profiling.active()
        # A copy: an evaluation's chunks would be added to the list the stages are filling.
        self.latest = StepChunks(start, end, list(chunks), self.steps, watched)
        if not self.latest.watched:
            self.unwatched = self.latest

    def gather(self) -> Picture:
        """Every rank's chunks of the step to draw, as a picture for the metrics (collective: every rank calls
        it at a logged step, after at least one step)."""
        step = self.unwatched or self.latest
        self.unwatched = None
        if dist.is_initialized():
            dist.barrier()  # the ranks' common moment (Note [pipeline timeline])
        now = time.perf_counter()
        mine = [step.start - now, step.end - now, self.steps - step.index, step.watched]
        for kind, stage, mb, s, e in step.chunks:
            mine += [KINDS.index(kind), stage, mb, s - now, e - now]
        longest = max(gather_ints(len(mine)))
        every = gather_floats([float(v) for v in mine] + [float("nan")] * (longest - len(mine)))
        rows, spans = _decode(every, longest)
        return Picture("pipeline/timeline", "pipeline_timeline.png",
                       partial(_draw, rows, spans, self.title, int(every[2]), bool(every[3])))


def _decode(every: list[float], longest: int):
    """Every rank's numbers (each `longest` long, NaN-padded) -> (rows, spans) in seconds from the step's start:
    the earliest start of a schedule among the ranks."""
    rows, spans = [], []
    for r in range(len(every) // longest):
        v = every[r * longest:(r + 1) * longest]
        spans.append((v[0], v[1]))
        rows.append([(KINDS[int(v[i])], int(v[i + 1]), int(v[i + 2]), v[i + 3], v[i + 4])
                     for i in range(HEADER, len(v), 5) if v[i] == v[i]])  # NaN: padding
    origin = min(s for s, _ in spans)
    rows = [[(k, st, mb, s - origin, e - origin) for k, st, mb, s, e in row] for row in rows]
    return rows, [(s - origin, e - origin) for s, e in spans]


def _draw(rows, spans, title: str, ago: int, watched: bool, logged_step: int) -> bytes:
    """The PNG of the gathered step; it ran `ago` steps before `logged_step`."""
    note = " (under the memory watch or the profiler)" if watched else ""
    return timeline.png(timeline.draw(rows, spans, f"pipeline timeline, step {logged_step - ago}{note}: {title}"))
