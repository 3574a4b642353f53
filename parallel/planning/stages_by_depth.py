"""A pipeline planned by depth: every stage's blocks cut to a few, each role's plan extended to its own.

# Note [stages by depth]
A pipeline stage holds a contiguous run of the model's candidate blocks (Note
[pipeline partitioning]): the embedding on the first stage, the head on the
last, and between them a share of the list of blocks alike; an interleaved or
V-shaped schedule gives each rank several stages. A rank's plan depends on
its own stages and the schedule's order of their microbatches (how many a
stage holds at once: all under GPipe, up to the pipeline degree under 1F1B,
more per rank under interleaving), and on its neighbours only through the
shapes that cross between stages, which do not depend on how many blocks a
stage holds. So the plan of every role is a function of the blocks its stages
hold, and it grows block by block as the plan of a model of blocks alike does
(Note [planning by depth]) when every stage grows by one block at once.

The split is the real run's: `plan_split` of the whole model, balanced by the
blocks' FLOPs as the planner's run does (fast for blocks alike: Note [a split by
blocks alike] in parallel/strategies/pipeline/split.py). Stage s then holds k_s
of the list's blocks; K is the fewest any stage holding blocks holds (stages
of none, an embedding or a head alone, stay so). The model is planned at
DEPTHS d = 2, 3, 4 with stage s holding k_s - K + d blocks, cut there by
`strategy.split_points` (the same candidates around the list; the list cut to
the sum), and every count of each role's plan is extended along its line to
d = K: a stage's first and last blocks stay its first and last, the schedule
stays the schedule, and only the blocks between them are fewer. Where a count
is off its line, the pipeline is traced whole, as it is where K is no more
than 2 + 3 + 4 (GAINS_FROM): what costs most in a pipeline's plan is its step,
each block of each stage run for every microbatch, and the three depths run
2 + 3 + 4 blocks a stage where the whole model runs K (a 405B Llama over 16
interleaved stages holds 7 or 8 a stage: traced whole). Where the first
three depths' forward peak moves (the last stage's, from its blocks to its
head, between 2 and 3 blocks), a fourth depth, 5, is planned and the line
drawn through 3, 4 and 5. Each depth's
model is built once, copied for each role (a 405B Llama takes 5 s to build on
meta here, its copy cut to 4 blocks a stage well under one), and each depth's
split traced once for all its roles (Note [a traced split, once] in split.py).
The planner's cases give the same bytes both ways (tests/unit/test_plan_depth.py);
a Llama 3.1 8B (seq 8192) over dp 8 x pp 2, 1F1B with 2 microbatches, bf16 CUDA,
recomputed, gives each rank's peak to the byte (85,010,922,496 and
105,065,479,168) and the same step time, in 71 s where the whole trace takes
125 s here. Not exact there: the first stage's forward phase, not the peak,
is planned at 77.9 GB where the whole trace has 79.2 (a phase's peak is the
largest of many moments, each on a line of its own, and one that grows faster
may overtake the others past the depths planned, where three points on one
line do not show it), and the reserved bytes (-2.3% and +1.5%: Note [caching
allocator]).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from parallel.blocks import shortened
from parallel.models.build import build_meta_model
from parallel.planning.depth import DEPTHS, block_list, extend
from parallel.runtime import Runtime
from parallel.strategies.pipeline import plan_split

if TYPE_CHECKING:
    from parallel.config import Config
    from parallel.dims import ParallelDims


# A stage's blocks step through the three depths planned 2 + 3 + 4 times, through the whole model once: fewer
# blocks a stage than that are faster traced whole (Note [stages by depth]).
GAINS_FROM = sum(DEPTHS)


def plan_stages(cfg: "Config", dims: "ParallelDims", plan_roles, data=None) -> list | None:
    """Every role's plan of a pipeline over a model of blocks alike, from its plans with DEPTHS blocks a stage
    extended (Note [stages by depth]); None where it has no such blocks, its stages hold too few to gain by
    it, or the plans draw no lines. `plan_roles(cfg, make_model)`: a RankPlan per role."""
    model = build_meta_model(cfg.model)
    found = block_list(model)
    if found is None:
        return None
    parent, blocks = found
    every = [f"{parent}.{name}" for name, _ in blocks.named_children()]
    split = plan_split(model, cfg, dims.dp * dims.ep, Runtime(time_blocks=False, data=data), trace_split=False)
    held = _held(split.blocks, split.starts, every)
    fewest = min((k for k in held if k), default=0) if held is not None else 0
    if fewest <= GAINS_FROM:  # the depths planned would step through more blocks than the model's stages hold
        return None
    plans = {}
    for d in (*DEPTHS, DEPTHS[-1] + 1):  # one deeper where a peak moved between the shallowest two
        if d >= fewest:
            break
        counts = [k - fewest + d if k else 0 for k in held]
        c = copy.deepcopy(cfg)
        c.strategy.split_points = _starts(split.blocks, split.starts, every, counts)[1:]
        with shortened(model, parent, sum(counts)):
            short = copy.deepcopy(model)
        plans[d] = plan_roles(c, lambda short=short: copy.deepcopy(short))
        if len(plans) >= len(DEPTHS):
            out = extend(plans, fewest, parent, rename=lambda module: _renamed(module, every, held, fewest, d))
            if out is not None:
                return out
    return None


def _held(names: list[str], starts: list[str], every: list[str]) -> list[int] | None:
    """How many of the list's blocks (`every`) each stage holds, or None where the list is not one contiguous
    run of the candidates `names` in its own order."""
    first = names.index(every[0]) if every[0] in names else -1
    if first < 0 or names[first:first + len(every)] != every:
        return None
    bounds = [names.index(s) for s in starts] + [len(names)]
    inside = range(first, first + len(every))
    return [len([i for i in range(a, b) if i in inside]) for a, b in zip(bounds, bounds[1:])]


def _starts(names: list[str], starts: list[str], every: list[str], counts: list[int]) -> list[str]:
    """The stages' first candidates when stage s holds counts[s] of the list's blocks: a stage that begins at
    one of them begins after the blocks of the stages before it."""
    out, before = [], 0
    for s, name in enumerate(starts):
        out.append(every[before] if name in every else name)
        before += counts[s]
    return out


def _renamed(module: str | None, every: list[str], held: list[int], fewest: int, deepest: int) -> str | None:
    """A module of the plan at `deepest` blocks named as in the whole model: the i-th block of a stage is its
    i-th there, and a stage's last block its last (Note [stages by depth])."""
    if module is None:
        return None
    counts = [k - fewest + deepest if k else 0 for k in held]
    stage, _, rest = module.partition(".")  # a module of a stage's graph is named below its stage's index
    prefix, inner = (stage + ".", rest) if stage.isdigit() else ("", module)
    at, real = 0, 0
    for k, n in zip(counts, held):
        for i in range(k):
            name = every[at + i]
            if inner == name or inner.startswith(name + "."):
                j = real + (n - 1 if i == k - 1 else i)
                return prefix + every[j] + inner[len(name):]
        at, real = at + k, real + n
    return module
