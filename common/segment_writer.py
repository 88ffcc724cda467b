"""Segments written and collected off the serving threads (docs/DESIGN.md, "Persistence").

The encoder's stream threads hand each new segment's host copy to `SegmentWriter.put` and go on;
before they publish the version that references it they wait for its future (a version is
visible only once its segments are as durable as the store promises). Collection of the segments
no version needs (`gc`) is queued the same way. Neither the GPU loop nor a stream's thread
serializes, writes, fsyncs or lists a directory.

Ordering: a stream's operations run in the order given, on one lane (thread) chosen by the
stream's name, so a gc never races a put of the same stream (it would see the new segment as
unkept). Streams spread over the lanes.

Backpressure: `put` blocks while more than `max_queued_bytes` wait to be written, so a slow
medium slows the streams (frames then stay pending in Redis) instead of filling host memory.

Outages: a store that cannot take writes now (`StoreUnavailable`: disk full, read-only, I/O
error, a Redis at maxmemory) is retried every `retry_s` until it can, and `problem` says why
meanwhile (`/health/ready` fails its `segment_store` check with that reason). Anything else fails
that operation's future alone.
"""

from __future__ import annotations

import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import structlog
import torch

from common import health, metrics
from common.faults import fault_point
from common.segment_store import SegmentStore, StoreUnavailable

log = structlog.get_logger()

RETRY_MAX_S = 5.0  # the longest wait between two tries of a write the store could not take
READINESS_CHECK = "segment_store"


class WriterClosed(RuntimeError):
    """The writer stopped before the operation ran (the process is shutting down)."""


class _Op:
    def __init__(self, stream: str, what: str, run: Callable[[], object], nbytes: int) -> None:
        self.stream, self.what, self.run, self.nbytes = stream, what, run, nbytes
        self.future: Future = Future()


class SegmentWriter:
    def __init__(
        self, store: SegmentStore, lanes: int = 2, max_queued_bytes: int = 1 << 30, retry_s: float = 0.5
    ) -> None:
        self.store = store
        self.max_queued_bytes = max_queued_bytes
        self.retry_s = retry_s
        self.problem: str | None = None  # why writes are being retried, while they are
        self._queued = 0
        self._room = threading.Condition()
        self._closed = threading.Event()
        self._queues: list[queue.SimpleQueue[_Op | None]] = [queue.SimpleQueue() for _ in range(max(1, lanes))]
        self._threads = [
            threading.Thread(target=self._drain, args=(q,), name=f"segment-writer-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for t in self._threads:
            t.start()

    def put(self, stream: str, segment_id: str, kv: torch.Tensor, *, epoch: str | None = None) -> Future:
        """Queue ``kv`` (a host tensor the caller no longer changes) for the store, as K/V of the
        stream's life ``epoch``; the future is done once it is written."""
        nbytes = kv.numel() * kv.element_size()
        with self._room:  # backpressure: wait for room, but a lone segment larger than the bound goes
            while self._queued and self._queued + nbytes > self.max_queued_bytes and not self._closed.is_set():
                self._room.wait(0.5)
            self._queued += nbytes
            metrics.STORE_QUEUE_BYTES.set(self._queued)
        write = lambda: self.store.put(stream, segment_id, kv, epoch=epoch)  # noqa: E731
        future = self._submit(_Op(stream, segment_id, write, nbytes))
        fault_point("persist.copy_queued")
        return future

    def gc(self, stream: str, keep: Iterable[str]) -> Future:
        """Queue the collection of the stream's segments not in ``keep`` (after its queued puts)."""
        keep = frozenset(keep)
        return self._submit(_Op(stream, "gc", lambda: self.store.gc(stream, keep), 0))

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish what is queued (up to ``timeout_s``), then fail whatever is left."""
        for q in self._queues:
            q.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._closed.set()
        with self._room:
            self._room.notify_all()

    def _submit(self, op: _Op) -> Future:
        if self._closed.is_set():
            self._done(op)
            op.future.set_exception(WriterClosed("segment writer closed"))
            return op.future
        self._queues[zlib.crc32(op.stream.encode()) % len(self._queues)].put(op)
        return op.future

    def _drain(self, q: queue.SimpleQueue[_Op | None]) -> None:
        while (op := q.get()) is not None:
            self._run(op)
        while not q.empty():  # closed: nothing more runs
            if (op := q.get()) is not None:
                self._done(op)
                op.future.set_exception(WriterClosed("segment writer closed"))

    def _run(self, op: _Op) -> None:
        wait = self.retry_s
        while True:
            t0 = time.perf_counter()
            try:
                result = op.run()
            except StoreUnavailable as e:
                self._unavailable(op, str(e))
                if self._closed.wait(wait):
                    self._done(op)
                    op.future.set_exception(WriterClosed(f"segment writer closed while retrying: {e}"))
                    return
                wait = min(2 * wait, RETRY_MAX_S)
                continue
            except Exception as e:  # this segment's fault (a bad tensor, a corrupt directory entry)
                log.error("segment write failed", stream=op.stream, segment=op.what, error=str(e))
                metrics.STORE_FAILURES.labels("error").inc()
                self._done(op)
                op.future.set_exception(e)
                return
            break
        if self.problem is not None:
            log.info("segment store writable again", stream=op.stream)
            self.problem = None
            health.READINESS.failing.pop(READINESS_CHECK, None)
        if op.nbytes:
            metrics.STORE_WRITE_SECONDS.observe(time.perf_counter() - t0)
            metrics.STORE_WRITTEN_BYTES.inc(op.nbytes)
        self._done(op)
        op.future.set_result(result)

    def _unavailable(self, op: _Op, reason: str) -> None:
        metrics.STORE_FAILURES.labels("unavailable").inc()
        if self.problem != reason:
            log.error("segment store unavailable; retrying (frames stay pending)", stream=op.stream, error=reason)
        self.problem = reason
        health.READINESS.failing[READINESS_CHECK] = reason

    def _done(self, op: _Op) -> None:
        if not op.nbytes:
            return
        with self._room:
            self._queued -= op.nbytes
            metrics.STORE_QUEUE_BYTES.set(self._queued)
            self._room.notify_all()
