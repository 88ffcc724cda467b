"""A stream's head read back from the segment store into host memory, off the GPU loop.

A head of a full 32K cache is about 1.2 GB of K/V in some 64 segments, and a worker that dies
leaves dozens of them to the others at once (docs/BENCHMARKS.md, "Failover"). What it costs:

- Page-locked memory. Reading each segment into a fresh pinned tensor took cudaHostAlloc
  0.2-0.5 s a GB, and those calls hold the CUDA driver: the GPU loop stood still while they ran
  (26 s with 32 restores at once on an H200). Here a head is read into a slot of one page-locked
  arena allocated when the worker starts (`Restorer`), like the bounce buffers of vLLM's and
  LMCache's CPU offload; a slot is reused once the GPU loop's copies out of it are done.
- The checksum (CRC-32C, common/segment_store.py): zlib's CRC-32, which segments carried before,
  ran at about 2.9 GB/s a core, the read from tmpfs at about 3.6 (an H200 host). `threads`
  readers read and check different segments at once (both release the GIL), each a piece at a
  time, so the piece is still in cache for its check.
- Device memory: none here. The KV pool holds all of a GPU but a reserve for activations, so a
  head is not staged there whole; the GPU loop copies each segment from the slot (asynchronous,
  page-locked) and lays it out in the cache (`StreamCache.apply`), one segment's memory at a time.

On a CPU the arena is ordinary memory. A segment that does not fit in its slot (a head over its
budget) is read into ordinary memory instead; a store other than a directory (Redis, memory)
hands whole segments over (`SegmentStore.get`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import torch

from common.engine.kvcache import CacheState
from common.faults import fault_point
from common.segment_store import (
    DirectoryStore,
    SegmentStore,
    SegmentStoreError,
    checksum,
    embeds_id,
    owner_mismatch,
    payload_tensor,
)

PIECE_BYTES = 8 << 20  # read and checked at a time: a few calls a segment, still in cache for the CRC
ALIGN = 4096  # where a segment starts in a slot: any dtype's view, and page-aligned copies


class _Slot:
    """One head's room in the arena: segments are placed one after the other as readers ask."""

    def __init__(self, buf: torch.Tensor, cuda: bool):
        self.buf = buf  # (bytes,) uint8, a view of the arena
        self.view = memoryview(buf.numpy()).cast("B")
        self.copied = torch.cuda.Event(blocking=True) if cuda else None  # the loop's last copy out of it
        self._used = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor | None:
        """`nbytes` of the slot, or None when it has no more room."""
        with self._lock:
            at = self._used
            if at + nbytes > len(self.view):
                return None
            self._used = -(-(at + nbytes) // ALIGN) * ALIGN
        return self.buf[at : at + nbytes]

    def reuse(self) -> float:
        """Empty, once the copies out of it are done (blocking: a reader waits asleep); seconds waited."""
        t0 = time.perf_counter()
        if self.copied is not None:
            self.copied.synchronize()
        self._used = 0
        return time.perf_counter() - t0


@dataclass
class Loaded:
    """A head's segments and kept embeddings in host memory (a slot of the arena), what reading them
    took, and the slot's way back: `release` once the GPU loop has queued its copies."""

    kv: dict[str, torch.Tensor]
    embeds: dict[str, torch.Tensor]
    nbytes: int
    read_s: float  # wall time to read and check them all
    _slot: _Slot | None
    _release: Callable[[], None]

    def to(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`t` (one of kv's or embeds') on `device`, on the calling thread's stream (the GPU loop's):
        an asynchronous copy out of page-locked memory; a copy of its own on the CPU (the slot is
        reused once released)."""
        if device.type != "cuda":
            return t.clone()
        on_device = t.to(device, non_blocking=True)
        if self._slot is not None and self._slot.copied is not None:
            self._slot.copied.record()  # after every copy queued so far: the slot's next reuse waits for it
        return on_device

    def release(self) -> None:
        """The slot back to the restorer (its reuse waits for the copies out of it)."""
        self._release()
        self._release = _nothing


def _nothing() -> None:
    return None


class Restorer:
    """Reads heads with `threads` readers into `slots` slots of `slot_bytes` each (one arena,
    page-locked on a GPU host, allocated here, once). Thread-safe: up to `slots` heads at once."""

    def __init__(self, device: torch.device, threads: int, slots: int = 1, slot_bytes: int = 64 << 20):
        self.device = device
        cuda = device.type == "cuda"
        slot_bytes = -(-slot_bytes // ALIGN) * ALIGN  # every slot starts aligned too
        arena = torch.empty(slots * slot_bytes, dtype=torch.uint8, pin_memory=cuda and slots * slot_bytes > 0)
        self._slots: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        for i in range(slots):
            self._slots.put(_Slot(arena[i * slot_bytes : (i + 1) * slot_bytes], cuda))
        self._readers = futures.ThreadPoolExecutor(threads, thread_name_prefix="restore")

    def load_head(self, store: SegmentStore, stream: str, cache: CacheState) -> Loaded:
        """Every segment of a version, and the kept embeddings of its chunks."""
        chunks = sorted({p.segment.chunk_id for p in cache.placements[1:]})  # the first is the prefix
        return self.load(store, stream, [p.segment.id for p in cache.placements], chunks, cache.epoch)

    def load(
        self, store: SegmentStore, stream: str, segments: list[str], chunks: list[str], epoch: str | None = None
    ) -> Loaded:
        """`segments` of `stream`, and the kept embeddings of `chunks` (those missing or unreadable
        are left out: evictions re-encode until they are gone), in a slot the caller releases.
        SegmentStoreError when a segment cannot be read back whole, or is another stream's or
        another life's than `epoch` (when given), or what a read raised (a Redis store's outage):
        the slot is then released."""
        slot = self._slots.get()
        t0 = time.perf_counter()
        slot.reuse()
        jobs = {sid: self._readers.submit(self._read, store, stream, sid, slot, epoch) for sid in segments}
        embeds_jobs = {c: self._readers.submit(self._read, store, stream, embeds_id(c), slot, epoch) for c in chunks}
        try:
            kv = {}
            for sid, job in jobs.items():
                kv[sid] = job.result()
                fault_point("persist.mid_restore")
            embeds = {}
            for chunk, job in embeds_jobs.items():  # anything but a bad record (a Redis outage) fails the head
                with contextlib.suppress(SegmentStoreError):
                    embeds[chunk] = job.result()
        except BaseException:
            for job in [*jobs.values(), *embeds_jobs.values()]:
                job.cancel()
            futures.wait([*jobs.values(), *embeds_jobs.values()])  # none still writes into the slot
            self._slots.put(slot)
            raise
        return Loaded(
            kv=kv,
            embeds=embeds,
            nbytes=sum(t.numel() * t.element_size() for t in [*kv.values(), *embeds.values()]),
            read_s=time.perf_counter() - t0,
            _slot=slot,
            _release=lambda: self._slots.put(slot),
        )

    def close(self) -> None:
        self._readers.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _read(store: SegmentStore, stream: str, segment_id: str, slot: _Slot, epoch: str | None) -> torch.Tensor:
        """One segment, checked, in the slot (in ordinary memory when the slot is full)."""
        if not isinstance(store, DirectoryStore):
            return store.get(stream, segment_id)
        with store.open(stream, segment_id) as (meta, f, where):
            # Files are what gets copied about (by hand, `segments load`) and outlive a stream's life.
            if (why := owner_mismatch(meta, stream, epoch, where)) is not None:
                raise SegmentStoreError(why)
            nbytes = meta["nbytes"]
            out = slot.take(nbytes)
            if out is None:
                out = torch.empty(nbytes, dtype=torch.uint8)
            view = memoryview(out.numpy()).cast("B")
            check, _ = checksum(meta)
            crc, at = 0, 0
            while at < nbytes:
                n = f.readinto(view[at : min(at + PIECE_BYTES, nbytes)])
                if not n:
                    break  # truncated: payload_tensor says so
                crc = check(view[at : at + n], crc)
                at += n
        return payload_tensor(meta, out[:at], where, segment_id, crc)
