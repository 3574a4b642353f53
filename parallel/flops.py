"""Counting FLOPs by torch's own per-op formulas (torch.utils.flop_counter), for the planner, strategy=auto's
cost model and the logged MFU (parallel.throughput), so all three count alike."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


class Flops(TorchDispatchMode):
    """FLOPs of the ops run while active, by torch's own per-op formulas (torch.utils.flop_counter), and
    how many ops ran. FlopCounterMode itself also attributes FLOPs to modules through autograd hooks on their
    outputs, and those hooks keep tensors alive in checkpointed blocks: they would change the memory being
    planned (and they cost time)."""

    def __init__(self):
        super().__init__()
        self.total = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out
