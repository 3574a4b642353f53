"""Where offloaded bytes live: the tiers below the compute device.

    device  nothing moves: the tensors stay in device memory.
    cpu     host memory. Under a GPU: pinned buffers, copies on side streams
            (one each way) so they overlap compute and each other. On a
            CPU-only machine the CPU *is* the device, so `cpu` means `device`
            there.
    disk    one file per key under strategy.path, read with plain reads into
            reused buffers (never memory-mapped: resident pages of a mapping
            would count as memory that was supposed to be offloaded), on
            background I/O threads.

A tier moves whole flat byte buffers (`write(key, src)`, `read(key, dst)`) and
returns something with `.wait()`; callers keep `src` untouched until then.
"""
from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import Executor, Future
from pathlib import Path

import torch

from parallel.profiling import phase
from parallel.units import human_bytes

TIERS = ("device", "cpu", "disk", "auto")
ALIGN = 64  # bytes; every slot of a flat buffer starts at a multiple of it, so each view of a buffer is aligned


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def below(device: torch.device) -> str:
    """The tier directly below the compute device (what `auto` means)."""
    return "cpu" if device.type == "cuda" else "disk"


def effective(tier: str, device: torch.device) -> str:
    """`auto` resolved; `cpu` on a CPU device is the device itself."""
    if tier == "auto":
        tier = below(device)
    if tier == "cpu" and device.type == "cpu":
        return "device"
    return tier


def finish(pending) -> None:
    """Wait for what a tier's `read` or `write` returned (re-raising its error)."""
    if isinstance(pending, Future):
        pending.result()
    elif pending is not None:
        pending.wait()


def settle(pending) -> None:
    """Wait on the host until what a tier's `read` or `write` returned is done (`finish` only orders the
    caller's stream after a GPU copy): the buffer may then go to any stream."""
    if isinstance(pending, _Event):
        pending.event.synchronize()
    else:
        finish(pending)


class Counters:
    """Bytes moved and time waited, shared by the tiers of one engine (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.read = 0
        self.written = 0
        self.wait_s = 0.0

    def add(self, read: int = 0, written: int = 0, wait_s: float = 0.0) -> None:
        with self._lock:
            self.read += read
            self.written += written
            self.wait_s += wait_s

    def take(self) -> tuple[int, int, float]:
        with self._lock:
            out = (self.read, self.written, self.wait_s)
            self.read, self.written, self.wait_s = 0, 0, 0.0
        return out


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class DiskTier:
    """Files under `path`, one per key; reads and writes run on `io`, the engine's I/O threads.

    Args:
        path: a directory (created; removed by `close` when this tier created it).
        counters: where bytes moved are added.
        io: the executor that runs the transfers (shut down by its owner).
    """

    name = "disk"

    def __init__(self, path: Path, counters: Counters, io: Executor):
        self.path = Path(path)
        self._created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        self.counters = counters
        self.pool = io

    def _file(self, key: str) -> Path:
        return self.path / f"{key}.bin"

    def write(self, key: str, src: torch.Tensor) -> Future:
        """Copy the bytes of `src` (contiguous, CPU) to the start of the file of `key`; bytes of the file past
        them stay (a block's step writes back its trainable leading range only)."""
        def run():
            path = self._file(key)
            mode = "r+b" if path.exists() else "wb"
            with phase(f"offload {self.path.name} write {key}"), open(path, mode, buffering=0) as f:
                f.write(raw_bytes(src))
            self.counters.add(written=src.numel() * src.element_size())
        return self.pool.submit(run)

    def read(self, key: str, dst: torch.Tensor) -> Future:
        """Fill `dst` (contiguous, CPU) from the file of `key`."""
        def run():
            n = dst.numel() * dst.element_size()
            with phase(f"offload {self.path.name} read {key}"), open(self._file(key), "rb", buffering=0) as f:
                got = f.readinto(raw_bytes(dst))
            if got != n:
                raise OSError(f"{self._file(key)}: read {got} of {n} bytes (the file was truncated)")
            self.counters.add(read=n)
        return self.pool.submit(run)

    def close(self) -> None:
        if self._created:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            for f in self.path.glob("*.bin"):
                f.unlink(missing_ok=True)


class HostTier:
    """Pinned host buffers under a GPU; copies on side streams (CUDA only).

    Reads (host to device) and writes (device to host) go on streams of their
    own, so the two directions run at once (a GPU copies both ways together)
    and neither queues behind the other: a block's new weights and moments
    going out while the next block's weights come in. A read returns an event
    the compute stream waits on, so the copy overlaps whatever the compute
    stream is doing until the data is needed. Every write is waited for
    (`finish`) before its key is read again, so a read never overtakes the
    write it depends on.
    """

    name = "cpu"

    def __init__(self, device: torch.device, counters: Counters):
        self.device = device
        self.counters = counters
        self.reads = torch.cuda.Stream(device)
        self.writes = torch.cuda.Stream(device)
        self.host: dict[str, torch.Tensor] = {}

    def write(self, key: str, src: torch.Tensor) -> "_Event":
        """Copy `src` (flat bytes) to the start of the host buffer of `key` (made at the first write); bytes
        past them stay, as on the disk tier. The copy follows the work queued so far on the caller's stream."""
        host = self.host.get(key)
        if host is None:
            host = self.host[key] = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        self.writes.wait_stream(torch.cuda.current_stream(self.device))
        with phase(f"offload cpu write {key}"), torch.cuda.stream(self.writes):
            host[:src.numel()].copy_(src, non_blocking=True)
            src.record_stream(self.writes)
        self.counters.add(written=src.numel() * src.element_size())
        return _Event(self.writes, sync=True)

    def read(self, key: str, dst: torch.Tensor) -> "_Event":
        """Fill `dst` from the host buffer of `key` once the work queued so far on the caller's stream (which
        may still use `dst`) is done."""
        self.reads.wait_stream(torch.cuda.current_stream(self.device))
        with phase(f"offload cpu read {key}"), torch.cuda.stream(self.reads):
            dst.copy_(self.host[key], non_blocking=True)
            dst.record_stream(self.reads)
        self.counters.add(read=dst.numel() * dst.element_size())
        return _Event(self.reads, sync=False)

    def close(self) -> None:
        self.host.clear()


class _Event:
    """A copy on a side stream: `wait` makes the compute stream (or, for writes, the host) wait for it."""

    def __init__(self, stream, sync: bool):
        self.event = torch.cuda.Event()
        self.event.record(stream)
        self.sync = sync

    def wait(self) -> None:
        if self.sync:
            self.event.synchronize()  # the source may be reused once this returns
        else:
            torch.cuda.current_stream().wait_event(self.event)


def check_disk(path: Path, needed: int) -> str | None:
    """Why `path` cannot hold `needed` bytes (not writable, too little space), or None."""
    path = Path(path)
    probe_dir = path
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        return f"{probe_dir} is not a directory"
    if not os.access(probe_dir, os.W_OK):
        return f"{probe_dir} is not writable"
    free = shutil.disk_usage(probe_dir).free
    if free < needed:
        return f"{human_bytes(needed)} needed, {human_bytes(free)} free at {probe_dir}"
    return None

