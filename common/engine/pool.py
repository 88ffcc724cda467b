"""One KV pool per device: every stream's cache and every question's scratch in one allocation.

A region is a contiguous range of token slots in a slab `(layers, 2, kv_heads, capacity,
head_dim)`. Its `kv` is a view, so code that works on an arena works on a region unchanged; its
`start` places it in the slab, which is what lets one varlen flash-attention call read the caches
of many streams and questions at once (see lm.py). A region returns to the free list when the
last object holding it (a cache, a version, a question) is dropped, so a snapshot keeps its
memory for exactly as long as someone can still read it.

The GPU gets one large slab at start (sized by `pool_tokens`). When it is full, a later slab adds
what the region asked for, at least `grow_tokens` (a small granule on a GPU: asking for another
slab of the first one's size, tens of GiB, fails on a device that already holds one), and only
while the device keeps `keep_free_bytes` free for activations; otherwise `PoolFull`. On the CPU
slabs of `grow_tokens` are added as needed.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch


class PoolFull(RuntimeError):
    """No region of the size asked for fits in the device's memory."""


def token_bytes(shape: tuple[int, int, int], dtype: torch.dtype) -> int:
    """K and V of one token in every layer of (layers, kv_heads, head_dim): what a cached token costs."""
    layers, kv_heads, head_dim = shape
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


@dataclass(eq=False)
class Region:
    kv: torch.Tensor  # (layers, 2, kv_heads, size, head_dim), a view into its slab
    slab: int
    start: int  # first token slot in the slab
    size: int
    _finalizer: weakref.finalize | None = field(default=None, repr=False)


class KVPool:
    def __init__(
        self,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        slab_tokens: int,
        grow_tokens: int | None = None,
        keep_free_bytes: int = 0,
    ):
        """`shape` is (layers, kv_heads, head_dim); `slab_tokens` the first slab's size;
        `grow_tokens` the least a later slab adds (default: `slab_tokens`); a GPU slab is added
        only if `keep_free_bytes` stay free on the device after it."""
        self.layers, self.kv_heads, self.head_dim = shape
        self.dtype, self.device = dtype, device
        self.slab_tokens = slab_tokens
        self.grow_tokens = grow_tokens or slab_tokens
        self.keep_free_bytes = keep_free_bytes
        self.slabs: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per slab: sorted (start, size) holes
        self._lock = threading.Lock()
        self.used_tokens = 0
        self.peak_tokens = 0  # the most ever in use at once

    @property
    def capacity_tokens(self) -> int:
        return sum(s.shape[3] for s in self.slabs)

    @property
    def bytes_per_token(self) -> int:
        return token_bytes((self.layers, self.kv_heads, self.head_dim), self.dtype)

    def alloc(self, n_tokens: int) -> Region:
        if n_tokens <= 0:
            raise ValueError(f"a region needs at least one token, got {n_tokens}")
        with self._lock:
            slab, start = self._first_fit(n_tokens)
            self.used_tokens += n_tokens
            self.peak_tokens = max(self.peak_tokens, self.used_tokens)
        region = Region(self.slabs[slab][:, :, :, start : start + n_tokens], slab, start, n_tokens)
        region._finalizer = weakref.finalize(region, self._release, slab, start, n_tokens)
        return region

    def _first_fit(self, n: int) -> tuple[int, int]:
        for slab, holes in enumerate(self._free):
            for i, (start, size) in enumerate(holes):
                if size >= n:
                    holes[i : i + 1] = [(start + n, size - n)] if size > n else []
                    return slab, start
        self._add_slab(max(n, self.grow_tokens if self.slabs else self.slab_tokens), n)
        return self._first_fit(n)

    def _add_slab(self, size: int, needed: int) -> None:
        """A slab of `size` tokens, or of only the `needed` ones when the device has no room for more."""
        for n in dict.fromkeys((size, needed)):  # each size once, the larger first
            if (
                self.device.type == "cuda"
                and self.slabs
                and _free_bytes(self.device) - n * self.bytes_per_token < self.keep_free_bytes
            ):
                continue
            try:
                # Zeroed: masked-out or padded slots may be read (0 x uninitialised NaN would be NaN).
                slab = torch.zeros(
                    (self.layers, 2, self.kv_heads, n, self.head_dim), dtype=self.dtype, device=self.device
                )
            except torch.OutOfMemoryError:
                continue
            self.slabs.append(slab)
            self._free.append([(0, n)])
            return
        raise PoolFull(
            f"no room for {needed} more KV tokens on {self.device} "
            f"({self.used_tokens} of {self.capacity_tokens} in use, {self.keep_free_bytes >> 20} MiB kept free)"
        )

    def _release(self, slab: int, start: int, n: int) -> None:
        with self._lock:
            self.used_tokens -= n
            holes = self._free[slab]
            holes.append((start, n))
            holes.sort()
            merged: list[tuple[int, int]] = []
            for s, size in holes:  # coalesce neighbours so large regions fit again
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((s, size))
            self._free[slab] = merged


def _free_bytes(device: torch.device) -> int:
    """What the device can still give: free memory plus what torch's allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
