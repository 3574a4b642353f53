"""Block weights between their home on the params tier and the device buffer they are bound to
(Note [offload engine] in parallel.strategies.offload.engine).

Binding points every parameter of a block at its slot of the block's buffer;
unbinding points them at empty placeholders, so the parameter objects stay the
same for the whole run. With the params tier on the device nothing streams:
each block keeps a buffer of its own, bound for the whole run.
"""
from __future__ import annotations

import time

import torch

from parallel.profiling import phase
from parallel.strategies.offload.layout import Block
from parallel.strategies.offload.tiers import Counters, finish


class WeightStream:
    """Reads, binds and lets go of block weights.

    Args:
        tier: the params tier (None: the weights stay on the device, bound).
        device: the compute device.
        waits: where the time the compute waits on a read is added.
    """

    def __init__(self, tier, device: torch.device, waits: Counters):
        self.tier, self.device, self.waits = tier, device, waits
        self.streaming = tier is not None
        # id of a bound buffer's storage -> its block (pool buffers live for the whole run, so ids stay theirs)
        self.bound: dict[int, Block] = {}

    def fetch(self, b: Block, wait: bool = True) -> bool:
        """Start reading block `b`'s weights into a pool buffer (no-op if bound or on its way).

        Returns False when `wait` is false and its pool has no free buffer."""
        if b.buffer is not None or not self.streaming:
            return True
        buf = b.pool.take(wait=wait)
        if buf is None:
            return False
        b.buffer = buf
        b.pending = self.tier.read(b.key(), buf[:b.nbytes])
        return True

    def ensure(self, b: Block) -> None:
        """Block `b`'s weights bound and readable."""
        if not self.streaming:
            return
        self.fetch(b)
        if b.pending is not None:
            t0 = time.perf_counter()
            with phase(f"offload params wait {b.name}"):  # in a profile (Note [profiles])
                finish(b.pending)
            self.waits.add(wait_s=time.perf_counter() - t0)
            b.pending = None
        self.bind(b)

    def bind(self, b: Block) -> None:
        for s in b.slots:
            s.param.data = s.view(b.buffer)
        self.bound[id(b.buffer.untyped_storage())] = b

    def unbind(self, b: Block) -> torch.Tensor:
        """Empty `b`'s parameters and return the buffer they were bound to."""
        buf = b.buffer
        self.bound.pop(id(buf.untyped_storage()), None)
        for s in b.slots:
            s.param.data = torch.empty(0, dtype=s.dtype, device=self.device)
        b.buffer, b.pending = None, None
        return buf

    def release(self, b: Block) -> None:
        """Let `b`'s weights go: its buffer back to its pool (a no-op when not streaming)."""
        if self.streaming and b.buffer is not None:
            if b.pending is not None:
                finish(b.pending)
            b.pool.give(self.unbind(b))
