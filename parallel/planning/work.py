"""The work of a planned step as the cost model prices it: matrix products by size, the bytes other ops move,
every op dispatched, and each collective call by kind and group size.

# Note [step work]
The planner (parallel.planning.planner) runs a rank's step under fake tensors; this
dispatch mode sees every op of it and sorts them as parallel.planning.cost prices them
(Note [cost model]):

    products   ops with a FLOP formula in torch (matrix products, batched
               ones, attention, convolutions), by size class: the cube root
               of FLOPs / 2 (the side of the square product doing that
               work), rounded to a power of two between 16 and 4096. Small
               products run far below a core's peak, so each class has its
               own measured rate; per class: calls and FLOPs.
    memory     every other op that makes or changes a tensor: the bytes it
               reads and writes (its tensor inputs, and its outputs unless
               they are views), by byte class (4 KiB to 256 MiB by 16x, the
               nearest): small ops stay in the caches; views move nothing.
    ops        every op dispatched (each costs a fixed time besides its work:
               dispatch, autograd's bookkeeping, the Python around it).
    dtensor_ops  the ops among them on DTensors (tensor parallelism's,
               FSDP2's parameters outside its hooks): each also costs
               DTensor's own dispatch (sharding propagation, wrapping).

An op on DTensors is counted as the rank runs it, on the local shards
(parallel.flops.local_call): a dispatch mode sees such an op once, with the
global shapes, and the local op that DTensor then runs is out of its sight.
    comm       each collective and point-to-point send, by (kind, the size of
               its group): calls and the bytes it is handed (its input, before
               any gather). Waits, receives and groups of one rank are left
               out: a receive's time is its sender's. DDP's all-reduces,
               which run outside the dispatch (the planner adds them from its
               buckets), are their own kind, "bucket": issued from
               backward's hooks as each bucket fills, they are not waited
               at once as tensor parallelism's all-reduces are. What DDP's
               reducer does to each gradient (scaled into its bucket, copied
               back) is counted as ops of the step, the planner running them
               on meta tensors of the gradients' shapes
               (parallel.planning.standins.DDPStandIn.copy_gradients).
    comm_groups  the same calls again by the op that made them and the
               ranks of its group (global ranks, in the group's order):
               where the group lies on the machine, and which calls are
               FSDP2's (process-group all-gathers and reduce-scatters),
               for pricing on a hardware profile (Note [collective model]
               in parallel/planning/network.py). DDP's buckets are not in
               it: their group is the data-parallel mesh.
    forward_backward  products, memory and ops again, of the ops dispatched
               in the step's forward and backward (a pipeline's schedule)
               alone, without clipping and the optimizer's step: the part of
               a pipeline stage's compute its schedule's bubble is made of
               (Note [cost model]). The planner sets `Work.phase`.

A step's work is `Work.as_dict()`: JSON, stored in plan.json per rank role.
Beside it, `Work.calls` holds each distinct op call (the op and its
arguments' shapes, strides and dtypes) with how often the step makes it:
what the cost model replays on this machine (Note [cost model]).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from parallel.flops import NOT_OPS, formula, local_call
from parallel.planning.comm import _INPUTS, _NOT_SENT, _group, _kind, ring_all_reduce_bytes

SIZES = tuple(2 ** i for i in range(4, 13))  # the product size classes: 16 .. 4096
MEMORY_SIZES = tuple(4096 * 16 ** i for i in range(5))  # the byte classes of other ops: 4 KiB .. 256 MiB


def size_class(flops: float) -> int:
    """The size class of a product doing `flops` FLOPs (Note [step work])."""
    side = (max(flops, 2.0) / 2) ** (1 / 3)
    return min(SIZES, key=lambda s: abs(math.log2(s) - math.log2(side)))


DDP_FIRST_BUCKET, DDP_BUCKET = 1 << 20, 25 << 20  # DDP's bucket sizes (torch's defaults)


BUCKET = "bucket"  # the kind of DDP's bucket all-reduces (Note [step work])


def ddp_calls(nbytes: int) -> int:
    """All-reduce calls of DDP's buckets for `nbytes` of gradients: a small first bucket, then 25 MiB ones."""
    return 1 + max(0, -(-(nbytes - DDP_FIRST_BUCKET) // DDP_BUCKET))


def byte_class(nbytes: int) -> int:
    """The byte class of an op moving `nbytes` (Note [step work])."""
    return min(MEMORY_SIZES, key=lambda s: abs(math.log2(s) - math.log2(max(nbytes, 1))))


def spec(value):
    """A hashable description of an op's argument from which parallel.planning.cost makes a real one: a tensor's
    shape, strides, offset and dtype; sequences and dicts item by item; a generator as None."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(spec(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, spec(v)) for k, v in value.items()))
    if isinstance(value, torch.Generator):
        return ("generator",)
    return ("value", value)


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _tally(products: dict, memory: dict, flops: int, moved: int) -> None:
    """One op into its product size class (by FLOPs) or its byte class (by bytes moved; a view moves none)."""
    if flops:
        row = products.setdefault(size_class(flops), [0, 0])
        row[0] += 1
        row[1] += flops
    elif moved:
        row = memory.setdefault(byte_class(moved), [0, 0])
        row[0] += 1
        row[1] += moved


class Work(TorchDispatchMode):
    """The work of the ops dispatched while active, sorted as Note [step work] says."""

    def __init__(self):
        super().__init__()
        self.products: dict[int, list[int]] = {}  # size class -> [calls, FLOPs]
        self.memory: dict[int, list[int]] = {}  # byte class -> [calls, bytes]
        self.ops = 0
        self.dtensor_ops = 0  # ops on DTensors: each also costs DTensor's dispatch (sharding propagation)
        self.phase = "forward"  # the step's phase ("forward": forward and backward), set by the planner
        # the same tallies of the forward and backward alone (Note [step work]): products, memory, ops
        self.forward_backward: tuple[dict, dict, list[int]] = ({}, {}, [0])
        self.comm: dict[tuple[str, int], list[int]] = {}  # (kind, group size) -> [calls, bytes handed]
        self.groups: dict[tuple[str, str, int, tuple], list[int]] = {}  # (kind, op, size, ranks) -> the same
        # (op, its arguments' specs) -> [calls, FLOPs of one call, bytes of one]: what parallel.planning.cost replays
        self.calls: dict[tuple, list[int]] = {}
        # (op, FLOPs, bytes moved) of each op outside forward and backward, in order: clipping's and the
        # optimizer's, per parameter or (foreach) over every one (Note [planning by depth])
        self.tail: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional"):
            self._collective(func, args, kwargs)
        elif func.namespace not in NOT_OPS:
            self._op(func, *local_call(args, kwargs, result))
        return result

    def _op(self, func, args, kwargs, out, distributed: bool) -> None:
        self.dtensor_ops += distributed
        f = formula(func)
        flops = f(*args, **kwargs, out_val=out) if f is not None else 0
        # an in-place op writes what it read (its output is one of its inputs): counted again
        moved = 0 if flops or func.is_view else _nbytes(_tensors((args, kwargs))) + _nbytes(_tensors(out))
        self.ops += 1
        _tally(self.products, self.memory, flops, moved)
        if self.phase == "forward":
            products, memory, ops = self.forward_backward
            ops[0] += 1
            _tally(products, memory, flops, moved)
        elif flops or moved:
            self.tail.append((func.__name__, flops, moved))
        try:
            key = (func, spec(args), spec(kwargs))
            hash(key)
        except TypeError:  # an argument that cannot be replayed: priced by its class only
            return
        row = self.calls.setdefault(key, [0, flops, moved])
        row[0] += 1

    def _collective(self, func, args, kwargs) -> None:
        kind = _kind(func)
        if kind in _NOT_SENT:
            return
        bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        try:
            group = _group(bound)
            size = group.size()
        except (KeyError, RuntimeError, ValueError):  # an op without a group: sized as a pair
            group, size = None, 2
        if size <= 1:
            return
        handed = sum(_nbytes(_tensors(bound[name])) for name in _INPUTS if name in bound)
        self.add_comm(kind, size, 1, handed)
        try:
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        except (KeyError, RuntimeError, ValueError):  # a group the process does not know: placed by its size
            ranks = ()
        row = self.groups.setdefault((kind, func._schema.name, size, ranks), [0, 0])
        row[0] += 1
        row[1] += handed

    def add_comm(self, kind: str, size: int, calls: int, nbytes: int) -> None:
        """Collective calls made outside the dispatch (DDP's bucket all-reduces, which the planner adds)."""
        row = self.comm.setdefault((kind, size), [0, 0])
        row[0] += calls
        row[1] += nbytes

    def raw(self) -> dict:
        """The counts as tallied (of every step counted): what a plan extended by depth is rebuilt from."""
        products, memory, ops = self.forward_backward
        return {"forward_backward": [{k: list(v) for k, v in products.items()}, {k: list(v) for k, v in memory.items()},
                                     ops[0]],
                "tail": list(self.tail), "ops": self.ops, "dtensor_ops": self.dtensor_ops,
                "comm": {k: list(v) for k, v in self.comm.items()}, "groups": {k: list(v) for k, v in self.groups.items()}}

    @classmethod
    def of_raw(cls, raw: dict) -> "Work":
        """A Work holding `raw`'s counts (Work.raw), its tail's ops tallied into their classes."""
        w = cls()
        products, memory, ops = raw["forward_backward"]
        w.forward_backward = ({k: list(v) for k, v in products.items()}, {k: list(v) for k, v in memory.items()},
                              [ops])
        w.products, w.memory = {k: list(v) for k, v in products.items()}, {k: list(v) for k, v in memory.items()}
        for _, flops, moved in raw["tail"]:
            _tally(w.products, w.memory, flops, moved)
        w.ops, w.dtensor_ops, w.tail = raw["ops"], raw["dtensor_ops"], list(raw["tail"])
        w.comm = {k: list(v) for k, v in raw["comm"].items()}
        w.groups = {k: list(v) for k, v in raw["groups"].items()}
        return w

    def as_dict(self, steps: int = 1) -> dict:
        """The work of one step, of the `steps` counted (JSON: string keys)."""
        def per_step(rows: dict) -> dict:
            return {str(s): [c // steps, n // steps] for s, (c, n) in sorted(rows.items())}

        products, memory, ops = self.forward_backward
        return {"products": per_step(self.products), "memory": per_step(self.memory),
                "ops": self.ops // steps, "dtensor_ops": self.dtensor_ops // steps,
                "forward_backward": {"products": per_step(products), "memory": per_step(memory),
                                     "ops": ops[0] // steps},
                "comm": {f"{k}/{w}": [c // steps, b // steps] for (k, w), (c, b) in sorted(self.comm.items())},
                "comm_groups": [{"kind": k, "op": op, "size": w, "ranks": list(ranks), "calls": c // steps,
                                 "bytes": b // steps} for (k, op, w, ranks), (c, b) in sorted(self.groups.items())]}


def step_work_of(work: Work, buckets) -> dict:
    """A step's work (the mean of the two planned) with DDP's bucket all-reduces, one step's: issued from
    backward's hooks. `buckets`: (bytes, group size) per replicated model (DDPStandIn.buckets)."""
    step_work = work.as_dict(steps=2)
    for nbytes, world in buckets:
        row = step_work["comm"].setdefault(f"{BUCKET}/{world}", [0, 0])
        row[0] += ddp_calls(nbytes)
        row[1] += nbytes
    return step_work


def comm_bytes_of(sent: int, buckets) -> int:
    """What a step sends: its collectives' (`sent`, Note [comm bytes]) and DDP's bucket all-reduces'."""
    return sent + sum(ring_all_reduce_bytes(b, w) for b, w in buckets)
