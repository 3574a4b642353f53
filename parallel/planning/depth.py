"""Blocks alike planned once: a deep model's plan from the same model at three small depths.

# Note [planning by depth]
A transformer's cost grows with its depth one block at a time: each block of a
list of identical blocks adds the same parameters, gradients and optimizer
state, the same saved activations, the same FLOPs, op calls and collectives.
Tracing all of them (126 blocks of a 405B Llama, each a few hundred ops under
five dispatch modes) is what made a deep model slow to plan, and nothing of
the plan needs it. So the planner traces the model with its block list cut to
DEPTHS (2, 3 and 4 blocks; the first and last block of a list are the ones a
strategy treats apart: FSDP2 keeps the last block's gathered weights for
backward, a pipeline's stages begin and end at blocks) and extends every
count of the plan along the line they draw: each phase's peak by kind (the
step's peak is the largest extended, which may sit in another phase than at
the depths traced: recomputed blocks peak in backward when shallow and at the
optimizer's step when deep), the raw tallies of the step's work and
collectives (the ops outside forward and backward apart: one per parameter
grows in number, a foreach op over every parameter in size), DDP's buckets,
and the op calls of every depth. A count whose three values are not on one
line, or a key one depth has and another lacks, means the model is not made
of blocks alike in that respect: the model is then traced whole, as it is with
`plan.every_block=true`. Exact where it applies: the planner's own cases give
the same bytes both ways (tests/unit/test_plan_depth.py). But for a CUDA
plan's reserved memory (Note [caching allocator] in
parallel/planning/allocator.py): segments come as requests outgrow the cached
blocks, and a freed one is refilled by later blocks until used up: what is
cached over the total is no line over depth. The extended plan's reserved is
its total and the most cached over the total at the three depths, and is
never a reason to trace whole: on the planner's cases (the tiny gpt) within
2 x 20 MiB of the whole trace; on the 697M Llama of benchmarks/gpu.py -1.3%
(expandable segments +0.2%).

The blocks are alike when they are one class and hold parameters and buffers
of the same names, shapes and dtypes, and the same plain settings (ints,
floats, strings, bools) but those that number the block (Hugging Face's
`layer_idx`). Gemma's alternating sliding and full attention differ in a
setting, and such a model is traced whole. Planned whole as well
(`traced_whole`): a pipeline (its split follows the blocks' weight; a stage
role per stage), ZeRO-1, a model with more than one list of blocks (an encoder
and a decoder), `plan.by_module` (its table names every block), and a step
whose op calls are replayed on this machine for its time (a CPU run, a CUDA
run planned on a GPU host: the replay wants every call, and those over every
parameter differ with the depth).
"""
from __future__ import annotations

import math
from dataclasses import fields
from typing import TYPE_CHECKING

import torch
from torch import nn

from parallel.blocks import alike_blocks
from parallel.config import cuda_run
from parallel.planning.allocator import SMALL_SEGMENT
from parallel.planning.work import Work, comm_bytes_of, step_work_of

if TYPE_CHECKING:
    from parallel.config import Config
    from parallel.dims import ParallelDims

DEPTHS = (2, 3, 4)


def traced_whole(cfg: "Config", dims: "ParallelDims", by_module: bool) -> bool:
    """Whether a plan traces every block (Note [planning by depth]): asked to; a pipeline; ZeRO-1 (whole
    parameters handed to ranks by size: a partition that does not grow block by block); a step whose op calls
    are replayed here, each to the call (a CPU run, or a CUDA one on a GPU host: Note [cost model]), which
    the calls over every parameter (clipping's, a foreach optimizer's) are not at another depth."""
    replayed = not cuda_run(cfg.trainer.device) or torch.cuda.is_available()
    return by_module or cfg.plan.every_block or dims.pp > 1 or getattr(cfg.strategy, "zero", 0) == 1 or replayed


def block_list(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The name and module of `model`'s one list of blocks alike (Note [blocks alike] in parallel/blocks.py)
    deeper than the depths traced, or None."""
    return alike_blocks(model, DEPTHS[-1])


def extend(plans: dict[int, list], depth: int, parent: str) -> list | None:
    """The plans at `depth` blocks from `plans` (depth -> a RankPlan per role, traced at DEPTHS), each count on
    the line of its three values; None where one is not (Note [planning by depth]). Their op calls are those
    on their line (no step of them is replayed here: `traced_whole`)."""
    a, b, c = (plans[d] for d in DEPTHS)
    if not len(a) == len(b) == len(c):
        return None
    out, steps = [], depth - DEPTHS[-1]
    for pa, pb, pc in zip(a, b, c):
        # the counts as tallied (both steps), exact; what is derived from them is derived again
        tails = [p.tally["work"]["tail"] for p in (pa, pb, pc)]
        tally = _line(*({**p.tally, "work": {**p.tally["work"], "tail": []}} for p in (pa, pb, pc)), steps, exact=True)
        tail = _tail(*tails, steps)
        if tally is _OFF or tail is None:
            return None
        tally["work"]["tail"] = tail
        buckets = [tuple(row) for row in tally["buckets"]]
        # each phase's peak on its line; the largest is the step's (the peak may move to another phase)
        names = {name: None for name in pc.phases}
        phases = _line(*({name: {k: v for k, v in p.phases[name].items() if k != "module"} for name in names}
                         if p.phases.keys() == names.keys() else None for p in (pa, pb, pc)), steps, exact=True)
        if phases is _OFF or not phases:
            return None
        peak_phase = max(phases, key=lambda name: phases[name]["total"])
        for name, row in phases.items():
            row["module"] = _renamed(pc.phases[name]["module"], parent, depth)
        peak = phases[peak_phase]
        values = {"tally": tally, "work": step_work_of(Work.of_raw(tally["work"]), buckets), "phases": phases,
                  **{k: peak[k] for k in EXACT if k in peak},
                  "comm_bytes": comm_bytes_of(tally["comm"] // 2, buckets), "flops": tally["flops"] // 2,
                  "ops": tally["ops"] // 2, "all_to_all_bytes": tally["all_to_all"] // 2,
                  "io_bytes": tally["io"] // 2, "calls": _calls(pa.calls, pb.calls, pc.calls, steps)}
        for name in RESERVED:  # not on a line: never a reason to trace whole
            values[name] = _reserved_line((pa, pb, pc), name, values["total"])
        for f in fields(pc):
            if f.name in values or f.name in ("rank", "same_as", "peak_phase", "peak_module", "by_module"):
                continue
            v = _line(getattr(pa, f.name), getattr(pb, f.name), getattr(pc, f.name), steps,
                      exact=f.name in EXACT or f.name == "host_pinned")
            if v is _OFF:
                return None
            values[f.name] = v
        out.append(type(pc)(rank=pc.rank, same_as=pc.same_as, peak_phase=peak_phase, peak_module=peak["module"],
                            by_module=[], **values))
    return out


def _renamed(module: str | None, parent: str, depth: int) -> str | None:
    """A module of the last block traced named as in the last block of `depth`."""
    last = f"{parent}.{DEPTHS[-1] - 1}"
    if module is not None and (module == last or module.startswith(last + ".")):
        return f"{parent}.{depth - 1}" + module[len(last):]
    return module


def _calls(a: dict, b: dict, c: dict, steps: int) -> dict:
    """The distinct op calls of the step at `steps` more blocks, for a GPU profile's pricing by shape: those of
    every depth on their line; the rest (calls over every parameter, whose shapes follow the depth) left to
    be priced by their class from the work, which is extended exactly."""
    out = {}
    for key in a.keys() & b.keys() & c.keys():
        row = _line(a[key], b[key], c[key], steps)
        if row is not _OFF:
            out[key] = row
    return out


def _tail(a: list, b: list, c: list, steps: int) -> list | None:
    """The ops outside forward and backward at `steps` more blocks, each (op, FLOPs, bytes): an op per parameter
    (a loop over the parameters) the more often, one op over every parameter (foreach) the larger; None where
    the three depths' ops draw no such lines."""
    from collections import Counter

    counts = [Counter(t) for t in (a, b, c)]
    common = set(counts[0]) & set(counts[1]) & set(counts[2])
    out = []
    for op in sorted(common):
        n = _line(*(k[op] for k in counts), steps, exact=True)
        if n is _OFF or n < 0:
            return None
        out += [op] * n
    rest = [[op for op in t if op not in common] for t in (a, b, c)]
    if not len(rest[0]) == len(rest[1]) == len(rest[2]):
        return None
    for ops in zip(*rest):  # in order: one op's calls whose sizes follow the model's (a foreach op's)
        if len({name for name, _, _ in ops}) != 1:
            return None
        sizes = _line(*(op[1:] for op in ops), steps, exact=True)
        if sizes is _OFF:
            return None
        out.append((ops[0][0], *sizes))
    return out


_OFF = object()
# bytes held at the peak: on their line to the byte
EXACT = {"params", "grads", "optimizer", "activations", "temp", "total", "workspaces", "rounding"}


# a CUDA plan's caching allocator's segments (Note [caching allocator] in parallel/planning/allocator.py)
RESERVED = ("reserved", "reserved_expandable")


def _reserved_line(plans: tuple, name: str, total: int) -> int:
    """A reserved count (`name`) of the plans at DEPTHS, at the depth whose total is `total`: that total and the
    most the allocator cached over the total at the three depths, in whole 2 MiB (every segment's and page's
    multiple); 0 stays 0. Not the line of the three: a freed segment is refilled by the blocks after it until
    it is used up and the next is made (a sawtooth over depth: every 4 blocks on the 697M Llama, Note
    [caching allocator]), so the three depths see part of one period (tests/unit/test_plan_depth.py)."""
    if all(getattr(p, name) == 0 for p in plans):
        return 0
    over = max(getattr(p, name) - p.total for p in plans)
    return -(-(total + max(over, 0)) // SMALL_SEGMENT) * SMALL_SEGMENT


def _line(a, b, c, steps: int, exact: bool = False):
    """c extended by `steps` more blocks along the line a, b, c draw; _OFF if they draw none. Counts of one
    step are the mean of the two steps planned (halved, rounded down): a second difference of 1 is that."""
    if isinstance(a, dict):
        if not (isinstance(b, dict) and isinstance(c, dict) and a.keys() == b.keys() == c.keys()):
            return _OFF
        out = {k: _line(a[k], b[k], c[k], steps, exact) for k in c}
        return _OFF if any(v is _OFF for v in out.values()) else out
    if isinstance(a, (list, tuple)):
        if not (isinstance(b, (list, tuple)) and isinstance(c, (list, tuple)) and len(a) == len(b) == len(c)):
            return _OFF
        out = [_line(x, y, z, steps, exact) for x, y, z in zip(a, b, c)]
        return _OFF if any(v is _OFF for v in out) else type(c)(out)
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or \
            not isinstance(c, (int, float)):
        return c if a == b == c else _OFF
    step = c - b
    if isinstance(a, int) and isinstance(b, int) and isinstance(c, int):
        return c + steps * step if abs(step - (b - a)) <= (0 if exact else 1) else _OFF
    return c + steps * step if math.isclose(step, b - a, rel_tol=1e-6, abs_tol=1e-9) else _OFF
