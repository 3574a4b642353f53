"""The device buffers offloaded blocks are read into (Note [offload engine] in parallel.strategies.offload.engine)."""
from __future__ import annotations

import threading

import torch


class BufferPool:
    """`capacity` flat byte buffers of one size, reused.

    All of them are allocated at the start: the device memory the engine
    holds is then the same from the first step on, whatever the timing of the
    transfers (made on demand, the count would depend on how long writes keep
    buffers busy), so a run that does not fit fails at once, and the planner's
    prediction (parallel.planning.planner) is what the run holds.
    """

    def __init__(self, nbytes: int, device: torch.device, capacity: int):
        self.nbytes, self.device, self.capacity = nbytes, device, capacity
        self.cond = threading.Condition()
        self.all = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(capacity)]
        self.free: list[torch.Tensor] = list(self.all)

    def take(self, wait: bool = True) -> torch.Tensor | None:
        """A free buffer; waits for one to be given back, or returns None when `wait` is false."""
        with self.cond:
            while not self.free:
                if not wait:
                    return None
                self.cond.wait()
            return self.free.pop()

    def take_spare(self, n: int, reserve: int) -> list[torch.Tensor] | None:
        """`n` free buffers at once, or None when taking them would leave fewer than `reserve` free (what
        reads ahead takes must not starve the step in flight)."""
        with self.cond:
            if len(self.free) < n + reserve:
                return None
            return [self.free.pop() for _ in range(n)]

    def give(self, buf: torch.Tensor) -> None:
        with self.cond:
            self.free.append(buf)
            self.cond.notify()
