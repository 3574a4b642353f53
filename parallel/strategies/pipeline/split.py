"""Where the model is cut: stage boundaries chosen (given or balanced) and the forward traced into stages.

Nothing here touches a process group or a device beyond `runtime.agree`: the
split is planned on the meta device, so the config check (check.py) and the
planner run the same code as a worker does before it builds its stages.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from parallel.blocks import alike_blocks, candidates, shortened
from parallel.config import Config, ConfigError
from parallel.data import example_input
from parallel.memory.budget import budget_bytes
from parallel.optim import state_per_weight
from parallel.runtime import Runtime
from parallel.strategies.pipeline import partition, schedules
from parallel.strategies.pipeline.chain import chain, stage_shapes
from parallel.strategies.pipeline.trace import by_name, trace, untraceable


@dataclass
class Split:
    """How the model is cut: stage start blocks, the traced pipe, and one row per stage to print."""

    starts: list[str]
    pipe: object
    rows: list[dict] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)  # every candidate block, in forward order
    # Buffers the model keeps out of its state dict (persistent=False: Hugging Face's rotary `inv_freq`);
    # the traced stages hold every buffer alike, so build_stages marks these again.
    transient: set[str] = field(default_factory=set)


def microbatches(cfg: Config) -> int:
    return cfg.strategy.microbatches  # filled by parallel.validate.resolve


def example_microbatch(cfg: Config, dp: int, data=None) -> tuple:
    """The positional inputs of one microbatch (meta tensors), as the data source will hand them out (`data`:
    Runtime.data); under
    context parallelism (strategy=hybrid), this rank's chunks of each sequence and their positions (Note
    [context parallelism under the pipeline] in parallel/strategies/context/__init__.py)."""
    # One input tensor: inputs by name are refused under pipeline (Note [inputs by name] in parallel/tensors.py).
    example = (example_input(cfg.data, batch=cfg.trainer.batch_size // dp // microbatches(cfg), spec=data),)
    cp = cfg.strategy.cp
    if cp == 1:
        return example
    tokens = example[0].narrow(1, 0, example[0].shape[1] // cp)
    return tokens, torch.zeros_like(tokens)


def plan_split(model: nn.Module, cfg: Config, dp: int, runtime: Runtime, trace_split: bool = True) -> Split:
    """Choose the stage boundaries (split points given, or balanced) and trace the split.

    Args:
        model: the unpartitioned model on the meta device.
        cfg: the run config (strategy.split_points, strategy.balance, memory.budget).
        dp: the data-parallel degree (it sets the microbatch size).
        runtime: `time_blocks` (False: weigh blocks by FLOPs only), `agree` (every rank takes rank 0's split).
        trace_split: False (the config check) traces the chosen split only when checking the boundaries
            did not already show that every block is a place of its own to cut; `pipe` is then None.
    """
    s = cfg.strategy
    n_stages = s.pp * s.stages_per_rank
    example = example_microbatch(cfg, dp, runtime.data)
    # Only rank 0's choice counts (runtime.agree), so only rank 0 times the blocks and
    # traces the boundaries: the others would compete with it for the machine and
    # skew what it measures.
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    chooses = not distributed or dist.get_rank() == 0
    timed = runtime.time_blocks and chooses
    in_flight = microbatches(cfg) if schedules.canonical(s.schedule) == "GPipe" else min(microbatches(cfg), s.pp)
    found = None if timed else alike_blocks(model, SHORT)
    costs = _costs_by_blocks_alike(model, example, *found) if found is not None else None
    if costs is None:
        costs = _costs(model, example, timed)
    names, blocks, bounds = costs
    if n_stages > len(names):
        raise ConfigError(f"strategy.pp={s.pp} x stages_per_rank={s.stages_per_rank}: {n_stages} stages, "
                          f"but {type(model).__name__} has only {len(names)} blocks to split ({', '.join(names)}): its "
                          "top-level children, the items of its top-level ModuleLists / Sequentials / ModuleDicts, and the "
                          "repeated blocks of a child that holds them (Note [nested blocks] in parallel/blocks.py)")
    starts_idx, exact = _choose_starts(cfg, names, blocks, in_flight, bounds()) if chooses else (None, False)
    starts_idx = runtime.agree(starts_idx)  # every rank must cut the model the same way: rank 0's choice wins
    if starts_idx is None:  # no rank 0 to agree with (the planner plans each rank on its own)
        starts_idx, exact = _choose_starts(cfg, names, blocks, in_flight, bounds())
    starts = [names[i] for i in starts_idx]
    pipe = None
    if trace_split or not exact:
        pipe = _traced(model, example, names, starts) if runtime.reuse_traces else trace(model, example, starts)
        if pipe.num_stages != n_stages:
            raise ConfigError(f"strategy.split_points={starts[1:]}: the traced forward gave {pipe.num_stages} "
                              f"stages, not {n_stages}; pick blocks that the forward calls in order")
    saved = set(model.state_dict())
    transient = {n for n, _ in model.named_buffers(remove_duplicate=False) if n not in saved}
    return Split(starts, pipe, _rows(cfg, blocks, starts_idx, in_flight), names, transient)


def _costs(model: nn.Module, example: tuple, timed: bool):
    """Every candidate block's name and cost, and how to find where stages may begin: (names, costs, bounds),
    `bounds()` giving `_boundaries`' answer."""
    try:
        names, inputs = candidates(model, *by_name(example))
    except Exception as e:  # the forward failed on meta tensors: same cause as a failed trace
        raise untraceable(model, e) from None
    blocks = partition.measure(model, names, inputs, measure_limit_bytes=(256 << 20) if timed else -1)
    return names, blocks, lambda: _boundaries(model, example, names)


# Note [a split by blocks alike]
# A split weighed by FLOPs (the config check's, the planner's: blocks not timed) asks three things of every
# block: that it runs on meta (`candidates`), its FLOPs and bytes (`partition.measure`), and whether only
# floating-point values cross before it (`_boundaries`, a trace of the whole model cut before every block).
# On a 126-block Llama 405B those took 230 s here. Blocks alike (Note [blocks alike] in parallel/blocks.py)
# give one answer each, so they are asked of the model with its list cut to SHORT blocks, and every block of
# the list takes the answer of the list's second to last blocks there: its cost (the same FLOPs and bytes for
# each, checked), and whether a stage may begin at it (the same for the SHORT - 1 boundaries inside the list,
# checked; the first block's is its own). The candidates before and after the list keep theirs. The balanced
# split over these costs is the one over every block's (they are the same numbers), and so is the traced split,
# which is made of the whole model as before. A list whose blocks' answers differ is asked whole.
SHORT = 4


def _costs_by_blocks_alike(model: nn.Module, example: tuple, parent: str, blocks: nn.Module):
    """`_costs` of `model` from the model with its list of blocks alike `parent` cut to SHORT blocks (Note [a
    split by blocks alike]), or None where the blocks' answers differ there."""
    n = len(list(blocks.children()))
    with shortened(model, parent, SHORT):
        names, costs, bounds = _costs(model, example, timed=False)
        inner = [f"{parent}.{name}" for name, _ in model.get_submodule(parent).named_children()]
        first = names.index(inner[0]) if inner[0] in names else -1
        if first < 0 or names[first:first + SHORT] != inner:
            return None
        allowed, exact = bounds()
    alike = {(b.params, b.param_bytes, b.act_bytes, b.flops, b.time_s) for b in costs[first:first + SHORT]}
    inside = {first + i in allowed for i in range(1, SHORT)}
    if len(alike) != 1 or len(inside) != 1:
        return None
    every = [f"{parent}.{name}" for name, _ in blocks.named_children()]
    names = names[:first] + every + names[first + SHORT:]
    one = costs[first + 1]
    costs = costs[:first] + [dataclasses.replace(one, name=name) for name in every] + costs[first + SHORT:]
    after = n - SHORT  # the indices past the list move by the blocks put back
    allowed = {i for i in allowed if i <= first} | {i + after for i in allowed if i >= first + SHORT} | \
        (set(range(first + 1, first + n)) if inside.pop() else set())
    return names, costs, lambda: (set(allowed), exact)


def _choose_starts(cfg: Config, names: list[str], blocks: list[partition.BlockCost], in_flight: int,
                   bounds: tuple[set[int], bool]) -> tuple[list[int], bool]:
    """Block indices where stages begin, and whether every block is a call site of its own (`bounds`: where a
    stage may begin and that, `_boundaries`' answer)."""
    s = cfg.strategy
    allowed, exact = bounds
    if s.split_points:
        return _given_starts(s, names, s.pp * s.stages_per_rank, allowed), exact
    return _balanced_starts(cfg, blocks, s.pp * s.stages_per_rank, allowed, in_flight), exact


def _balanced_starts(cfg: Config, blocks: list[partition.BlockCost], n_stages: int, allowed: set[int],
                     in_flight: int) -> list[int]:
    """Block indices where stages begin, balanced by strategy.balance within memory.budget."""
    s = cfg.strategy
    state = state_per_weight(cfg)
    costs = [partition.cost_of(b, s.balance, in_flight, state) for b in blocks]
    mem = [partition.stage_memory([b], in_flight, state, _shares(cfg), _recomputed(cfg)) for b in blocks]
    budget = budget_bytes(cfg.memory)
    try:
        return partition.balance(costs, n_stages, mem, budget, allowed)
    except ValueError as e:
        key = "memory.budget" if budget is not None else "strategy.pp"
        raise ConfigError(f"{key}={cfg.memory.budget if budget is not None else s.pp}: {e}") from None


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


# _boundaries' answers in this process, by what they depend on (`_fingerprint`): the config check traces them
# in the launcher, and the workers it forks then (Note [a split's boundaries, once]); the planner, for each role
# and each of auto's candidates that cut the same model into microbatches of one shape. Oldest out first.
_KNOWN_BOUNDARIES: dict[tuple, tuple[set[int], bool]] = {}
_KNOWN_LIMIT = 32


def _boundaries(model: nn.Module, example: tuple, names: list[str]) -> tuple[set[int], bool]:
    """Block indices where a stage may begin (only floating-point and boolean tensors cross there), and
    whether the trace cut before every block (each is a call site of its own: any cuts give their stages).

    PyTorch's stages learn what they receive at the first step by running the
    forward on placeholder values; integers there (token ids, positions) would
    be arbitrary and index out of range, and no gradient flows back through
    them. Arbitrary booleans (an attention mask a Hugging Face model built in its
    first stage) only shape that trial run. Found by tracing a split before every
    block once and reading what flows into each piece (Note [stage chain] in chain.py).

    # Note [a split's boundaries, once]
    That trace is most of what planning a split costs (0.15-0.6 s for the
    built-in MLP or a small gpt here, more for a Hugging Face model), and a run
    made it twice: in the config check, then on rank 0 of the workers forked
    after it, the other ranks waiting on rank 0's choice (the planner, once
    more for each role). The answer is kept in this process by everything it
    can depend on: every module's name, class, forward, forward hooks and plain
    attributes (a Hugging Face config among them), every parameter's and
    buffer's name, shape and dtype, the microbatch's shapes and dtypes, and the
    block names. A model that differs in any of those traces again, and so
    does one built anew that holds an attribute whose text is its address (a
    bound method, an arbitrary object), and one whose attribute has no text
    (its repr raises).
    """
    key = _fingerprint(model, example, names)
    if key not in _KNOWN_BOUNDARIES:
        if len(_KNOWN_BOUNDARIES) >= _KNOWN_LIMIT:
            del _KNOWN_BOUNDARIES[next(iter(_KNOWN_BOUNDARIES))]
        _KNOWN_BOUNDARIES[key] = _traced_boundaries(model, example, names)
    allowed, exact = _KNOWN_BOUNDARIES[key]
    return set(allowed), exact


def _traced_boundaries(model: nn.Module, example: tuple, names: list[str]) -> tuple[set[int], bool]:
    pipe = trace(model, example, names)
    if pipe.num_stages != len(names):
        return set(range(1, len(names))), False  # some block is not a call site of its own; let the trace decide
    shapes = stage_shapes(_chained(pipe), example)
    return {j for j in range(1, len(names))
            if all(t.dtype.is_floating_point or t.dtype == torch.bool for t in shapes[j][0])}, True


# Note [a traced split, once]
# The planner plans every rank role of a pipeline on its own (Note [planner]), each building the model and
# tracing the same split of it: 8 traces of one 70-block model for a pipeline of degree 8, 2-4 s a trace for
# a Llama 405B's few blocks here, where the steps planned take less. With `runtime.reuse_traces` the split
# traced is kept in this process by what it depends on (`_fingerprint` and the cuts) and each later role
# gets a copy of it, untouched (its stages are rewritten in place as they are built: Note [stage chain]).
_KNOWN_TRACES: dict[tuple, object] = {}


def _traced(model: nn.Module, example: tuple, names: list[str], starts: list[str]):
    """`trace(model, example, starts)`, or a copy of it traced before (Note [a traced split, once])."""
    key = (_fingerprint(model, example, names), tuple(starts))
    if key not in _KNOWN_TRACES:
        if len(_KNOWN_TRACES) >= _KNOWN_LIMIT // 4:
            del _KNOWN_TRACES[next(iter(_KNOWN_TRACES))]
        pipe = trace(model, example, starts)
        with unset_fake_temporarily():
            _KNOWN_TRACES[key] = copy.deepcopy(pipe)
        return pipe
    with unset_fake_temporarily():  # under the planner's fake mode a meta buffer would copy as a fake tensor
        return copy.deepcopy(_KNOWN_TRACES[key])


def _fingerprint(model: nn.Module, example: tuple, names: list[str]) -> tuple:
    """What a traced split of `model` on `example` can depend on (Note [a split's boundaries, once])."""
    modules = tuple((name, type(m), type(m).forward, *map(tuple, (m._forward_pre_hooks.values(),
                                                                   m._forward_hooks.values())),
                     tuple(sorted(((k, _text(v)) for k, v in vars(m).items()
                                   if not k.startswith("_") and not isinstance(v, (nn.Module, torch.Tensor))),
                                  key=lambda kv: kv[0])))
                    for name, m in model.named_modules(remove_duplicate=False))
    tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in
                    [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    inputs = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in example)
    return modules, tensors, inputs, tuple(names)


def _text(value) -> str | object:
    """An attribute's text for `_fingerprint`; one whose repr fails matches nothing (a new object)."""
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - any attribute a user's model holds
        return object()


def _chained(pipe) -> list:
    try:
        return chain(pipe)  # Note [stage chain]
    except ValueError as e:
        raise ConfigError(f"strategy=pipeline: {e}") from None


def _rows(cfg: Config, blocks: list[partition.BlockCost], starts_idx: list[int], in_flight: int) -> list[dict]:
    """One row per stage for the printed partition: its rank, blocks, parameters, predicted time and memory."""
    s = cfg.strategy
    ranks = schedules.stage_ranks(s.schedule, s.pp, s.stages_per_rank)
    bounds = starts_idx + [len(blocks)]
    rows = []
    for i in range(len(starts_idx)):
        group = blocks[bounds[i]:bounds[i + 1]]
        rows.append({"stage": i, "rank": ranks[i], "first": group[0].name, "last": group[-1].name,
                     "blocks": len(group), "params": sum(b.params for b in group),
                     "time_ms": 1e3 * sum(b.time_s for b in group),
                     "memory_bytes": partition.stage_memory(group, in_flight, state_per_weight(cfg), _shares(cfg),
                                                            _recomputed(cfg))})
    return rows


def _recomputed(cfg: Config) -> bool:
    """Every block recomputed whole in backward (strategy.activations=checkpoint): it keeps its input alone."""
    return cfg.strategy.activations == "checkpoint"


def _shares(cfg: Config) -> tuple[float, float, float]:
    """What one rank holds of a stage's states: ZeRO's shards over the dp x cp ranks of its shard group
    (dp / dp_replicate of them under hybrid sharding, Note [hybrid sharding])."""
    s = cfg.strategy
    ranks = (s.dp or 1) * (s.cp or 1) // (s.dp_replicate or 1)
    return partition.held_shares(s.zero or 0, ranks)


def format_split(split: Split) -> str:
    """The partition as a table: stage, rank, blocks, parameters, predicted time and memory."""
    lines = [f"{'stage':>5} {'rank':>4}  {'blocks':<28} {'params':>10} {'time ms':>8} {'memory MB':>10}"]
    for r in split.rows:
        span = r["first"] if r["blocks"] == 1 else f"{r['first']} .. {r['last']}"
        lines.append(f"{r['stage']:>5} {r['rank']:>4}  {span:<28} {r['params']:>10,} {r['time_ms']:>8.2f} "
                     f"{r['memory_bytes'] / 1e6:>10.2f}")
    return "\n".join(lines)
