"""Optimizer, parameter groups and gradient clipping across every mesh dimension.

# Note [optimizer]
`optim._target_` names any torch.optim.Optimizer class (None: AdamW). It is
built as `cls(groups, lr=optim.lr, weight_decay=optim.weight_decay, **args)`,
plus `betas` and `eps` from optim.* when its constructor takes them: lr,
weight decay, betas and eps always come from their own keys (giving one of
them in `optim.args` is an error), everything else from `optim.args`. A class
without a `weight_decay` argument needs optim.weight_decay=0. The class and
its arguments are checked against its signature, and built once on a dummy
parameter, before any worker starts.

Parameter groups are made from the unpartitioned parameter names (under FSDP,
tensor and pipeline parallelism each piece is looked up by the name of the
tensor it is a piece of; a tied weight by its first name): `optim.no_decay`
sets weight_decay 0, `optim.lr_scale` multiplies lr. Parameters with the same
(decay, scale) share one group, in model order; without either key there is
one group, as before. ZeRO 1's ShardedOptimizer takes the class and the
groups and shards their state over data-parallel ranks (Note [ZeRO 1]).
"""
from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from parallel.config import LR_SCHEDULES, Config, OptimConfig, fail, import_target, positive


def check_optim(o: OptimConfig) -> None:
    """The optimizer's and the schedule's own values (the class and its arguments: `check_optimizer`)."""
    if o.name != "adamw":
        fail("optim.name", o.name, "unknown optimizer (another class: optim._target_)", ["adamw"])
    if not o.lr > 0:
        fail("optim.lr", o.lr, "must be > 0")
    if o.weight_decay < 0:
        fail("optim.weight_decay", o.weight_decay, "must be >= 0")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        fail("optim.betas", list(o.betas), "must be two numbers in [0, 1)")
    lr_scales(o)
    positive("optim.warmup_steps", o.warmup_steps, allow_zero=True)
    if o.schedule not in LR_SCHEDULES:
        fail("optim.schedule", o.schedule, "unknown schedule", list(LR_SCHEDULES))
    if not 0 <= o.min_lr_ratio <= 1:
        fail("optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    if o.decay_steps is not None:
        positive("optim.decay_steps", o.decay_steps)
    if not 0 < o.decay_fraction <= 1:
        fail("optim.decay_fraction", o.decay_fraction, "must be in (0, 1]")
    if o.scheduler._target_ is not None and o.warmup_steps:
        fail("optim.warmup_steps", o.warmup_steps, "optim.scheduler._target_ sets the whole schedule (a warmup "
             "too: torch.optim.lr_scheduler.SequentialLR)", 0)


def lr_scales(o: OptimConfig) -> list[tuple[str, float]]:
    """optim.lr_scale as (pattern, factor) pairs. Raises ConfigError for an entry that is not `pattern:factor`
    with a factor > 0."""
    pairs = []
    for entry in o.lr_scale:
        pattern, _, factor = str(entry).rpartition(":")
        try:
            value = float(factor)
        except ValueError:
            value = None
        if not pattern or value is None or not value > 0:
            fail("optim.lr_scale", list(o.lr_scale), f"{entry!r} is not 'pattern:factor' with a factor > 0",
                 "e.g. ['head.*:0.1', '*norm*:2']")
        pairs.append((pattern, value))
    return pairs


def optimizer_class(o: OptimConfig) -> type:
    """The optimizer class `optim._target_` names (AdamW when unset). Raises ConfigError."""
    if o._target_ is None:
        return torch.optim.AdamW
    cls = import_target("optim._target_", o._target_)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        fail("optim._target_", o._target_, "must name a torch.optim.Optimizer subclass ('package.module.Class')",
             "e.g. torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW")
    return cls


def optimizer_kwargs(o: OptimConfig, cls: type) -> dict:
    """The keyword arguments `cls` is built with (Note [optimizer]). Raises ConfigError."""
    takes = inspect.signature(cls.__init__).parameters
    anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values())
    for key in ("lr", "weight_decay", "betas", "eps"):
        if key in o.args:
            fail(f"optim.args.{key}", o.args[key], f"set optim.{key} instead (it is passed to the class itself)")
    kwargs = {"lr": o.lr}
    if "weight_decay" in takes or anything:
        kwargs["weight_decay"] = o.weight_decay
    elif o.weight_decay:
        fail("optim.weight_decay", o.weight_decay, f"{cls.__name__} takes no weight_decay", 0)
    for key, value in (("betas", tuple(o.betas)), ("eps", o.eps)):
        if key in takes:
            kwargs[key] = value
    unknown = sorted(k for k in o.args if k not in takes) if not anything else []
    if unknown:
        options = sorted(k for k in takes if k not in ("self", "params", *kwargs))
        fail("optim.args", dict(o.args), f"{cls.__name__} takes no argument {unknown}", options)
    return kwargs | dict(o.args)


def check_optimizer(cfg: Config, model: nn.Module) -> None:
    """Before workers start: the class, its arguments (built once on a dummy parameter), and the name
    patterns of optim.no_decay and optim.lr_scale (each matches a trainable parameter of `model`)."""
    o = cfg.optim
    cls = optimizer_class(o)
    kwargs = optimizer_kwargs(o, cls)
    try:
        cls([nn.Parameter(torch.zeros(1))], **kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        fail("optim.args", dict(o.args), f"{cls.__name__} refused them: {type(e).__name__}: {e}")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for key, patterns in (("optim.no_decay", list(o.no_decay)), ("optim.lr_scale", [p for p, _ in lr_scales(o)])):
        unused = [pat for pat in patterns if not any(matches(n, pat) for n in names)]
        if unused:
            fail(key, patterns, f"{unused} match no trainable parameter of {type(model).__name__}",
                 f"patterns over its parameter names, e.g. {names[:3]}")


def matches(name: str, pattern: str) -> bool:
    """Whether `pattern` (`*` wildcards) matches parameter `name` whole or its end after a dot."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))


def param_groups(params: list[nn.Parameter], names: dict[int, str], o: OptimConfig, decay: bool = True) -> list:
    """The optimizer's groups over `params` (model order): one per (weight decay, lr scale), Note [optimizer].

    Args:
        params: the trainable parameters this rank holds, each once.
        names: id(parameter) -> its unpartitioned name.
        decay: whether the class takes weight_decay (else groups carry no such key).
    """
    groups: dict[tuple, dict] = {}
    scales = lr_scales(o)
    for p in params:
        name = names.get(id(p), "")
        no_decay = any(matches(name, pat) for pat in o.no_decay)
        scale = next((f for pat, f in scales if matches(name, pat)), 1.0)
        group = groups.setdefault((no_decay, scale), {"params": []})
        group["params"].append(p)
        if scale != 1.0:
            group["lr"] = o.lr * scale
        if decay and no_decay:
            group["weight_decay"] = 0.0
    return list(groups.values())


def param_names(modules: list[nn.Module], canonical: dict[str, str]) -> dict[int, str]:
    """id(parameter) -> the unpartitioned name it is saved under, for every parameter of `modules` (an
    engine's state modules, whose names are the original ones)."""
    return {id(p): canonical.get(fqn, fqn) for m in modules for fqn, p in m.named_parameters()}


def build_optimizer(model: nn.Module, names: dict[int, str], o: OptimConfig,
                    sharding: StateSharding | None = None) -> torch.optim.Optimizer:
    """The configured optimizer over the trainable parameters, its state sharded when the strategy asks.

    Args:
        model: the parallelized model.
        names: id(parameter) -> unpartitioned name (`param_names`), for the groups.
        o: the optim group (its class, arguments, lr scales and weight decay exclusions).
        sharding: the engine's `state_sharding` (ZeRO 1, Note [ZeRO 1]); None: every rank keeps its
            parameters' whole state.
    """
    cls = optimizer_class(o)
    kwargs = optimizer_kwargs(o, cls)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = param_groups(params, names, o, decay="weight_decay" in kwargs)
    dtensors = {isinstance(p, DTensor) for p in params}
    if dtensors == {True, False} and "foreach" in inspect.signature(cls.__init__).parameters \
            and "foreach" not in o.args:
        # Tensor parallelism leaves plain tensors beside its DTensors (the layers its plan does not split): a
        # group holding both cannot go through one multi-tensor kernel, which CUDA would pick by default
        # ("mixed torch.Tensor and DTensor"); the CPU's default is this one-tensor-at-a-time form already.
        kwargs["foreach"] = False
    if sharding is not None:
        return ShardedOptimizer(groups, cls, kwargs, sharding)
    return cls(groups, **kwargs)


@dataclass
class StateSharding:
    """ZeRO 1: the process group a parameter's optimizer state is sharded over (the ranks that hold the same
    parameter): `group`, or its own in `own` (id(parameter) -> group; experts: their dp ranks)."""

    group: object
    own: dict[int, object] = field(default_factory=dict)

    def group_of(self, p: torch.Tensor):
        return self.own.get(id(p), self.group)


# Note [ZeRO 1]
# ShardedOptimizer keeps the optimizer state of each parameter on one rank of the ranks that hold that
# parameter (its StateSharding group). Every rank has the whole gradients (DDP or FSDP2's replicate reduced
# them); each steps the parameters it owns with its own optimizer (`.optim`, the class and groups the user
# chose), then each owner broadcasts its updated parameters in flat buffers of up to BROADCAST_BUCKET bytes
# (per owner and dtype; a larger parameter alone), so every rank ends the step with the same weights. Owners
# are picked greedily, largest parameter first, to balance the state's bytes; the order is the same on every
# rank. Buckets, not one buffer per owner: each buffer is new memory each step, and the 125M Llama's two
# 250 MB halves (gloo, two processes here, as torch.randn pieces of 5 MB) took 0.61-1.08 s a step as one
# buffer each and 0.24-0.50 s in 25 MB buckets; one bucket is all a step holds of them at a time.
# Not torch's ZeroRedundancyOptimizer: it broadcasts `param.data`, which is no plain tensor for the DTensor
# parameters of tensor parallelism and FSDP2's replicate; here the broadcast is of the local tensors (ranks of
# one group hold the same local shapes), so ZeRO 1 works wherever strategy.zero is accepted. Checkpoints,
# the memory watch and the planner read this rank's share through `.optim`, as they read
# ZeroRedundancyOptimizer's.
BROADCAST_BUCKET = 25 << 20  # bytes: DDP's default bucket (Note [ZeRO 1])


class ShardedOptimizer(torch.optim.Optimizer):
    """`cls(groups, **kwargs)` with each parameter's state on one rank of its group (Note [ZeRO 1]).

    The learning-rate schedule and checkpoints set the groups' values here (`param_groups`, every parameter);
    each step hands them to the rank's own optimizer.
    """

    def __init__(self, groups: list[dict], cls: type, kwargs: dict, sharding: StateSharding):
        super().__init__(groups, kwargs)
        load: dict[object, list[int]] = {}
        self.owned: list[tuple[torch.Tensor, object, int]] = []  # (parameter, group, owner's rank in it)
        params = [p for g in self.param_groups for p in g["params"]]
        for p in sorted(params, key=lambda t: -_local(t).numel()):  # stable: model order among equals
            group = sharding.group_of(p)
            sizes = load.setdefault(group, [0] * dist.get_world_size(group))
            owner = min(range(len(sizes)), key=sizes.__getitem__)
            sizes[owner] += _local(p).numel()
            self.owned.append((p, group, owner))
        mine = {id(p) for p, group, owner in self.owned if owner == dist.get_rank(group)}
        local = [{**{k: v for k, v in g.items() if k != "params"}, "params": [p for p in g["params"]
                                                                             if id(p) in mine]}
                 for g in self.param_groups]
        self.optim = cls(local, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update({k: v for k, v in group.items() if k != "params"})
        loss = self.optim.step(closure)
        for group in dict.fromkeys(g for _, g, _ in self.owned):  # each group in order, once
            self._broadcast(group)
        return loss

    def _broadcast(self, group) -> None:
        """Each owner's updated parameters of `group` to the group's other ranks, in flat buffers of up to
        BROADCAST_BUCKET bytes per owner and dtype, in `owned`'s order (every rank's)."""
        buckets: dict[tuple[int, torch.dtype], list[list[torch.Tensor]]] = {}
        filled: dict[tuple[int, torch.dtype], int] = {}  # bytes in each key's last bucket
        for p, g, owner in self.owned:
            if g is group:
                t = _local(p)
                key = (owner, t.dtype)
                chunks = buckets.setdefault(key, [[]])
                if chunks[-1] and filled[key] + t.nbytes > BROADCAST_BUCKET:
                    chunks.append([])
                    filled[key] = 0
                chunks[-1].append(t)
                filled[key] = filled.get(key, 0) + t.nbytes
        me, ranks = dist.get_rank(group), dist.get_process_group_ranks(group)
        for (owner, _), chunks in buckets.items():
            for tensors in chunks:
                flat = torch.cat([t.reshape(-1) for t in tensors]) if owner == me else \
                    torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
                dist.broadcast(flat, src=ranks[owner], group=group)
                if owner != me:
                    for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
                        t.copy_(piece.view_as(t))
                del flat  # before the next bucket's: one bucket held at a time


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's tensor on this rank (a DTensor's local piece)."""
    p = p.data if isinstance(p, nn.Parameter) else p
    return p.to_local() if isinstance(p, DTensor) else p


@torch.no_grad()
def param_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> dict:
    """{parameter: its optimizer state's tensors}, the state made now where the first step has not made it
    yet: a checkpoint load fills these tensors in place, and the optimizer then takes them as its own.

    The state is made as torch.distributed.checkpoint's helpers make it: one step
    with zero gradients at lr 0 (and weight decay 0), so any optimizer makes its
    own layout (AdamW: step, exp_avg, exp_avg_sq; SGD with momentum:
    momentum_buffer; SGD without: nothing) without moving a weight.
    """
    missing = [p for p in params if not optimizer.state.get(p)]
    if missing:
        saved = [{k: g[k] for k in ("lr", "weight_decay") if k in g} for g in optimizer.param_groups]
        grads = {p: p.grad for g in optimizer.param_groups for p in g["params"]}
        for g in optimizer.param_groups:
            g.update({k: 0.0 for k in ("lr", "weight_decay") if k in g})
            for p in g["params"]:
                p.grad = None
        for p in missing:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for g, values in zip(optimizer.param_groups, saved):
            g.update(values)
        for p, grad in grads.items():
            p.grad = grad
    return {p: {k: v for k, v in optimizer.state.get(p, {}).items() if torch.is_tensor(v)} for p in params}


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The global gradient norm of `model` (clipped to `max_norm` when > 0); see `clip_grads`."""
    return clip_grads([p.grad for p in model.parameters() if p.grad is not None], max_norm)


@torch.no_grad()
def clip_grads(grads: list[torch.Tensor], max_norm: float, counted: list[torch.Tensor] | None = None,
               sum_group=None) -> torch.Tensor:
    """The global gradient norm, right across every mesh dimension; grads clipped by it when max_norm > 0.

    Gradients are normed in groups: whole tensors together, DTensors by their
    mesh (FSDP shards over dp, tensor-parallel pieces over tp or over both).
    torch's norm of a DTensor group is a partial DTensor, made whole over its
    mesh here, so every rank clips by the same factor and the norm equals the
    single-device one.

    Args:
        grads: this rank's gradients.
        counted: the gradients that count toward the norm (default: `grads`);
            a pipeline leaves out the extra copies of a weight tied across stages.
        sum_group: a process group whose ranks hold different gradients (the
            pipeline stages); their squared norms are summed over it.
    """
    counted = grads if counted is None else counted
    device = grads[0].device if grads else torch.device("cpu")
    square = torch.zeros((), device=device)
    for group in _by_mesh(counted):
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        square = square + (norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2
    if sum_group is not None and dist.get_world_size(sum_group) > 1:
        dist.all_reduce(square, group=sum_group)
    norm = square.sqrt()
    if max_norm > 0:
        # torch's clip_grads_with_norm_ takes parameters (it scales their .grad), and these are the gradients
        # themselves: scale them here by the same factor, min(max_norm / (norm + 1e-6), 1).
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
    return norm


def _by_mesh(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Whole tensors in one group, DTensors in one group per mesh."""
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    return list(groups.values())


def all_sum(value: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of a scalar over a process group."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def state_shapes(cfg: Config, model: nn.Module) -> dict[str, dict[str, tuple]] | None:
    """{parameter name: {state key: shape}} of the configured optimizer over `model` (on the meta device), the
    state `param_state` makes; None when the optimizer cannot step on meta tensors (a user class)."""
    cls = optimizer_class(cfg.optim)
    kwargs = optimizer_kwargs(cfg.optim, cls)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = {id(p): n for n, p in named}
    try:
        optimizer = cls(param_groups([p for _, p in named], names, cfg.optim, "weight_decay" in kwargs), **kwargs)
        states = param_state(optimizer, [p for _, p in named])
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None
    return {n: {k: tuple(v.shape) for k, v in states[p].items()} for n, p in named}


def state_per_weight(cfg: Config) -> float:
    """How many weights' worth of state the configured optimizer keeps per weight (AdamW 2, SGD with momentum
    1, without 0), from the state it makes for a small real parameter."""
    cls = optimizer_class(cfg.optim)
    p = nn.Parameter(torch.zeros(8, 8))
    state = param_state(cls([p], **optimizer_kwargs(cfg.optim, cls)), [p])[p]
    return sum(v.numel() for v in state.values() if v.dim() > 0) / p.numel()
