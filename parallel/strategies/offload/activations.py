"""Activation offload (vDNN): saved tensors go down during forward and come back, ahead of need, in backward.

Forward produces each block's feature maps and then leaves them idle until
backward reaches that block. `pack` (a saved-tensors hook) hands each saved
tensor to the tier below and keeps only a handle; the write happens on the
tier's I/O thread, and the device copy is freed once written. `prefetch(block)`
starts reading a block's handles back; the engine calls it for the blocks
`strategy.prefetch` ahead of the one whose backward is starting, so the reads
overlap the backward of the blocks in between. A tensor saved by several ops
(the same storage, view and version) is written once, and its device copy is
dropped after its last unpack.

All activations of one step share one file, written at increasing offsets; the
offsets start over at the next step.
"""
from __future__ import annotations

import os
import time
import weakref
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import torch

from parallel.profiling import phase
from parallel.strategies.offload.tiers import Counters, aligned, finish, raw_bytes

SMALL = 4096  # bytes; smaller saved tensors stay where they are (moving them costs more than it saves)


class Handle:
    """One saved tensor on the lower tier."""

    __slots__ = ("block", "shape", "dtype", "offset", "nbytes", "written", "tensor", "pending", "packs",
                 "unpacks")

    def __init__(self, block: int, shape, dtype, offset: int, nbytes: int):
        self.block, self.shape, self.dtype, self.offset, self.nbytes = block, shape, dtype, offset, nbytes
        self.written: Future | None = None
        self.tensor: torch.Tensor | None = None
        self.pending = None
        self.packs, self.unpacks = 1, 0


class ActivationStore:
    """Saved tensors of the current step, on disk (one file) or, under a GPU, in pinned host memory.

    Args:
        path: the directory of the step file (disk), or None under a GPU with the cpu tier.
        device: the compute device.
        counters: bytes moved and time waited.
        pool: the executor that runs disk I/O.
        max_pending: writes in flight before `pack` waits for the oldest
            (bounds the memory of tensors not yet written).
    """

    def __init__(self, path: Path | None, device: torch.device, counters: Counters, pool, max_pending: int = 4):
        self.device, self.counters, self.pool = device, counters, pool
        if path is not None:
            Path(path).mkdir(parents=True, exist_ok=True)
            self.file_path = Path(path) / "activations.bin"
            self.fd = os.open(self.file_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        else:
            self.fd = None
        self.host: dict[int, torch.Tensor] = {}  # under a GPU: offset -> pinned copy
        self.max_pending = max_pending
        self.reset()

    def reset(self) -> None:
        """Forget the previous step's tensors (the file space is reused)."""
        self.tail = 0
        self.by_block: dict[int, list[Handle]] = {}
        self.seen: dict[tuple, tuple[Handle, weakref.ref]] = {}
        self.in_flight: deque[Handle] = deque()
        self.block = 0

    def pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        if nbytes < SMALL or t.device != self.device or t.layout != torch.strided:
            return t
        key = (id(t.untyped_storage()), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
               t._version)
        seen = self.seen.get(key)
        # The same tensor, still alive: once its memory is freed, another tensor
        # may be made at the same address with the same shape.
        if seen is not None and seen[1]() is not None:
            seen[0].packs += 1
            return seen[0]
        h = Handle(self.block, t.shape, t.dtype, self.tail, nbytes)
        self.tail += aligned(nbytes)
        self.seen[key] = (h, weakref.ref(t))
        self.by_block.setdefault(self.block, []).append(h)
        src = t.detach().contiguous()
        h.written = self._write(h, src)
        self.in_flight.append(h)
        while len(self.in_flight) > self.max_pending:
            old = self.in_flight.popleft()
            t0 = time.perf_counter()
            with phase("offload activations write wait"):  # in a profile (Note [profiles])
                finish(old.written)
            self.counters.add(wait_s=time.perf_counter() - t0)  # the device waits for the disk
        return h

    def unpack(self, packed):
        if not isinstance(packed, Handle):
            return packed
        h = packed
        if h.tensor is None:
            self._start_read(h)
        if h.pending is not None:  # read started here or by a prefetch: wait until it lands
            t0 = time.perf_counter()
            with phase("offload activations read wait"):
                finish(h.pending)
            self.counters.add(wait_s=time.perf_counter() - t0)
            h.pending = None
        t = h.tensor
        h.unpacks += 1
        if h.unpacks >= h.packs:
            h.tensor = None  # the last consumer has it: drop ours
        return t

    def prefetch(self, block: int) -> None:
        """Start reading back the saved tensors of `block` (called ahead of its backward)."""
        for h in self.by_block.get(block, []):
            if h.tensor is None and h.pending is None and h.unpacks < h.packs:
                self._start_read(h)

    def _write(self, h: Handle, src: torch.Tensor):
        if self.fd is None:  # pinned host memory under a GPU
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            host.copy_(src, non_blocking=True)
            self.host[h.offset] = host
            self.counters.add(written=h.nbytes)
            return None
        cpu = src if src.device.type == "cpu" else src.cpu()

        def run():
            with phase("offload activations write"):
                os.pwrite(self.fd, raw_bytes(cpu), h.offset)
            self.counters.add(written=h.nbytes)
        return self.pool.submit(run)

    def _start_read(self, h: Handle) -> None:
        # Allocated here, on the calling thread, so the memory counters see it.
        h.tensor = torch.empty(h.shape, dtype=h.dtype, device=self.device)
        finish(h.written)
        if self.fd is None:
            h.tensor.copy_(self.host.pop(h.offset), non_blocking=True)
            self.counters.add(read=h.nbytes)
            h.pending = None
            return
        dst = h.tensor if self.device.type == "cpu" else torch.empty(h.shape, dtype=h.dtype, pin_memory=True)

        def run():
            with phase("offload activations read"):
                got = os.preadv(self.fd, [raw_bytes(dst)], h.offset)
            if got != h.nbytes:
                raise OSError(f"{self.file_path}: read {got} of {h.nbytes} bytes of a saved activation")
            self.counters.add(read=h.nbytes)
        fut = self.pool.submit(run)
        if dst is not h.tensor:
            h.pending = _CopyAfter(fut, dst, h.tensor)
        else:
            h.pending = fut

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            Path(self.file_path).unlink(missing_ok=True)
        self.host.clear()


class _CopyAfter:
    """A disk read into pinned memory, then the copy to the GPU."""

    def __init__(self, fut: Future, src: torch.Tensor, dst: torch.Tensor):
        self.fut, self.src, self.dst = fut, src, dst

    def wait(self) -> None:
        self.fut.result()
        self.dst.copy_(self.src, non_blocking=True)
