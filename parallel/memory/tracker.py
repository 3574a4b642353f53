"""Peak of live tensor bytes, for devices whose allocator keeps no statistics (the CPU).

torch's MemTracker counts the same thing but also attributes memory to modules,
and refuses a module that runs twice in one step (gradient accumulation,
microbatches). The total is all the trainer needs, so this counts storages only.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from parallel.tensors import plain_tensors, rank_optimizer

# Note [storages resized in place]
# A storage's bytes change after it is made in two ways: an op that resizes
# its output or argument (`out=` ops, `resize_`, the storage-bytes resize a
# compiled FSDP makes), seen by a tracker as it dispatches, and a direct
# `UntypedStorage.resize_` (how FSDP2 frees its gathered parameters and regrows
# them, between ops, outside any dispatch). While a tracker is active the
# latter is wrapped (`_resized_in_place`) to count it. Counters keep their
# totals as storages are made and die (a weakref's callback) and reread every
# size only when the count of resizes moved since they last looked: a scan of
# every live storage per op was a fifth of a plan's time.
_RESIZES = [0]  # storages resized in place so far (the count, not which)
_ACTIVE = [0]  # trackers active: the storage method is wrapped while any is
_RESIZE = torch.UntypedStorage.resize_
_MAY_RESIZE: dict = {}  # op -> whether it can change a storage's size


def resizes() -> int:
    """How many times a storage was resized in place (Note [storages resized in place]); compare two reads."""
    return _RESIZES[0]


def _resized_in_place(storage, size):
    out = _RESIZE(storage, size)
    _RESIZES[0] += 1
    return out


@contextlib.contextmanager
def resizes_watched():
    """Within: `UntypedStorage.resize_` counted by `resizes()` (every active tracker holds this)."""
    _watch_resizes(True)
    try:
        yield
    finally:
        _watch_resizes(False)


def _watch_resizes(on: bool) -> None:
    _ACTIVE[0] += 1 if on else -1
    torch.UntypedStorage.resize_ = _resized_in_place if _ACTIVE[0] > 0 else _RESIZE
    _RESIZES[0] += 1  # resizes while nobody watched are not known: each counter rereads once


def may_resize(func) -> bool:
    """Whether op `func` can change a storage's size: it writes an `out=` argument, or it resizes."""
    known = _MAY_RESIZE.get(func)
    if known is None:
        schema = func._schema
        known = _MAY_RESIZE[func] = "resize" in schema.name or any(a.is_out for a in schema.arguments)
    return known


def counted_after(func) -> None:
    """Note that op `func` ran: if it can resize storages, every counter rereads their sizes."""
    if may_resize(func):
        _RESIZES[0] += 1


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages alive on `device_type` while active.

    Storages that exist on entry are counted when passed to :meth:`track`
    (parameters, gradients, optimizer state); every storage an op creates inside
    the context is counted while it lives, each at its current size, so storages
    that FSDP frees and regrows in place (`resize_`) count only while they hold
    memory (Note [storages resized in place]).

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
        _watch_resizes(True)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _watch_resizes(False)

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
        if self._seen != _RESIZES[0]:  # some storage was resized in place: reread every size
            self._seen = _RESIZES[0]
            total, block = 0, self.block
            for key, ref in list(self._refs.items()):
                st = ref()
                if st is not None:
                    n = self._sizes[key] = -(-st.nbytes() // block) * block
                    total += n
            self._total = total
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

