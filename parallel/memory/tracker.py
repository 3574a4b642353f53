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

from parallel.resizes import counted_after, resizes, watch_resizes
from parallel.tensors import plain_tensors, rank_optimizer


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages alive on `device_type` while active.

    Storages that exist on entry are counted when passed to :meth:`track`
    (parameters, gradients, optimizer state); every storage an op creates inside
    the context is counted while it lives, each at its current size, so storages
    that FSDP frees and regrows in place (`resize_`) count only while they hold
    memory (Note [storages resized in place] in parallel/resizes.py).

    `block`: each storage counts as its bytes rounded up to a multiple of it (1: as they are; the planner's
    CUDA plans pass the caching allocator's 512, Note [planning for CUDA] in parallel/planning/cuda.py).
    """

    def __init__(self, device_type: str = "cpu", block: int = 1):
        super().__init__()
        self.device_type = device_type
        self.block = block
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        self._sizes: dict[int, int] = {}  # id(storage) -> the bytes it counts for, as last read
        self._total = 0
        self._seen = -1  # resizes() when the sizes were last read

    def __enter__(self):
        watch_resizes(True)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            watch_resizes(False)

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
        # the device alone: `t.is_meta` of a fake tensor dispatches an op (prim.device) through every active mode
        if t.device.type != self.device_type:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # a tensor without storage (e.g. a sparse or nested wrapper)
        key = id(st)
        ref = self._refs.get(key)
        if ref is not None and ref() is st:
            return
        if ref is not None:  # a dead storage's id, its callback not run yet
            self._total -= self._sizes.pop(key, 0)
        self._refs[key] = weakref.ref(st, lambda r, key=key: self._gone(key, r))
        n = self._sizes[key] = self.size(st)
        self._total += n

    def _gone(self, key: int, ref: weakref.ref) -> None:
        if self._refs.get(key) is ref:
            del self._refs[key]
            self._total -= self._sizes.pop(key, 0)

    @property
    def current(self) -> int:
        if self._seen != resizes():  # some storage was resized in place: reread every size
            self._seen = resizes()
            block = self.block
            for key, ref in list(self._refs.items()):
                st = ref()
                if st is not None and key in self._sizes:
                    self._sizes[key] = -(-st.nbytes() // block) * block
            st = None  # a storage that died meanwhile left _sizes by its callback: the sum is of the live ones
            self._total = sum(self._sizes.values())
        return self._total

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
        counted_after(func)
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

