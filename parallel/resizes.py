"""How many times a tensor storage was resized in place, for the counters of live bytes (parallel.memory.tracker,
parallel.planning.allocator): Note [storages resized in place]."""
from __future__ import annotations

import contextlib

import torch

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
RESIZES = [0]  # storages resized in place so far (the count, not which)
_ACTIVE = [0]  # trackers active: the storage method is wrapped while any is
_RESIZE = torch.UntypedStorage.resize_
_MAY_RESIZE: dict = {}  # op -> whether it can change a storage's size


def resizes() -> int:
    """How many times a storage was resized in place (Note [storages resized in place]); compare two reads."""
    return RESIZES[0]


def _resized_in_place(storage, size):
    out = _RESIZE(storage, size)
    RESIZES[0] += 1
    return out


@contextlib.contextmanager
def resizes_watched():
    """Within: `UntypedStorage.resize_` counted by `resizes()` (every active tracker holds this)."""
    watch_resizes(True)
    try:
        yield
    finally:
        watch_resizes(False)


def watch_resizes(on: bool) -> None:
    _ACTIVE[0] += 1 if on else -1
    torch.UntypedStorage.resize_ = _resized_in_place if _ACTIVE[0] > 0 else _RESIZE
    RESIZES[0] += 1  # resizes while nobody watched are not known: each counter rereads once


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
        RESIZES[0] += 1
