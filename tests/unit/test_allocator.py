"""The caching allocator simulated for CUDA plans' reserved memory (Note [caching allocator] in
parallel/planning/allocator.py), against sequences worked by hand from c10/cuda/CUDACachingAllocator.cpp's rules."""
import gc

import torch

from parallel.planning.allocator import AllocatorFeed, CachingAllocator, segment_size
from parallel.resizes import resizes_watched

KiB, MiB = 1 << 10, 1 << 20


def test_segment_sizes_by_request():
    assert [segment_size(n) for n in (512, MiB)] == [2 * MiB, 2 * MiB]  # the small pool's 2 MiB
    assert [segment_size(n) for n in (MiB + 512, 10 * MiB - 512)] == [20 * MiB, 20 * MiB]  # one 20 MiB to split
    assert [segment_size(n) for n in (10 * MiB, 11 * MiB + 1)] == [10 * MiB, 12 * MiB]  # its own, to 2 MiB


def test_the_small_pool_splits_one_segment_and_reuses_a_freed_block():
    a = CachingAllocator()
    x, y = a.malloc(1000), a.malloc(100 * KiB)  # 1024 and 100 KiB from one 2 MiB segment, one after the other
    assert (a.reserved, x.addr, y.addr, a.allocated) == (2 * MiB, 0, 1024, 1024 + 100 * KiB)
    a.free(x)
    z = a.malloc(1)  # 512 bytes: the best fit is the freed 1024-byte block, split again
    assert (z.addr, z.size, a.reserved) == (0, 512, 2 * MiB)
    a.free(z)
    a.free(y)  # all three merged into the whole segment, which stays reserved
    assert a.allocated == 0 and a.reserved == a.peak_reserved == 2 * MiB
    assert a.malloc(2 * MiB - 512).size == 2 * MiB - 512 and a.reserved == 22 * MiB  # large: a 20 MiB segment


def test_large_requests_share_a_20_mib_segment_or_make_their_own():
    a = CachingAllocator()
    b = a.malloc(3 * MiB)  # from a 20 MiB segment, 17 MiB left cached
    c = a.malloc(16 * MiB)  # fits the rest: split, 1 MiB left, not > 1 MiB, so handed out whole (17 MiB)
    assert a.reserved == 20 * MiB and (b.size, c.size) == (3 * MiB, 17 * MiB) and a.allocated == 20 * MiB
    a.malloc(50 * MiB + 1)  # its own segment, 52 MiB
    assert a.reserved == 72 * MiB


def test_fragmentation_a_freed_block_too_small_for_a_larger_request():
    a = CachingAllocator()
    x, y = a.malloc(12 * MiB), a.malloc(12 * MiB)
    a.free(x)  # 12 MiB cached, in a segment of its own
    a.malloc(14 * MiB)  # does not fit it: a new segment; 12 MiB reserved and idle
    assert (a.reserved, a.allocated) == (38 * MiB, 26 * MiB)
    a.malloc(12 * MiB)  # the cached one
    assert a.reserved == 38 * MiB and y.size == 12 * MiB


def test_expandable_segments_map_pages_at_the_end_and_keep_the_high_water_mark():
    e = CachingAllocator(expandable=True)
    x = e.malloc(5 * MiB)  # one 20 MiB page of the large pool, 15 MiB free at its end
    y = e.malloc(30 * MiB)  # 15 MiB free at the end, 15 more mapped: one more page
    assert e.reserved == 40 * MiB and y.addr == x.addr + 5 * MiB
    e.free(x)
    e.free(y)
    e.malloc(50 * MiB)  # the free 40 MiB at the end grown by a page
    assert e.reserved == e.peak_reserved == 60 * MiB
    e.malloc(1000)  # the small pool's own segment, in 2 MiB pages
    assert e.reserved == 62 * MiB
    # the default allocator, the same sequence: 20 + 30 (its own), then 50 (its own); 2 for the small request
    d = CachingAllocator()
    x, y = d.malloc(5 * MiB), d.malloc(30 * MiB)
    d.free(x)
    d.free(y)
    d.malloc(50 * MiB)
    d.malloc(1000)
    assert d.reserved == 102 * MiB


def test_the_feed_frees_a_storage_when_it_dies_and_follows_resizes():
    feed = AllocatorFeed()
    default, expandable = feed.allocators
    t = torch.empty(3 * MiB, dtype=torch.uint8)
    feed.add(t)
    feed.add(t[1:])  # the same storage: no second request
    assert (default.allocated, default.reserved, expandable.reserved) == (3 * MiB, 20 * MiB, 20 * MiB)
    with resizes_watched():  # as while a tracker is active (Note [storages resized in place])
        t.untyped_storage().resize_(0)  # as FSDP2 frees a gathered parameter
        feed.sync()
        assert default.allocated == 0
        t.untyped_storage().resize_(21 * MiB)  # and gathers it again: the cached 20 MiB does not fit; a 22 MiB
        feed.sync()  # segment, its 1 MiB rest not split off (> 1 MiB splits): the block is handed out whole
    assert (default.allocated, default.reserved, expandable.reserved) == (22 * MiB, 42 * MiB, 40 * MiB)
    del t
    gc.collect()
    assert default.allocated == expandable.allocated == 0
    assert feed.reserved([25 * MiB]) == (42 * MiB + 26 * MiB, 40 * MiB + 40 * MiB)  # DDP's bucket apart
