"""The KV pool's growth: a full pool adds what is needed (at least a granule), never another slab
of the first one's size; accounting is exact."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from common.engine.pool import KVPool, PoolFull, token_bytes

SHAPE = (2, 1, 4)  # layers, kv_heads, head_dim


def test_a_full_pool_grows_by_what_is_needed_not_by_its_first_slab():
    pool = KVPool(SHAPE, torch.float32, torch.device("cpu"), slab_tokens=1000, grow_tokens=100, page_tokens=10)
    first = pool.alloc(1000)
    assert pool.capacity_tokens == 1000
    small = pool.alloc(30)  # a granule
    assert [s.shape[3] for s in pool.slabs] == [1000, 100]
    big = pool.alloc(250)  # more than a granule: exactly that
    assert [s.shape[3] for s in pool.slabs] == [1000, 100, 250]
    rest = pool.alloc(70)  # fits in the granule's hole
    assert pool.capacity_tokens == 1350 and pool.used_tokens == 1350
    assert pool.bytes_per_token == token_bytes(SHAPE, torch.float32) == 2 * 2 * 1 * 4 * 4
    del first, small, big, rest
    assert pool.used_tokens == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_pool_refuses_to_grow_into_the_activations_reserve():
    _, total = torch.cuda.mem_get_info()
    pool = KVPool(SHAPE, torch.float32, torch.device("cuda"), slab_tokens=16, grow_tokens=16, keep_free_bytes=total)
    first = pool.alloc(16)  # the first slab is what was asked for at start
    with pytest.raises(PoolFull):
        pool.alloc(1)
    assert len(pool.slabs) == 1 and first.size == 16


def test_pages_are_counted_and_free_once_their_last_holder_goes():
    pool = KVPool(SHAPE, torch.float32, torch.device("cpu"), slab_tokens=64, page_tokens=8)
    run = pool.alloc(20)  # 3 pages
    assert (run.start, run.size, pool.used_tokens) == (0, 24, 24)
    view = pool.hold(run.slab, 5, 10)  # slots 5..15: pages 0 and 1
    assert not pool.exclusive(run.slab, 0, 8, [run]) and pool.exclusive(run.slab, 16, 8, [run])
    assert pool.exclusive(run.slab, 0, 24, [run, view])
    del run
    assert pool.used_tokens == 16, "page 2 had no other holder"
    other = pool.alloc(8)
    assert other.start == 16, "and is allocated again"
    del view
    assert pool.used_tokens == 8 and pool.peak_tokens == 24
    with pytest.raises(ValueError, match="not all held"):
        pool.hold(0, 0, 1)


def test_a_region_extends_in_place_only_into_free_pages():
    pool = KVPool(SHAPE, torch.float32, torch.device("cpu"), slab_tokens=64, page_tokens=8)
    run = pool.alloc(8)
    grown = pool.extend(run, 12)  # two more pages, right after it
    assert (grown.start, grown.size, pool.used_tokens) == (0, 24, 24)
    grown.kv[:, :, :, 20] = 1.0
    assert torch.equal(pool.slabs[0][:, :, :, 20], grown.kv[:, :, :, 20])
    blocker = pool.alloc(8)
    assert pool.extend(grown, 1) is None, "the next page is taken"
    del run, blocker
    assert pool.used_tokens == 24


def test_deferred_frees_are_handed_out_only_once_the_device_has_settled():
    """Where questions start beside an encode step, pages let go of during the step (a re-layout's
    old pages, which copies the step queued may still read) must not become a question's scratch
    before the device is done: they are free again at `settled()`, or when nothing else fits."""
    pool = KVPool(SHAPE, torch.float32, torch.device("cpu"), slab_tokens=32, page_tokens=8)
    pool.defer_frees()
    old, _kept = pool.alloc(8), pool.alloc(8)
    del old  # page 0, let go of during a step
    assert pool.used_tokens == 8, "no longer held: counted as free at once"
    scratch = pool.alloc(8)
    assert scratch.start == 16, "but not handed out before the device settles"
    pool.settled()
    assert pool.alloc(8).start == 0
    del scratch
    assert pool.alloc(16).start == 16 and len(pool.slabs) == 1, "a full pool takes back deferred pages, not more memory"


def test_a_finalizer_run_inside_a_locked_method_never_deadlocks():
    """The garbage collector may run a region's finalizer at any allocation, also inside one of the
    pool's own methods while it holds the lock (on an H200 the GPU loop hung there for good): the
    pages come back once the lock is free, and the accounting is exact again."""
    pool = KVPool(SHAPE, torch.float32, torch.device("cpu"), slab_tokens=64, page_tokens=8)
    region, kept = pool.alloc(16), pool.alloc(8)
    finalizer = region._finalizer

    def as_the_collector_would() -> None:
        with pool._lock:  # what a locked method holds when a collection runs in it
            finalizer()

    t = threading.Thread(target=as_the_collector_would, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "the finalizer waited for a lock its own thread holds"
    del region
    again = pool.alloc(8)
    assert again.start == 0, "the pages let go of are handed out again"
    assert pool.used_tokens == 16 and kept.size == 8  # `kept` and `again`


def test_regions_collected_in_cycles_under_many_threads_all_come_back():
    """Regions that only the cyclic collector frees, dropped by threads allocating all the while
    (so collections run inside the pool's methods): nothing hangs and every page comes back."""
    pool = KVPool(SHAPE, torch.float32, torch.device("cpu"), slab_tokens=512, page_tokens=8)
    threshold = gc.get_threshold()

    def churn() -> None:
        for _ in range(300):
            cycle: list[object] = [pool.alloc(8)]
            cycle.append(cycle)  # freed only by the collector, at whatever allocation it runs

    gc.set_threshold(10)
    try:
        threads = [threading.Thread(target=churn, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a thread hung in the pool"
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    pool.settled()  # any pages a finalizer queued while another thread held the lock
    assert pool.used_tokens == 0
