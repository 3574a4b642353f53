"""The host's allocator: glibc's mmap and trim thresholds set once per worker, so that a step's tensors stay in the
process from step to step as in a long-lived plain PyTorch process (Linux with glibc only; elsewhere nothing).

# Note [host allocations]
glibc gives memory back to the system in two ways: a block above its mmap threshold (128 KiB when a process
starts) is a mapping of its own, unmapped when freed, and free space at the top of the heap beyond its trim
threshold (128 KiB at start) is returned when a block there is freed. Either way the next step's tensors fault
their pages in again, a fault per 4 KiB: a step whose activations come and go pays for them every time. Both
thresholds move: freeing a mapped block larger than the mmap threshold (up to 32 MiB) raises it to that size,
and the trim threshold to twice that. A plain training loop has usually freed such a block before it trains
(building its model in full, DDP's buckets); a framework's worker, which builds the model on the meta
device, may not have. The same data-parallel step of an MLP of hidden 512 took 416 page faults on the
framework's two ranks against the hand-written loop's 104, and 2-5% more time (benchmarks/overhead.py, issue
31); how many a plain loop takes depends on what it happened to free (904 in another run). So each worker sets
both thresholds where a process that freed a large block has them, at glibc's upper bound (32 MiB, and twice
that), and steps the same whatever happened before it: 25 faults per step there. Offload sets its own later
(parallel/offload/engine.py: memory it moved out must leave the process). A process that times a plan's op
calls (parallel.cost's replay, and launch/calibrate.py's measuring processes) sets the same first, so that
it times them as a worker makes them (parallel/replay.py: `_touch_heap`).
"""
from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
STEADY_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its dynamic threshold stops


def set_mmap_threshold(nbytes: int, trim: int | None = None) -> bool:
    """glibc's mmap threshold (and trim threshold, when given) in bytes; False where there is no glibc."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes))
    if trim is not None:
        ok = bool(libc.mallopt(M_TRIM_THRESHOLD, trim)) and ok
    return ok


def steady_host_allocations() -> bool:
    """A worker's allocations kept as a long-lived process keeps them (Note [host allocations]); False where there
    is no glibc."""
    return set_mmap_threshold(STEADY_MMAP_THRESHOLD, 2 * STEADY_MMAP_THRESHOLD)


def available_host_memory() -> int | None:
    """Bytes of memory the host can give a new allocation without swapping (Linux's MemAvailable); None where
    it cannot say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
