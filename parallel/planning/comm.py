"""The bytes a planned step sends: every collective and send it hands to c10d, counted as what leaves the rank.

# Note [comm bytes]
strategy=auto ranks candidates partly by the bytes their step communicates
(Note [auto] in parallel/planning/auto.py), so every kind of exchange must be counted
alike: as the bytes that leave the rank under the usual ring algorithms, W
the size of the op's own process group (the fake groups of a plan have
sizes), S the op's input (the data it is handed, before any gather):

    all-reduce       2 (W - 1) / W x S   (a reduce-scatter, then an all-gather)
    all-gather       (W - 1) x S         (= (W - 1) / W x its output)
    reduce-scatter   (W - 1) / W x S
    all-to-all       S less the rank's own split, which stays
    broadcast, send  S (a send is point to point: the pipeline's; a
                     broadcast passed along a chain of the ranks takes as
                     long as sending it once, whichever rank is the root)
    the rest         S (barriers, a few bytes; and ops no built-in strategy
                     makes, which are not sized: gather, scatter, reduce,
                     the all-to-all of tensor lists, batched point-to-point)

Receives and waits send nothing, nor does a group of one rank (W = 1 gives
0). The built-in strategies make: all-reduces (DDP's buckets, which the
planner adds itself, Note [planner]; the loss's token count; tensor
parallelism's partial sums; context parallelism's key and value gradients;
FSDP2's replicate; hybrid sharding's gradient shards across the replicas,
over a group of dp_replicate ranks: Note [hybrid sharding] in
parallel/dims.py), all-gathers and reduce-scatters (FSDP2, tensor
parallelism, context parallelism's keys and values), all-to-alls (expert
parallelism), broadcasts (ZeRO-1's parameters after the step) and sends
(the pipeline's). The ops are matched by name with underscores dropped, so the
process-group ops (c10d, `allreduce_`, `_allgather_base_`) and the functional
ones (`_c10d_functional`, `all_reduce`, `all_gather_into_tensor`, their
in-place, `_out` and coalesced forms) follow one rule each.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# The arguments that hold what an op is handed (its schema's names, c10d's and the functional ones').
_INPUTS = ("tensors", "input", "inputs", "input_tensor", "input_tensors", "input_list", "tensor")

# Bytes that leave the rank, from the input's bytes S and the group's size W (Note [comm bytes]).
_RING = {
    "allreduce": lambda s, w: 2 * (w - 1) * s // w,
    "allgather": lambda s, w: (w - 1) * s,
    "reducescatter": lambda s, w: (w - 1) * s // w,
}
_NOT_SENT = ("recv", "irecv", "waittensor", "checkfornan", "wraptensorautograd")


def ring_all_reduce_bytes(size: int, world: int) -> int:
    """What an all-reduce of `size` bytes over `world` ranks sends from each (Note [comm bytes])."""
    return _RING["allreduce"](size, world)


class CommBytes(TorchDispatchMode):
    """The bytes the collectives and sends dispatched while active send from this rank (Note [comm bytes]);
    `all_to_all`: the all-to-alls' part (expert parallelism, Note [auto])."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.all_to_all = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            sent = _all_to_all_sent(func, args)
            if sent is not None:
                self.all_to_all += sent
            else:
                sent = _sent(func, args, kwargs or {})
            self.bytes += sent
        return func(*args, **(kwargs or {}))


def _kind(func) -> str:
    """The op's collective, its name without underscores and forms: `_allgather_base_` and
    `all_gather_into_tensor_coalesced` are both "allgather"."""
    name = func._schema.name.split("::")[-1].replace("_", "")
    for kind in (*_RING, *_NOT_SENT):
        if name.startswith(kind):
            return kind
    return name


def _sent(func, args, kwargs) -> int:
    """The bytes any c10d op but an all-to-all sends from this rank (Note [comm bytes])."""
    kind = _kind(func)
    if kind in _NOT_SENT:
        return 0
    bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    size = sum(t.numel() * t.element_size() for name in _INPUTS if name in bound
               for t in tree_flatten(bound[name])[0] if isinstance(t, torch.Tensor))
    if kind not in _RING:  # broadcast, send, barrier, and ops no strategy makes: what they are handed
        return size
    return _RING[kind](size, _group(bound).size())


def _group(bound: dict):
    """The process group an op runs on: a c10d op is handed it, a functional one names it."""
    if "process_group" in bound:
        return dist.ProcessGroup.unbox(bound["process_group"])
    return _resolve_process_group(bound["group_name"])


def _all_to_all_sent(func, args) -> int | None:
    """The bytes an all-to-all of one tensor sends to the other ranks of its group: its input less this rank's
    own split, which stays (None for any other op)."""
    if func.overloadpacket is torch.ops._c10d_functional.all_to_all_single:  # names its group: torch's lookup
        x, splits, group = args[0], args[2], _resolve_process_group(args[3])
    elif func.overloadpacket is torch.ops.c10d.alltoall_base_:
        x, group, splits = args[1], dist.ProcessGroup.unbox(args[2]), args[4]
    else:
        return None
    total = x.numel() * x.element_size()
    if not splits:  # equal splits
        return total - total // group.size()
    return total - total * int(splits[group.rank()]) // max(1, sum(map(int, splits)))
