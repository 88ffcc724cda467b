"""A stream's head read back from the segment store onto the device, off the GPU loop.

A head of a full 32K cache is about 1.2 GB of K/V in some 64 segments, and a worker that dies
leaves dozens of them to the others at once (docs/BENCHMARKS.md, "Failover"). What it costs:

- Page-locked memory. Reading each segment into a fresh pinned tensor took cudaHostAlloc
  0.2-0.5 s a GB, and those calls hold the CUDA driver: the GPU loop stood still while they ran
  (26 s with 32 restores at once on an H200). Here every segment passes through a few staging
  pieces of page-locked memory allocated once, when the worker starts (`Restorer`), like the
  bounce buffers of vLLM's and LMCache's CPU offload.
- The CRC-32 check: zlib's runs at about 2 GB/s a core, the read from tmpfs at several times
  that. `threads` readers, each with two pieces of its own, read and check pieces of different
  segments at once (both release the GIL), and each piece is copied on to the device on a copy
  CUDA stream of the restorer's while the next one is read.
- The GPU loop: it gets the segments already on the device, so restoring a cache there is device
  to device (`StreamCache.apply`), never a wait on the host.

On a CPU the same path runs with ordinary memory and synchronous copies (what the tests run).
A store other than a directory (Redis, memory) hands whole segments over (`SegmentStore.get`).
"""

from __future__ import annotations

import contextlib
import queue
import time
import zlib
from concurrent import futures
from dataclasses import dataclass, field

import torch

from common.engine.kvcache import CacheState
from common.segment_store import DirectoryStore, SegmentStore, SegmentStoreError, embeds_id, payload_tensor

PIECE_BYTES = 8 << 20  # a staging piece: large enough for few calls a GB, small enough to stay in cache for the CRC


@dataclass
class Loaded:
    """A head's segments and kept embeddings on the restorer's device, and what reading them took."""

    kv: dict[str, torch.Tensor]
    embeds: dict[str, torch.Tensor]
    nbytes: int
    read_s: float  # wall time from the first read to the last byte on the device
    copy_wait_s: float  # summed over the readers: time they waited for a piece's device copy


def for_loop(t: torch.Tensor) -> torch.Tensor:
    """A loaded tensor `t` for use on the calling thread's CUDA stream (the GPU loop's): its memory,
    allocated on the copy CUDA stream, is not reused before what this CUDA stream queues on it has run."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))
    return t


@dataclass
class _Piece:
    buf: torch.Tensor  # (PIECE_BYTES,) uint8, page-locked on a GPU host
    view: memoryview = field(init=False)
    copied: torch.cuda.Event | None = None  # its last copy to the device, on a GPU

    def __post_init__(self) -> None:
        self.view = memoryview(self.buf.numpy()).cast("B")

    def wait(self) -> float:
        """Until its last copy to the device is done (it may be written again); seconds waited."""
        if self.copied is None:
            return 0.0
        t0 = time.perf_counter()
        self.copied.synchronize()
        return time.perf_counter() - t0


class Restorer:
    """Reads heads' segments with `threads` readers through `2 x threads` staging pieces (all
    allocated here, once) onto `device`. Thread-safe: streams restored at once share the readers."""

    def __init__(self, device: torch.device, threads: int, piece_bytes: int = PIECE_BYTES):
        self.device = device
        cuda = device.type == "cuda"
        self._copy_cuda_stream = torch.cuda.Stream(device) if cuda else None
        self._pieces: queue.SimpleQueue[_Piece] = queue.SimpleQueue()
        for _ in range(2 * threads):
            buf = torch.empty(piece_bytes, dtype=torch.uint8, pin_memory=cuda)
            # blocking: a reader waiting for a copy sleeps instead of spinning on a core the others' CRCs need
            self._pieces.put(_Piece(buf, copied=torch.cuda.Event(blocking=True) if cuda else None))
        self._readers = futures.ThreadPoolExecutor(threads, thread_name_prefix="restore")

    def load_head(self, store: SegmentStore, stream: str, cache: CacheState) -> Loaded:
        """Every segment of a version, and the kept embeddings of its chunks, on the device."""
        chunks = sorted({p.segment.chunk_id for p in cache.placements[1:]})  # the first is the prefix
        return self.load(store, stream, [p.segment.id for p in cache.placements], chunks)

    def load(self, store: SegmentStore, stream: str, segments: list[str], chunks: list[str]) -> Loaded:
        """`segments` of `stream`, and the kept embeddings of `chunks` (those missing or unreadable
        are left out: evictions re-encode until they are gone), on the device. SegmentStoreError
        when a segment cannot be read back whole."""
        t0 = time.perf_counter()
        reads = {sid: self._readers.submit(self._read, store, stream, sid) for sid in segments}
        embeds_reads = {c: self._readers.submit(self._read, store, stream, embeds_id(c)) for c in chunks}
        try:
            kv = {sid: read.result() for sid, read in reads.items()}
        except BaseException:
            for read in [*reads.values(), *embeds_reads.values()]:
                read.cancel()
            futures.wait([*reads.values(), *embeds_reads.values()])  # none still writes when this returns
            raise
        embeds = {}
        for chunk, read in embeds_reads.items():
            with contextlib.suppress(SegmentStoreError):
                embeds[chunk] = read.result()
        got = [t for t, _ in kv.values()] + [t for t, _ in embeds.values()]
        return Loaded(
            kv={sid: t for sid, (t, _) in kv.items()},
            embeds={c: t for c, (t, _) in embeds.items()},
            nbytes=sum(t.numel() * t.element_size() for t in got),
            read_s=time.perf_counter() - t0,
            copy_wait_s=sum(w for _, w in [*kv.values(), *embeds.values()]),
        )

    def close(self) -> None:
        self._readers.shutdown(wait=True, cancel_futures=True)

    def _read(self, store: SegmentStore, stream: str, segment_id: str) -> tuple[torch.Tensor, float]:
        """One segment on the device, and the seconds spent waiting for its copies there."""
        if not isinstance(store, DirectoryStore):
            with self._on_copy_cuda_stream():
                return store.get(stream, segment_id).to(self.device), 0.0
        a, b = self._pieces.get(), self._pieces.get()
        waited = 0.0
        try:
            with store.open(stream, segment_id) as (meta, f, where), self._on_copy_cuda_stream():
                nbytes = meta["nbytes"]
                out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                crc, at, piece = 0, 0, a
                while at < nbytes:
                    waited += piece.wait()
                    n = f.readinto(piece.view[: min(len(piece.view), nbytes - at)])
                    if not n:
                        break  # truncated: payload_tensor says so
                    crc = zlib.crc32(piece.view[:n], crc)
                    out[at : at + n].copy_(piece.buf[:n], non_blocking=True)
                    if piece.copied is not None:
                        piece.copied.record(self._copy_cuda_stream)
                    at += n
                    piece = b if piece is a else a
        finally:
            waited += a.wait() + b.wait()  # their copies are done: the pieces are free, `out` is whole
            self._pieces.put(a)
            self._pieces.put(b)
        return payload_tensor(meta, out[:at], where, segment_id, crc), waited

    def _on_copy_cuda_stream(self) -> contextlib.AbstractContextManager:
        """Allocations and copies on the copy CUDA stream (on a GPU), never on the GPU loop's."""
        return (
            torch.cuda.stream(self._copy_cuda_stream)
            if self._copy_cuda_stream is not None
            else contextlib.nullcontext()
        )
