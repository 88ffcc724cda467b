"""One KV pool per device: every stream's cache and every question's scratch, in pages.

The pool is slabs `(layers, 2, kv_heads, slots, head_dim)` cut into pages of `page_tokens` slots.
Whoever needs slots holds a `Region`: a contiguous range of slots of one slab whose `kv` is a view,
so code that works on a tensor works on a region unchanged, and whose `start` places it in the slab,
which is what lets one varlen flash-attention call read many caches in place (see lm.py). Every
page has a reference count: the regions that cover it. A page returns to the free list when the
last region covering it is dropped, so memory lives exactly as long as someone can still read it.

- `alloc(n)` takes fresh contiguous pages (first fit);
- `extend(region, n)` takes the free pages right after a region, if they are free (a run that
  grows in place stays one range);
- `hold(slab, start, size)` is one more holder of slots already held (a version, say, holding the
  pages of its tokens while the cache that wrote them moves on);
- `exclusive(...)` says whether anybody but a given set of regions holds some slots: what lets a
  writer change pages in place (copy-on-write otherwise; see kvcache.py).

Pages let go of while the device may still read them (a re-layout's old pages, read by copies an
encode step has queued) are only safe to hand out to work on the same CUDA stream. Where a GPU
loop starts questions beside an encode step in flight, on another CUDA stream, it has the pool
`defer_frees()`: pages let go of return to the free list at the next `settled()` (the loop calls
it once the device has finished each step), so a question's scratch is never a page the step is
still reading.

A region is let go of by its finalizer, which the garbage collector may run at any allocation, in
any thread, including this one inside a method of this pool that holds its lock (`weakref.finalize`
allocates): a finalizer that took the lock deadlocked the GPU loop (an H200, 2026-11-28, two minutes
into a run, then the stuck watch's exit). So a finalizer only queues its pages (`_released`, a deque:
appending is atomic) and returns them itself only when it gets the lock at once; otherwise whoever
takes the lock next returns them first.

Accounting is exact and in whole pages: `used_tokens` is the pages held times `page_tokens`,
`peak_tokens` the most ever held at once. Pages are small (`PAGE_TOKENS`): a cache's segments are
packed back to back regardless of pages (the page is the unit of holding and freeing, not of
layout), so a small page only costs bookkeeping while it bounds what rounding wastes: at most a
page per region (a question's scratch, a stream's run).

The GPU gets one large slab at start (sized by `pool_tokens`). When it is full, a later slab adds
what the allocation asked for, at least `grow_tokens` (a small granule on a GPU: asking for another
slab of the first one's size, tens of GiB, fails on a device that already holds one), and only
while the device keeps `keep_free_bytes` free for activations; otherwise `PoolFull`. On the CPU
slabs of `grow_tokens` are added as needed.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

# 64 slots: a 448² temporal patch (256 tokens) is 4 pages and a chunk's segments need not align to
# pages at all, so a page only bounds rounding waste (a question's scratch of ~100 tokens wastes
# < 64) and sets the granularity of freeing; 55K pages on an H200 of a 3B model are cheap to count.
PAGE_TOKENS = 64


class PoolFull(RuntimeError):
    """No pages of the size asked for fit in the device's memory."""


def token_bytes(shape: tuple[int, int, int], dtype: torch.dtype) -> int:
    """K and V of one token in every layer of (layers, kv_heads, head_dim): what a cached token costs."""
    layers, kv_heads, head_dim = shape
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


@dataclass(eq=False)
class Region:
    """Slots `start .. start + size` of slab `slab`, held: their pages stay allocated while it lives."""

    kv: torch.Tensor  # (layers, 2, kv_heads, size, head_dim), a view into its slab
    slab: int
    start: int  # first token slot in the slab
    size: int
    _finalizer: weakref.finalize | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.size


class KVPool:
    def __init__(
        self,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        slab_tokens: int,
        grow_tokens: int | None = None,
        keep_free_bytes: int = 0,
        page_tokens: int = PAGE_TOKENS,
    ):
        """`shape` is (layers, kv_heads, head_dim); `slab_tokens` the first slab's size;
        `grow_tokens` the least a later slab adds (default: `slab_tokens`); a GPU slab is added
        only if `keep_free_bytes` stay free on the device after it. Slab sizes round up to pages."""
        self.layers, self.kv_heads, self.head_dim = shape
        self.dtype, self.device = dtype, device
        self.page_tokens = page_tokens
        self.slab_tokens = slab_tokens
        self.grow_tokens = grow_tokens or slab_tokens
        self.keep_free_bytes = keep_free_bytes
        self.slabs: list[torch.Tensor] = []  # each (layers, 2, kv_heads, slots, head_dim), slots = pages * page_tokens
        self._refs: list[np.ndarray] = []  # per slab: (pages,) int32 holders of each page
        self._free: list[list[tuple[int, int]]] = []  # per slab: sorted (first page, pages) holes
        # (slab, (n,) int64 sorted page indices) let go of since settled()
        self._deferred: list[tuple[int, np.ndarray]] | None = None
        self._lock = threading.Lock()
        self._released: deque[tuple[int, int, int]] = deque()  # (slab, first page, end page) let go of
        self.used_tokens = 0  # pages held, in tokens
        self.peak_tokens = 0  # the most ever held at once
        # caches laid out anew by evictions, in place or copied because somebody held the
        # old pages: a copy is a second cache's pages for as long as that holder lives
        self.relayouts = {"in_place": 0, "copied": 0}

    @property
    def capacity_tokens(self) -> int:
        return sum(s.shape[3] for s in self.slabs)

    @property
    def bytes_per_token(self) -> int:
        return token_bytes((self.layers, self.kv_heads, self.head_dim), self.dtype)

    def limit_tokens(self) -> int | None:
        """The most slots this pool can have: on a GPU its slabs plus what the device could still
        add beside the activations reserve; None on the CPU, where slabs are added as needed."""
        if self.device.type != "cuda":
            return None
        return self.capacity_tokens + max(0, _free_bytes(self.device) - self.keep_free_bytes) // self.bytes_per_token

    def room_tokens(self) -> int | None:
        """Slots allocations could still get: the slabs' free pages (and those let go of that the
        next `settled()` frees) plus what the device could still add (`limit_tokens`); None on
        the CPU, where slabs are added as needed. Free pages in pieces count whole: a region
        needs a run of them, so this is an upper bound for one allocation."""
        limit = self.limit_tokens()
        if limit is None:
            return None
        with self._locked():
            pages = sum(n for holes in self._free for _, n in holes)
            pages += sum(len(freed) for _, freed in self._deferred or ())
        return pages * self.page_tokens + max(0, limit - self.capacity_tokens)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_tokens)

    # -- holding -------------------------------------------------------------------------
    def alloc(self, n_tokens: int) -> Region:
        """Fresh contiguous pages for at least `n_tokens` (the region is all of them)."""
        if n_tokens <= 0:
            raise ValueError(f"a region needs at least one token, got {n_tokens}")
        pages = self.pages_for(n_tokens)
        with self._locked():
            slab, first = self._first_fit(pages)
            return self._region(slab, first * self.page_tokens, pages * self.page_tokens)

    def extend(self, region: Region, n_tokens: int) -> Region | None:
        """`region` and the fresh pages after it that make room for `n_tokens` more, as one new
        region; None when those pages are not free. `region` itself stays as it was."""
        p = self.page_tokens
        last = -(-region.end // p)  # the first page after the region
        pages = max(0, self.pages_for(n_tokens - (last * p - region.end)))
        with self._locked():
            if pages == 0:  # the region's last page has the room
                return self._region(region.slab, region.start, last * p - region.start)
            holes = self._free[region.slab]
            i = next((i for i, (first, n) in enumerate(holes) if first == last and n >= pages), None)
            if i is None:
                return None
            first, n = holes[i]
            holes[i : i + 1] = [(first + pages, n - pages)] if n > pages else []
            return self._region(region.slab, region.start, (last + pages) * p - region.start)

    def hold(self, slab: int, start: int, size: int) -> Region:
        """One more holder of slots that are held already."""
        with self._locked():
            a, b = self._pages(start, size)
            if not self._refs[slab][a:b].all():
                raise ValueError(f"slots {start}..{start + size} of slab {slab} are not all held")
            return self._region(slab, start, size)

    def exclusive(self, slab: int, start: int, size: int, mine: Iterable[Region]) -> bool:
        """Whether no region but those in `mine` holds any page of these slots (so they may be
        overwritten without anybody else seeing it)."""
        a, b = self._pages(start, size)
        with self._locked():
            others = self._refs[slab][a:b].astype(np.int64)  # (b - a,) holders, a copy: mine taken off below
            for r in mine:
                if r.slab == slab:
                    ra, rb = self._pages(r.start, r.size)
                    lo, hi = max(a, ra), min(b, rb)
                    others[max(0, lo - a) : max(0, hi - a)] -= 1
        return not others.any()

    def defer_frees(self) -> None:
        """From now on pages let go of are free again only at the next `settled()`."""
        with self._locked():
            if self._deferred is None:
                self._deferred = []

    def settled(self) -> None:
        """The device has finished all work queued so far: pages let go of may be handed out."""
        with self._locked():
            self._free_deferred()

    # -- internals (under the lock) --------------------------------------------------------
    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock, with the pages finalizers let go of meanwhile returned first."""
        with self._lock:
            self._return_released()
            yield

    def _pages(self, start: int, size: int) -> tuple[int, int]:
        """The pages that slots `start .. start + size` touch, as a range."""
        return start // self.page_tokens, -(-(start + size) // self.page_tokens)

    def _region(self, slab: int, start: int, size: int) -> Region:
        a, b = self._pages(start, size)
        refs = self._refs[slab][a:b]
        self._count(int((refs == 0).sum()))
        refs += 1
        kv = self.slabs[slab][:, :, :, start : start + size]  # (layers, 2, kv_heads, size, head_dim), a view
        region = Region(kv, slab, start, size)
        region._finalizer = weakref.finalize(region, self._release, slab, a, b)
        return region

    def _count(self, pages: int) -> None:
        self.used_tokens += pages * self.page_tokens
        self.peak_tokens = max(self.peak_tokens, self.used_tokens)

    def _first_fit(self, pages: int) -> tuple[int, int]:
        for slab, holes in enumerate(self._free):
            for i, (first, n) in enumerate(holes):
                if n >= pages:
                    holes[i : i + 1] = [(first + pages, n - pages)] if n > pages else []
                    return slab, first
        if self._deferred:  # they may fit: wait for the device rather than take more memory
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._free_deferred()
            return self._first_fit(pages)
        want = self.grow_tokens if self.slabs else self.slab_tokens
        self._add_slab(max(pages, self.pages_for(want)), pages)
        return self._first_fit(pages)

    def _add_slab(self, pages: int, needed: int) -> None:
        """A slab of `pages`, or of only the `needed` ones when the device has no room for more."""
        for n in dict.fromkeys((pages, needed)):  # each size once, the larger first
            tokens = n * self.page_tokens
            if (
                self.device.type == "cuda"
                and self.slabs
                and _free_bytes(self.device) - tokens * self.bytes_per_token < self.keep_free_bytes
            ):
                continue
            try:
                # Zeroed: masked-out or padded slots may be read (0 x uninitialised NaN would be NaN).
                slab = torch.zeros(
                    (self.layers, 2, self.kv_heads, tokens, self.head_dim), dtype=self.dtype, device=self.device
                )
            except torch.OutOfMemoryError:
                continue
            self.slabs.append(slab)
            self._refs.append(np.zeros(n, dtype=np.int32))
            self._free.append([(0, n)])
            return
        raise PoolFull(
            f"no room for {needed * self.page_tokens} more KV tokens on {self.device} "
            f"({self.used_tokens} of {self.capacity_tokens} in use, {self.keep_free_bytes >> 20} MiB kept free)"
        )

    def _release(self, slab: int, a: int, b: int) -> None:
        """A region's finalizer (module doc: never waits for the lock)."""
        self._released.append((slab, a, b))
        if self._lock.acquire(blocking=False):
            try:
                self._return_released()
            finally:
                self._lock.release()

    def _return_released(self) -> None:
        while self._released:
            slab, a, b = self._released.popleft()
            refs = self._refs[slab][a:b]  # (b - a,) a view: decremented in place
            refs -= 1
            freed = np.flatnonzero(refs == 0) + a  # (n,) int64 page indices, sorted
            if not len(freed):
                continue
            self._count(-len(freed))
            if self._deferred is not None:
                self._deferred.append((slab, freed))
            else:
                self._free_pages(slab, freed)

    def _free_deferred(self) -> None:
        if self._deferred:
            for slab, pages in self._deferred:
                self._free_pages(slab, pages)
            self._deferred.clear()

    def _free_pages(self, slab: int, pages: np.ndarray) -> None:
        """Sorted page indices (n,) back into the slab's holes."""
        breaks = np.flatnonzero(np.diff(pages) != 1) + 1
        holes = self._free[slab]
        holes += [(int(run[0]), len(run)) for run in np.split(pages, breaks)]
        holes.sort()
        merged: list[tuple[int, int]] = []
        for first, n in holes:  # coalesce neighbours so large runs fit again
            if merged and merged[-1][0] + merged[-1][1] == first:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((first, n))
        self._free[slab] = merged


def _free_bytes(device: torch.device) -> int:
    """What the device can still give: free memory plus what torch's allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
