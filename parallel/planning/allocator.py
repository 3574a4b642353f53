"""What torch.cuda.max_memory_reserved reports for a planned step: PyTorch's CUDA caching allocator, simulated.

# Note [caching allocator]
A CUDA plan's `total` is what torch.cuda.max_memory_allocated counts (Note
[planning for CUDA] in parallel/planning/cuda.py). What the GPU must hold is
more: the caching allocator asks CUDA for segments, hands out blocks of them,
and keeps freed blocks cached for later requests; max_memory_reserved counts
the segments, the free parts included. How much more depends on the order of
the step's requests and frees, so the plan replays them, in order, through a
model of the allocator of c10/cuda/CUDACachingAllocator.cpp (torch 2.11-2.15,
one device, one stream, no PYTORCH_CUDA_ALLOC_CONF but expandable_segments):

  sizes     every request rounded up to a multiple of 512 bytes (round_size);
            a request of 0 bytes takes no block.
  pools     requests up to 1 MiB come from the small pool, larger ones from
            the large pool (get_pool); a block serves only its own pool.
  segments  when no cached free block fits, a new segment: 2 MiB for a small
            request, 20 MiB for a large one under 10 MiB, else the request
            rounded up to 2 MiB (get_allocation_size).
  best fit  the smallest free block of the pool at least the request's size,
            the lowest address first among equals (get_free_block; with
            max_split_size unset, as here, no block is too large to take).
  splits    a block larger than the request is split, the rest going back to
            the pool as a free block, when the rest is >= 512 bytes in the
            small pool, > 1 MiB in the large (should_split); otherwise it is
            handed out whole (and max_memory_allocated counts it whole).
  frees     a freed block merges with its free neighbours of the same segment
            (free_block, try_merge_blocks). Segments are never released: no
            empty_cache in a step, and no out-of-memory retry (which frees
            cached segments and allocates again) is modelled.

With expandable_segments:True (Note [Expandable Segments] in the same file)
each pool has one segment that grows: a virtual range mapped page by page, in
2 MiB pages for the small pool and 20 MiB pages for the large. A request no
free block fits maps what it lacks at the segment's end (joined to a free
block there, if any), rounded up to whole pages (try_allocate_expandable_block,
map_block); reserved is what is mapped, and only an out-of-memory retry or
empty_cache unmaps. Any rest of >= 512 bytes is split off, in both pools; the
best fit passes over the free block at the segment's end when another fits,
that one weighing as much as it could grow to (get_free_block).

Fed by AllocatorFeed: every storage the planner's tracker sees made (as it
appears, the order of an op's outputs), freed when its storage dies (a
weakref's callback, so at the moment it happens), and resized in place
(FSDP's gathered parameters, `resize_` to 0 and back) as a free and a new
request, read before each op. Left out: streams (FSDP2 gathers and
reduce-scatters on streams of its own, whose blocks serve only their stream;
a block used on another stream waits for its events before it is reused: both
are planned as one stream), what was allocated and freed before the first
planned step (building and loading), and the requests of kernels that no
tensor shows (Note [planning for CUDA]).
"""
from __future__ import annotations

import bisect
import weakref

import torch

from parallel.resizes import resizes

BLOCK = 512  # every request rounded up to a multiple of it (kMinBlockSize)
SMALL = 1 << 20  # the largest request of the small pool (kSmallSize)
SMALL_SEGMENT = 2 << 20  # the small pool's segments, and expandable pages (kSmallBuffer)
LARGE_SEGMENT = 20 << 20  # segments of requests under 10 MiB, and the large pool's expandable pages (kLargeBuffer)
MIN_LARGE_ALLOC = 10 << 20  # requests from here get a segment of their own size (kMinLargeAlloc)
ROUND_LARGE = 2 << 20  # ... rounded up to it (kRoundLarge)
_SPACE = 1 << 48  # an expandable segment's virtual range: more than any GPU's memory


def round_size(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def segment_size(size: int) -> int:
    """The segment a request of `size` (rounded) makes when no cached block fits it (get_allocation_size)."""
    if size <= SMALL:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("addr", "size", "small", "free", "prev", "next")

    def __init__(self, addr: int, size: int, small: bool, prev=None, next=None):
        self.addr, self.size, self.small, self.free, self.prev, self.next = addr, size, small, False, prev, next


class CachingAllocator:
    """One device's caching allocator on one stream (Note [caching allocator]): `malloc` and `free` blocks;
    `reserved` (the segments, or with `expandable` the pages mapped) and `allocated` (the blocks handed out),
    each with its peak."""

    def __init__(self, expandable: bool = False):
        self.expandable = expandable
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self._free = {True: [], False: []}  # small pool? -> sorted (size, addr) of its free blocks
        self._blocks: dict[int, _Block] = {}  # addr -> free block
        self._next = 0  # the next segment's address (cudaMalloc's, here in order)
        self._end = {True: 0, False: _SPACE}  # expandable: each pool's mapped end
        self._last: dict[bool, _Block | None] = {True: None, False: None}  # expandable: the block ending there

    def malloc(self, nbytes: int) -> _Block | None:
        """A block for a request of `nbytes` (None for 0 bytes, which take none)."""
        if nbytes <= 0:
            return None
        size = round_size(nbytes)
        small = size <= SMALL
        block = self._best_fit(size, small)
        if block is None:
            block = self._grow(size, small) if self.expandable else self._segment(size, small)
        rest = block.size - size
        if (rest >= BLOCK) if small or self.expandable else (rest > SMALL):
            tail = _Block(block.addr + size, rest, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            if self._last[small] is block:
                self._last[small] = tail
            self._insert(tail)
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block | None) -> None:
        """Return `block` to its pool, merged with its free neighbours."""
        if block is None:
            return
        self.allocated -= block.size
        for other in (block.prev, block.next):
            if other is not None and other.free:
                self._remove(other)
                if other is block.prev:
                    block.addr, block.prev = other.addr, other.prev
                    if other.prev is not None:
                        other.prev.next = block
                else:
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
                    if self._last[block.small] is other:
                        self._last[block.small] = block
                block.size += other.size
        self._insert(block)

    def _insert(self, block: _Block) -> None:
        block.free = True
        bisect.insort(self._free[block.small], (block.size, block.addr))
        self._blocks[block.addr] = block

    def _remove(self, block: _Block) -> None:
        block.free = False
        free = self._free[block.small]
        del free[bisect.bisect_left(free, (block.size, block.addr))]
        del self._blocks[block.addr]

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        free = self._free[small]
        i = bisect.bisect_left(free, (size, -1))
        if i == len(free):
            return None
        if self.expandable:  # the block at the segment's end weighs what it could grow to: pass over it
            def room(j):
                b = self._blocks[free[j][1]]
                return b.size + (_SPACE if b is self._last[small] else 0)
            while i + 1 < len(free) and room(i + 1) < room(i):
                i += 1
        block = self._blocks[free[i][1]]
        self._remove(block)
        return block

    def _segment(self, size: int, small: bool) -> _Block:
        n = segment_size(size)
        block = _Block(self._next, n, small)
        self._next += n
        self._reserve(n)
        return block

    def _grow(self, size: int, small: bool) -> _Block:
        """Expandable: map what the request lacks at the pool's segment end, in whole pages."""
        page = SMALL_SEGMENT if small else LARGE_SEGMENT
        last = self._last[small]
        if last is not None and last.free:
            self._remove(last)
            mapped = -(-(size - last.size) // page) * page
            last.size += mapped
            block = last
        else:
            mapped = -(-size // page) * page
            block = _Block(self._end[small], mapped, small, prev=last)
            if last is not None:
                last.next = block
            self._last[small] = block
        self._end[small] += mapped
        self._reserve(mapped)
        return block

    def _reserve(self, n: int) -> None:
        self.reserved += n
        self.peak_reserved = max(self.peak_reserved, self.reserved)


class AllocatorFeed:
    """The planned steps' requests and frees, in order, fed to a simulated allocator with default settings and
    one with expandable_segments:True (Note [caching allocator]). `add` each storage as the tracker sees it made,
    `sync` before each op (storages resized in place)."""

    def __init__(self):
        self.allocators = (CachingAllocator(), CachingAllocator(expandable=True))
        self._live: dict[int, list] = {}  # id(storage) -> [weakref, bytes, blocks]
        self._seen = -1  # resizes() at the last look

    def add(self, t: torch.Tensor) -> None:
        """A storage of `t` the step made (or held at its start), requested now unless already fed."""
        if t.device.type == "meta":  # not `t.is_meta`: on a fake tensor it dispatches an op through every mode
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(st)
        rec = self._live.get(key)
        if rec is not None and rec[0]() is st:
            return
        n = st.nbytes()
        rec = [None, n, self._malloc(n)]
        rec[0] = weakref.ref(st, lambda _, key=key, rec=rec: self._dead(key, rec))
        self._live[key] = rec

    def sync(self) -> None:
        """Storages resized in place since the last look: a free of the old size, a request of the new (each
        size reread only when some storage was resized: Note [storages resized in place] in parallel/resizes.py)."""
        if self._seen == resizes():
            return
        self._seen = resizes()
        for rec in list(self._live.values()):
            st = rec[0]()
            if st is not None and st.nbytes() != rec[1]:
                self._release(rec[2])
                rec[1], rec[2] = st.nbytes(), self._malloc(st.nbytes())

    def reserved(self, apart: list[int] = ()) -> tuple[int, int]:
        """(max_memory_reserved, with expandable segments); `apart`: requests made before the step, each its own
        (DDP's buckets), added as a fresh allocator holds them."""
        out = []
        for a in self.allocators:
            alone = CachingAllocator(a.expandable)
            for n in apart:
                alone.malloc(n)
            out.append(a.peak_reserved + alone.peak_reserved)
        return out[0], out[1]

    def _malloc(self, n: int) -> tuple:
        return tuple(a.malloc(n) for a in self.allocators)

    def _release(self, blocks: tuple) -> None:
        for a, b in zip(self.allocators, blocks):
            a.free(b)

    def _dead(self, key: int, rec: list) -> None:
        self._release(rec[2])
        rec[2] = (None, None)
        if self._live.get(key) is rec:
            del self._live[key]


def reserved_of(cuda, apart: list[int]) -> dict:
    """A CUDA plan's `reserved` and `reserved_expandable` fields from its account (parallel.planning.cuda.CudaAccount;
    None: not a CUDA plan, no fields); `apart`: requests held from before the step (AllocatorFeed.reserved)."""
    if cuda is None:
        return {}
    reserved, expandable = cuda.segments.reserved(apart)
    return {"reserved": reserved, "reserved_expandable": expandable}


def held(plan) -> int:
    """The bytes a rank role needs of its device: a CUDA plan's reserved memory (never under its total), else
    its total."""
    return max(plan.total, getattr(plan, "reserved", 0))
