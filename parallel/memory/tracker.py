"""Peak of live tensor bytes, for devices whose allocator keeps no statistics (the CPU).

torch's MemTracker counts the same thing but also attributes memory to modules,
and refuses a module that runs twice in one step (gradient accumulation,
microbatches). The total is all the trainer needs, so this counts storages only.
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from parallel.tensors import plain_tensors, rank_optimizer


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages alive on `device_type` while active.

    Storages that exist on entry are counted when passed to :meth:`track`
    (parameters, gradients, optimizer state); every storage an op creates inside
    the context is counted while it lives. The total is re-read from the live
    storages after each op, at their current size, so storages that FSDP frees
    and regrows in place (`resize_`) count only while they hold memory. That is
    linear in the number of live storages per op: fine for the few steps the
    trainer watches, and exact by construction.

    `block`: each storage counts as its bytes rounded up to a multiple of it (1: as they are; the planner's
    CUDA plans pass the caching allocator's 512, Note [planning for CUDA] in parallel/planning/cuda.py).
    """

    def __init__(self, device_type: str = "cpu", block: int = 1):
        super().__init__()
        self.device_type = device_type
        self.block = block
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def size(self, storage) -> int:
        """The bytes `storage` counts for: its size, rounded up to a multiple of `block`."""
        return -(-storage.nbytes() // self.block) * self.block

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count already-existing tensors (each storage once)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for p in plain_tensors(t):
                    self._add(p)
        self._update()

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type or t.is_meta:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # a tensor without storage (e.g. a sparse or nested wrapper)
        ref = self._refs.get(id(st))
        if ref is None or ref() is not st:
            self._refs[id(st)] = weakref.ref(st)

    @property
    def current(self) -> int:
        total, dead, block = 0, [], self.block
        for key, ref in self._refs.items():
            st = ref()
            if st is None:
                dead.append(key)
            else:
                total += -(-st.nbytes() // block) * block  # self.size, inline: this runs after every op
        for key in dead:
            del self._refs[key]
        return total

    def _update(self) -> None:
        self.peak = max(self.peak, self.current)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile skips (runs eagerly, and stops trying to compile) a frame that starts under a dispatch
        # mode, unless the mode says this: then the compiled blocks (trainer.compile) run compiled in a
        # watched step, and the mode sees the buffers their code allocates rather than each fused op.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for p in plain_tensors(t):
                    self._add(p)
        self._update()
        return out


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors a training step starts with: parameters, buffers, gradients, optimizer state."""
    out = list(model.parameters()) + list(model.buffers())
    out += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        inner = rank_optimizer(optimizer)  # ZeRO 1's own optimizer of this rank's state
        if inner is not optimizer:
            for state in inner.state.values():
                out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out

