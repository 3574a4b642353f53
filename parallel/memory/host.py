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
that), and steps the same whatever happened before it: 25 faults per step there.

Blocks above 32 MiB are still mappings of their own, whatever the threshold. A worker that computes on the CPU
makes such blocks every step when its model is large: on each of 2 ranks of the 125M Llama of benchmarks/hf.py
(data zero 0), the embedding's gradient and AdamW's square roots and quotients of its two 98 MB weights, about
144-182k page faults a step. On this machine (a virtual one) a fault cost up to 17 us (24,000 in 260-400 ms), and
such an op's time moved from step to step: a square root of 98 MB took 49-340 ms inside the optimizer's step, 52
ms repeated alone. So a worker that computes on the CPU (`keep_large`) takes every block from the heap and keeps
what it frees there (mmap off, the trim threshold at its largest). Measured on that Llama, plain AdamW in 2
processes at once, the two settings alternating (steps 3-7): 0-1 faults a step, the optimizer's step 285-420 ms
against 571-795 ms, forward and backward 1.75-1.83 s against 1.86-1.92 s, peak resident memory 2721-2832 MiB
against 2753-2790. The framework's own step there (2 ranks, data zero 0, steps 7-11), the tree before and this one
alternating: 3.32, 3.41 and 3.23 s before, 2.88, 2.73 and 2.73 s after; peak resident memory 3188-3261 MiB before,
3262-3374 MiB after. The heap still grows now and then while its free space is cut up (on those ranks 98 MB at a
time, at steps 1-3 and once at step 7, 260-400 ms each): a step that grows it faults its new pages in once. Growth
stops where the holes fit: a process allocating and freeing two 40 MB tensors a round grew its heap for more than
8 rounds in one run, to 426 MB in another, for 80 MB in use. Such a process keeps the most its heap ever held
until it exits. A worker that computes on a GPU does not: its host blocks are copies the step does not repeat
(checkpoints, an export's full weights), which would then stay. Offload sets its own later
(parallel/strategies/offload/engine.py: memory it moved out must leave the process), and then gives back what the heap
already holds free (`trim_host_heap`): new thresholds only decide what happens to blocks freed after them, and
until offload takes over its worker keeps what it frees, above all the whole model rank 0 builds under
model.init=module to write its initial weights (parallel/models/weights.py). Kept, those 512 MiB of a 134M MLP
(hidden 2896, depth 16) stayed beside the pages of that file as offload read it back a block at a time: a peak
of 1,350 MiB against single's 2,504 (0.54x), 869 MiB (0.35x: the model built once) trimmed
(tests/distributed/test_offload.py, the peak RSS against single's). A process that times a plan's op calls
(parallel.planning.cost's replay, and launch/calibrate.py's measuring processes) sets the same first, so that it times them
as a worker makes them (parallel/planning/replay.py: `_touch_heap`).
"""
from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # mallopt's parameters (malloc.h)
STEADY_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its dynamic threshold stops
GLIBC_MMAP_MAX = 65536  # glibc's default for how many blocks may be mappings of their own
KEPT_TRIM_THRESHOLD = (1 << 31) - 1  # the largest trim threshold mallopt takes (an int): free space kept


def set_mmap_threshold(nbytes: int, trim: int | None = None, mapped: bool = True) -> bool:
    """glibc's mmap threshold (and trim threshold, when given) in bytes, and whether blocks above it are mappings
    of their own (`mapped`; False: every block from the heap); False where there is no glibc."""
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes))
    if trim is not None:
        ok = bool(libc.mallopt(M_TRIM_THRESHOLD, trim)) and ok
    return bool(libc.mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX if mapped else 0)) and ok


def trim_host_heap() -> bool:
    """Give the system back every whole free page the heap holds (glibc's malloc_trim: the free chunks inside
    the heap too, not only its top); False where there is no glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


def _glibc():
    """The C library when it is glibc (Linux), else None."""
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def steady_host_allocations(keep_large: bool = False) -> bool:
    """A worker's allocations kept as a long-lived process keeps them; `keep_large`: every block, however large,
    from the heap, and freed memory kept there (a worker computing on the CPU; Note [host allocations]). False
    where there is no glibc."""
    if keep_large:
        return set_mmap_threshold(STEADY_MMAP_THRESHOLD, KEPT_TRIM_THRESHOLD, mapped=False)
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
