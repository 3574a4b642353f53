"""Counting FLOPs by torch's own per-op formulas (torch.utils.flop_counter), for the planner, strategy=auto's
cost model and the logged MFU (parallel.throughput), so all three count alike; plus the CPU's own attention
kernels, which torch's table leaves out (`formula`)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = None

aten = torch.ops.aten


def _attention(query, key, value, *args, out_val=None, **kwargs) -> int:
    """An attention forward: the scores (query x key) and their product with the values, over the query's
    heads (grouped key/value heads are broadcast to them); causal masking not subtracted, as torch counts."""
    b, h, s_q, d = query.shape
    s_k, d_v = key.shape[-2], value.shape[-1]
    return 2 * b * h * s_q * s_k * (d + d_v)


def _attention_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    """An attention backward: the scores again, then the gradients of the scores, the values, the queries
    and the keys (three products of the query's width, two of the values')."""
    b, h, s_q, d = query.shape
    s_k, d_v = key.shape[-2], value.shape[-1]
    return 2 * b * h * s_q * s_k * (3 * d + 2 * d_v)


# torch's table has formulas for the CUDA attention kernels (flash, efficient, cuDNN) only; on the CPU
# scaled_dot_product_attention runs these, which would count as no FLOPs (and a CUDA run planned on the CPU
# records them: Note [step work] in parallel/planning/work.py). The same products as torch's formula for the flash
# kernel, written here for any head grouping (torch 2.11's own refuses grouped key/value heads).
_CPU_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu: _attention,
                  aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward}


def _grouped_mm(mat_a, mat_b, *args, out_val=None, **kwargs) -> int:
    """A grouped matrix product (a mixture-of-experts layer's experts, Note [grouped matmul on fake tensors] in
    parallel/torch_patches.py): every output element one product over the contraction, which is mat_a's last
    dimension, split over the groups when both operands are 2D (the weight gradient, G outputs). Rows past the
    last offset (none in transformers' use) counted too."""
    products = out_val.numel() * mat_a.shape[-1]
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        products //= out_val.shape[0]
    return 2 * products


# Ops torch's table leaves out (torch 2.11-2.15): the CPU's attention kernels and the grouped product.
_EXTRA = {**_CPU_ATTENTION, aten._grouped_mm: _grouped_mm}
# Dispatched but no operator of the step: a fake tensor's device query (autograd's engine and many ops ask it of a
# tensor subclass; of a real tensor nothing is dispatched), a profiler's range.
NOT_OPS = ("prim", "profiler")


def formula(func):
    """The FLOP formula of `func`'s op, called as `f(*args, **kwargs, out_val=out)`; None for an op without
    products."""
    packet = func._overloadpacket
    return flop_registry.get(packet) or _EXTRA.get(packet)


def local_call(args, kwargs, out):
    """(args, kwargs, out, distributed) of an op as a rank computes it: DTensors replaced by their local
    shards, `distributed` true when there were any.

    A dispatch mode sees a DTensor op once, with the global shapes (it runs before the DTensor's own dispatch,
    and the local op that dispatch makes runs with the mode popped): counted as it is, a tensor-parallel rank
    would be charged the whole product. The local shards are what that rank's op reads and writes where the
    operands already have the layout the op's sharding needs, as a tensor-parallel plan arranges (an input
    that is redistributed first is counted in the layout it arrived in)."""
    if DTensor is None or not any(isinstance(t, DTensor) for t in tree_flatten((args, kwargs, out))[0]):
        return args, kwargs, out, False
    local = (lambda t: t._local_tensor if isinstance(t, DTensor) else t)
    return tree_map(local, args), tree_map(local, kwargs), tree_map(local, out), True


class Flops(TorchDispatchMode):
    """FLOPs of the ops run while active, by torch's own per-op formulas (torch.utils.flop_counter, and
    `formula`'s for the CPU's attention), and how many ops ran. FlopCounterMode itself also attributes FLOPs to
    modules through autograd hooks on their outputs, and those hooks keep tensors alive in checkpointed blocks:
    they would change the memory being planned (and they cost time). `ops` leaves out what is dispatched but
    runs no operator (NOT_OPS)."""

    def __init__(self):
        super().__init__()
        self.total = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += func.namespace not in NOT_OPS
        f = formula(func)
        if f is not None:
            a, k, o, _ = local_call(args, kwargs, out)
            self.total += f(*a, **k, out_val=o)
        return out
