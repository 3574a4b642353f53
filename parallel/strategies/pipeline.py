"""strategy=pipeline: the model split by layers into stages, microbatches through PyTorch's schedules.

The split is traced from the model's forward (Note [pipeline partitioning] in
partition.py), so every stage keeps the original parameter names and skip
connections that cross stages are carried. Weights tied across stages (an
embedding shared with the output head) live as one copy per stage; their
gradients are summed over the copies before the step, so the copies stay equal.
"""
from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline
from torch.distributed.tensor import DTensor

from parallel.blocks import candidates
from parallel.config import Config, ConfigError, fail, positive
from parallel.data import example_input
from parallel.engine import Engine
from parallel.init import InitPlan, materialize_and_init
from parallel.loss import loss_fn
from parallel.memory.budget import budget_bytes
from parallel.metrics import gather_floats, log
from parallel.optim import clip_grads
from parallel.runtime import Runtime
from parallel.strategies import partition, schedules
from parallel.strategies.chain import chain, compiled, retarget
from parallel.strategies.recompute import recompute_blocks, recomputing
from parallel.tensors import local

# Copying a traced pipeline copies torch's own pytree specs, whose deprecated
# LeafSpec check warns once per process from inside torch; nothing to act on here.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


@dataclass
class Split:
    """How the model is cut: stage start blocks, the traced pipe, and one row per stage to print."""

    starts: list[str]
    pipe: object
    rows: list[dict] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)  # every candidate block, in forward order


def example_microbatch(cfg: Config, dp: int) -> tuple:
    """The positional inputs of one microbatch (meta tensors), as the data source will hand them out."""
    return example_input(cfg.data, batch=cfg.trainer.batch_size // dp // microbatches(cfg))


def microbatches(cfg: Config) -> int:
    return cfg.strategy.microbatches  # filled by parallel.validate.resolve


def trace(model: nn.Module, example: tuple, starts: list[str]):
    """Trace `model` (on meta) and cut it before each name in `starts[1:]`.

    Tracing rearranges the module it is given (tied weights above all), so it
    works on a copy: the model can be traced again, with other cuts.
    """
    try:
        return pipeline(copy.deepcopy(model), mb_args=example,
                        split_spec={n: SplitPoint.BEGINNING for n in starts[1:]})
    except Exception as e:  # torch.export raises many types; all mean "cannot trace"
        raise untraceable(model, e) from None


def untraceable(model: nn.Module, e: Exception) -> ConfigError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return ConfigError(
        f"strategy=pipeline: the forward of {type(model).__name__} cannot be traced into stages "
        f"({type(e).__name__}: {first}). Pipelining needs a forward without data-dependent Python "
        "control flow that takes and returns tensors; rewrite that part (e.g. torch.where instead of "
        "`if` on a tensor's value), or use strategy=data.")


def plan_split(model: nn.Module, cfg: Config, dp: int, runtime: Runtime) -> Split:
    """Choose the stage boundaries (split points given, or balanced) and trace the split.

    Args:
        model: the unpartitioned model on the meta device.
        cfg: the run config (strategy.split_points, strategy.balance, memory.budget).
        dp: the data-parallel degree (it sets the microbatch size).
        runtime: `time_blocks` (False: weigh blocks by FLOPs only), `agree` (every rank takes rank 0's split).
    """
    s = cfg.strategy
    n_stages = s.pp * s.stages_per_rank
    example = example_microbatch(cfg, dp)
    try:
        names, inputs = candidates(model, example)
    except Exception as e:  # the forward failed on meta tensors: same cause as a failed trace
        raise untraceable(model, e) from None
    if n_stages > len(names):
        raise ConfigError(f"strategy.pp={s.pp} x stages_per_rank={s.stages_per_rank}: {n_stages} stages, "
                          f"but {type(model).__name__} has only {len(names)} blocks to split ({', '.join(names)})")
    # Only rank 0's choice counts (below), so only rank 0 times the blocks: the
    # others would compete with it for the machine and skew what it measures.
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    timed = runtime.time_blocks and (not distributed or dist.get_rank() == 0)
    blocks = partition.measure(model, names, inputs, measure_limit_bytes=(256 << 20) if timed else -1)
    in_flight = microbatches(cfg) if schedules.canonical(s.schedule) == "GPipe" else min(microbatches(cfg), s.pp)
    allowed = _float_boundaries(model, example, names)
    if s.split_points:
        starts_idx = _given_starts(s, names, n_stages, allowed)
    else:
        costs = [partition.cost_of(b, s.balance, in_flight) for b in blocks]
        mem = [partition.stage_memory([b], in_flight) for b in blocks]
        budget = budget_bytes(cfg.memory)
        try:
            starts_idx = partition.balance(costs, n_stages, mem, budget, allowed)
        except ValueError as e:
            key = "memory.budget" if budget is not None else "strategy.pp"
            raise ConfigError(f"{key}={cfg.memory.budget if budget is not None else s.pp}: {e}") from None
    starts_idx = runtime.agree(starts_idx)  # every rank must cut the model the same way: rank 0's choice wins
    starts = [names[i] for i in starts_idx]
    pipe = trace(model, example, starts)
    if pipe.num_stages != n_stages:
        raise ConfigError(f"strategy.split_points={starts[1:]}: the traced forward gave {pipe.num_stages} "
                          f"stages, not {n_stages}; pick blocks that the forward calls in order")
    ranks = schedules.stage_ranks(s.schedule, s.pp, s.stages_per_rank)
    bounds = starts_idx + [len(names)]
    rows = []
    for i in range(n_stages):
        group = blocks[bounds[i]:bounds[i + 1]]
        rows.append({"stage": i, "rank": ranks[i], "first": group[0].name, "last": group[-1].name,
                     "blocks": len(group), "params": sum(b.params for b in group),
                     "time_ms": 1e3 * sum(b.time_s for b in group),
                     "memory_bytes": partition.stage_memory(group, in_flight)})
    return Split(starts, pipe, rows, names)


def _given_starts(s, names: list[str], n_stages: int, allowed: set[int]) -> list[int]:
    """Block indices of strategy.split_points, checked."""
    missing = [p for p in s.split_points if p not in names]
    if missing:
        raise ConfigError(f"strategy.split_points={list(s.split_points)}: {missing} name no block where a "
                          f"stage can begin (valid: {names[1:]})")
    if len(s.split_points) != n_stages - 1:
        raise ConfigError(f"strategy.split_points={list(s.split_points)}: {n_stages} stages need "
                          f"{n_stages - 1} split points")
    idx = sorted(names.index(p) for p in s.split_points)
    if idx[0] == 0 or len(set(idx)) != len(idx):
        raise ConfigError(f"strategy.split_points={list(s.split_points)}: must be distinct and not the "
                          f"first block '{names[0]}'")
    bad = [names[i] for i in idx if i not in allowed]
    if bad:
        raise ConfigError(f"strategy.split_points={list(s.split_points)}: at {bad} integer tensors (token ids, "
                          f"positions) would cross between stages, which PyTorch's stages cannot carry; "
                          f"cut elsewhere (valid: {[names[i] for i in sorted(allowed)]})")
    return [0] + idx


def _float_boundaries(model: nn.Module, example: tuple, names: list[str]) -> set[int]:
    """Block indices where a stage may begin: only floating-point tensors cross there.

    PyTorch's stages learn what they receive at the first step by running the
    forward on placeholder values; integers there (token ids, positions) would
    be arbitrary and index out of range, and no gradient flows back through
    them. Found by tracing a split before every block once and reading what
    flows into each piece (Note [stage chain]).
    """
    pipe = trace(model, example, names)
    if pipe.num_stages != len(names):
        return set(range(1, len(names)))  # some block is not a call site of its own; let the trace decide
    shapes = _stage_shapes(chain(pipe), example)
    return {j for j in range(1, len(names)) if all(t.dtype.is_floating_point for t in shapes[j][0])}


def format_split(split: Split) -> str:
    lines = [f"{'stage':>5} {'rank':>4}  {'blocks':<28} {'params':>10} {'time ms':>8} {'memory MB':>10}"]
    for r in split.rows:
        span = r["first"] if r["blocks"] == 1 else f"{r['first']} .. {r['last']}"
        lines.append(f"{r['stage']:>5} {r['rank']:>4}  {span:<28} {r['params']:>10,} {r['time_ms']:>8.2f} "
                     f"{r['memory_bytes'] / 1e6:>10.2f}")
    return "\n".join(lines)


@dataclass
class TiedCopy:
    """This rank's copies of one weight tied across stages, and who else holds it."""

    params: list[nn.Parameter]
    group: object  # process group of the ranks holding a copy; None when only this rank does
    owner: bool  # this rank's first copy is the one counted in the gradient norm


def build_pipeline(model: nn.Module, mesh: DeviceMesh, cfg: Config, runtime: Runtime, plan: InitPlan,
                   transform=None, shape_transform=None) -> "PipelineEngine":
    """Split `model` (on meta) into stages over the mesh's pp dimension; return this rank's engine.

    Args:
        transform: `(stage, blocks) -> None`, applied to each of this rank's
            stages (on meta, the model's own block modules swapped in) before
            it is materialized: how strategy=hybrid adds tensor and data
            parallelism. None keeps the traced stages as they are.
        shape_transform: `stage -> None`, the part of `transform` that changes
            the shapes crossing stages (tensor parallelism: a stage may end in
            a sharded layer). Used only when the shapes are given up front
            (`runtime.static_shapes`), where every stage is shaped on a copy.
    """
    split = plan_split(model, cfg, mesh["dp"].size(), runtime)
    log.info("pipeline partition (%s, %d microbatches):\n%s", cfg.strategy.schedule, cfg.strategy.microbatches,
             format_split(split))
    stages, modules, tied = build_stages(split, mesh, cfg, runtime, plan, model if transform else None, transform,
                                         shape_transform)
    groups: dict[str, list[str]] = {}
    for name, entry in plan.items():
        groups.setdefault(entry.canonical, []).append(name)
    tied_names = [names for names in groups.values() if len(names) > 1]
    return PipelineEngine(cfg, mesh, split, stages, modules, tied, loss_fn(cfg.data.task), tied_names)


def build_stages(split: Split, mesh: DeviceMesh, cfg: Config, runtime: Runtime, plan: InitPlan,
                 model: nn.Module | None = None, transform=None, shape_transform=None):
    """Materialize this rank's stages; returns (stage objects, their modules, tied copies).

    With `model` and `transform` (strategy=hybrid), each stage gets the model's
    own block modules in place of the traced ones, then `transform(stage, blocks)`.
    """
    s, device = cfg.strategy, runtime.device
    pp_mesh = mesh["pp"]
    pp_rank, pp_group = pp_mesh.get_local_rank(), pp_mesh.get_group()
    ranks = schedules.stage_ranks(s.schedule, s.pp, s.stages_per_rank)
    mine = [i for i, r in enumerate(ranks) if r == pp_rank]
    try:
        chained = chain(split.pipe)  # Note [stage chain]
    except ValueError as e:
        raise ConfigError(f"strategy=pipeline: {e}") from None
    shapes = None
    if runtime.static_shapes:
        shaped = chained
        if shape_transform is not None:  # each stage as its ranks will hold it, on a copy (still on meta)
            shaped = [copy.deepcopy(gm) for gm in chained]
            for gm in shaped:
                _drop_unused(gm, split.blocks)
                eager_blocks(gm, model, split.blocks)
                shape_transform(gm)
        shapes = _stage_shapes(shaped, example_microbatch(cfg, mesh["dp"].size()))
    stages, modules = [], []
    for i in mine:
        mod = chained[i]
        _drop_unused(mod, split.blocks)
        compiled(mod)
        retarget(mod, device)
        blocks = eager_blocks(mod, model, split.blocks) if transform is not None else None
        if recomputing(cfg):  # before the transform's FSDP units wrap the blocks
            called = {n.target for n in mod.graph.nodes if n.op == "call_module"}
            recompute_blocks(mod, [n for n in split.blocks if n in called])
        if transform is not None:
            transform(mod, blocks)
        materialize_and_init(mod, device, cfg.trainer.seed, plan)
        # Shapes are found at the first step (PyTorch's runtime inference); only
        # floating-point tensors cross stages (_float_boundaries), which that allows.
        given = {}
        if shapes:  # floating-point values carry gradients between stages; the shapes come without them
            marked = [tuple(t.detach().requires_grad_(t.is_floating_point()) for t in ts) for ts in shapes[i]]
            given = dict(input_args=marked[0], output_args=marked[1])
        stages.append(PipelineStage(mod, i, len(chained), device, group=pp_group, **given))
        modules.append(mod)
    return stages, modules, _tie(split, mesh, modules, ranks, plan)


def eager_blocks(stage: fx.GraphModule, model: nn.Module, names: list[str]) -> list[nn.Module]:
    """Put the model's own modules in place of the traced copies of the blocks `stage` calls.

    The traced stage calls each block as a submodule with the arguments the
    forward gave it, so the model's module is a drop-in replacement; tensor
    parallel styles need it (they shard nn.Linear and nn.Embedding, and the
    model's code reads shapes at run time where the trace fixed them). The
    blocks are copied together, so weights shared between them stay shared.
    Returns the swapped-in blocks.
    """
    called = {n.target for n in stage.graph.nodes if n.op == "call_module"}
    held = [n for n in names if n in called]
    originals = copy.deepcopy(nn.ModuleList(model.get_submodule(n) for n in held))
    for name, original in zip(held, originals):
        parent, _, leaf = name.rpartition(".")
        setattr(stage.get_submodule(parent) if parent else stage, leaf, original)
    return list(originals)


def _drop_unused(stage: fx.GraphModule, names: list[str]) -> None:
    """Remove blocks that a traced stage holds but never uses.

    The trace leaves a copy of a weight tied across stages (an output head tied
    to the embedding) in the first stage as well, under the head's name; that
    copy would be materialized, counted and saved without ever being trained.
    """
    used = {n.target for n in stage.graph.nodes if n.op in ("call_module", "get_attr")}
    for name in names:
        if any(u == name or u.startswith(name + ".") for u in used):
            continue
        parent, _, leaf = name.rpartition(".")
        try:
            holder = stage.get_submodule(parent) if parent else stage
        except AttributeError:
            continue
        if leaf in holder._modules:
            delattr(holder, leaf)


def _stage_shapes(chained: list[nn.Module], example: tuple) -> list[tuple[tuple, tuple]]:
    """(inputs, outputs) of every stage for one microbatch, as meta tensors."""
    shapes, values = [], tuple(example)
    with torch.no_grad():
        for gm in chained:  # still on the meta device: nothing is computed
            out = gm(*values)
            out = out if isinstance(out, tuple) else (out,)
            shapes.append((values, out))
            values = out
    return shapes


def _tie(split: Split, mesh: DeviceMesh, modules: list[nn.Module], ranks: list[int], plan: InitPlan):
    """Find weights that more than one stage holds and the groups that sum their gradients."""
    groups: dict[str, list[int]] = {}  # canonical name -> stages holding a copy
    for i in range(split.pipe.num_stages):
        for name, _ in split.pipe.get_stage_module(i).named_parameters():
            canonical = plan[name].canonical
            groups.setdefault(canonical, []).append(i)
    tied = []
    # Every pipeline in the mesh (one per dp x tp position), as rows of global ranks by stage rank.
    pp_rows = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), -1).reshape(-1, mesh["pp"].size())
    me = dist.get_rank()
    for canonical, stages in sorted(groups.items()):
        if len(stages) < 2:
            continue
        holders = sorted({ranks[i] for i in stages})
        group = None
        for row in pp_rows.tolist():  # every rank creates every group, in the same order
            g = dist.new_group([row[r] for r in holders]) if len(holders) > 1 else None
            if me in row:
                group = g
        params = [p for m in modules for n, p in m.named_parameters() if plan[n].canonical == canonical]
        if params:
            pp_rank = mesh["pp"].get_local_rank()
            tied.append(TiedCopy(params, group, owner=ranks[stages[0]] == pp_rank))
    return tied


class PipelineEngine(Engine):
    """One training step through a pipeline schedule, and the pipeline's own metrics."""

    def __init__(self, cfg: Config, mesh: DeviceMesh, split: Split, stages, modules, tied, loss_fn,
                 tied_names: list[list[str]]):
        s = cfg.strategy
        self.tied_names = tied_names
        self.cfg, self.mesh, self.split, self.stages, self.tied = cfg, mesh, split, stages, tied
        self.model = nn.ModuleList(modules)  # what the optimizer and the memory watch see
        self.m = microbatches(cfg)
        cls = schedules.schedule_class(s.schedule)
        multi = schedules.is_multi_stage(s.schedule)
        self.schedule = cls(stages if multi else stages[0], n_microbatches=self.m, loss_fn=loss_fn,
                            scale_grads=True)
        self.has_first = any(st.is_first for st in stages)
        self.has_last = any(st.is_last for st in stages)
        self.holds_loss = self.has_last
        self.loss_group = mesh["dp"].get_group()
        self.pp_group = mesh["pp"].get_group()
        self.busy = 0.0
        self.stage_busy = {st.stage_index: 0.0 for st in stages}
        self.step_time = 0.0
        self.window: list[tuple[float, float, dict]] = []  # (busy, schedule time, stage busy) per step
        for st in stages:
            _time_compute(st, self)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Run the schedule over the batch; returns this rank's mean microbatch loss (0 off the last stage)."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        self.busy, self.stage_busy = 0.0, dict.fromkeys(self.stage_busy, 0.0)
        t0 = time.perf_counter()
        self.schedule.step(*args, target=y if self.has_last else None, losses=losses, return_outputs=False)
        self.step_time = time.perf_counter() - t0
        self.window.append((self.busy, self.step_time, dict(self.stage_busy)))
        self._sum_tied_grads()
        if not losses:
            return torch.zeros((), device=x.device)
        return torch.stack([l.detach().float() for l in losses]).mean()

    def _sum_tied_grads(self) -> None:
        for t in self.tied:
            # Every copy is placed alike (same tensor and data parallel layout at
            # the same mesh position), so summing the local pieces sums the whole.
            grads = [local(p.grad) for p in t.params if p.grad is not None]
            if not grads:
                continue
            total = torch.stack(grads).sum(0)
            if t.group is not None:
                dist.all_reduce(total, group=t.group)
            for g in grads:
                g.copy_(total)

    def kept_tensors(self) -> list[torch.Tensor]:
        """The stages' receive buffers (activations and their gradients, one per microbatch): made at the
        first step and kept, so the memory watch counts them from the start of each later step."""
        out = []
        for st in self.stages:
            for infos in list(st.args_recv_info.values()) + list(st.grad_recv_info.values()):
                out += [i.buffer for i in infos if getattr(i, "buffer", None) is not None]
        return out

    @torch.no_grad()
    def clip(self, max_norm: float) -> torch.Tensor:
        """Global grad norm over all stages (a tied weight counted once), clipped when max_norm > 0."""
        skip = {id(p) for t in self.tied for i, p in enumerate(t.params) if not (t.owner and i == 0)}
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        counted = [p.grad for p in self.model.parameters() if p.grad is not None and id(p) not in skip]
        return clip_grads(grads, max_norm, counted=counted, sum_group=self.pp_group)

    def state_modules(self) -> list[nn.Module]:
        """This rank's stages: their state dicts hold the original names (parallel.checkpoint)."""
        return list(self.model)

    def full_state_dict(self) -> dict:
        """Every stage's tensors under their original names, gathered on global rank 0.

        A weight tied across stages appears under each of its names, as in the
        unpartitioned model's state dict.
        """
        # A DTensor (tensor or data parallel piece) is gathered whole over its own mesh first.
        mine = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                for m in self.model for k, v in m.state_dict().items()}
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if dist.get_rank() != 0:
            return {}
        state = {}
        for part in parts:
            state.update(part)
        for names in self.tied_names:
            present = [n for n in names if n in state]
            for n in names:
                if present and n not in state:
                    state[n] = state[present[0]]
        return state

    def metrics(self) -> dict:
        """Bubble (measured and analytic), stage imbalance; collective over all ranks."""
        s = self.cfg.strategy
        v = s.stages_per_rank
        # The median step since the last log: the trainer's memory watch slows
        # the steps it watches (a dispatch per op), and the median ignores them.
        window = sorted(self.window, key=lambda w: w[1])
        self.busy, self.step_time, self.stage_busy = window[len(window) // 2]
        self.window = []
        busy = gather_floats([self.busy, self.step_time])
        bubbles = [max(0.0, 1 - b / t) if t > 0 else 0.0 for b, t in zip(busy[0::2], busy[1::2])]
        per_stage = [0.0] * (s.pp * s.stages_per_rank)
        for idx, t in self.stage_busy.items():
            per_stage[idx] = t
        stage_times = gather_floats(per_stage)
        totals = [sum(stage_times[i::len(per_stage)]) for i in range(len(per_stage))]
        mean = sum(totals) / len(totals)
        return {"bubble_measured": sum(bubbles) / len(bubbles), "bubble_measured_per_rank": bubbles,
                "bubble_analytic": schedules.analytic_bubble(s.schedule, s.pp, v, self.m),
                "stage_imbalance": max(totals) / mean if mean > 0 else 1.0,
                "schedule_time_s": self.step_time,
                "stage_time_s_per_stage": totals}


def _time_compute(stage, engine: PipelineEngine) -> None:
    """Add the compute time of each chunk this stage runs to the engine's busy counters.

    Sends and receives happen outside these calls, so what is left of the step
    is waiting: the measured bubble.
    """
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        inner = getattr(stage, name)

        def timed(*args, _inner=inner, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                engine.busy += dt
                engine.stage_busy[stage.stage_index] += dt

        setattr(stage, name, timed)


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
    """The model (on meta) traces into the configured stages; bad split points are named."""
    plan_split(model, cfg, cfg.strategy.dp, Runtime(time_blocks=False))
