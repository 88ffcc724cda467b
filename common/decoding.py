"""Frames' pixels decoded in worker processes, out of the GPU worker's GIL: the encoder's live
frames and the frames a question about the past reads back from the frames log.

A GPU worker's loop hands the GIL over at every torch call and waits to get it back; whatever
Python the other threads run meanwhile delays the next kernel launch while the device may sit
idle. Decoding 64 cameras' WebP frames in the stream threads held the GIL 12 % of the time
(py-spy, H200, 2026-11-27; docs/BENCHMARKS.md), most of it inside Pillow. Here each frame's
pixels go to one of `processes` spawned processes (spawned: the worker holds CUDA, which a
fork must not copy) and come back as raw RGB; the header is still checked in the caller's
thread before any pixel is decoded, so a bad entry never reaches a process.

A process that dies (a decoder crash on a hostile image) breaks the pool: the pool is replaced
and the frame tried once more; if that breaks it too, the frame is the one to blame and is
rejected like any undecodable one. Nothing else is lost: frames in flight are retried. A worker
that dies (SIGKILL, no shutdown) takes its decoder processes with it: each watches its parent.

A question about the past decodes a few dozen logged records at once (`submit_logged`): each record
whole (msgpack, header, pixels) in a process, all of them submitted before the first is waited
for, so that every process works on them; the frames come back as `framelog.decode` gives them here.
They are waited for later (`Pending.result`), so that the question's thread can hand the GPU the
piece decoded before while the processes decode the next (qa_worker/history.py).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import structlog

from common import framelog
from common.wire.schemas import DEFAULT_LIMITS, EndOfStream, FrameMsg, Limits, SchemaError, decode_image, frame_from_map

log = structlog.get_logger()


class FrameDecoder:
    def __init__(self, processes: int, limits: Limits = DEFAULT_LIMITS):
        if processes < 1:
            raise ValueError(f"a frame decoder needs at least one process, got {processes}")
        self.processes, self.limits = processes, limits
        self._lock = threading.Lock()
        # made now, so that a host without what a pool needs (/dev/shm for its locks) fails at
        # start; its processes start with the first compressed frame
        self._pool: ProcessPoolExecutor | None = self._new_pool()

    def decode(self, m: Mapping[str, Any]) -> FrameMsg | EndOfStream:
        """`schemas.frame_from_map`, its pixels decoded in a process; raises SchemaError."""
        return frame_from_map(m, self.limits, decode=self._in_a_process)

    def submit_logged(self, records: Sequence[bytes]) -> Pending:
        """`framelog.decode` of each frames-log record, side by side in the processes, handed to
        them now; `result()` gives the frames in order, or raises what `framelog.decode` raises
        (SchemaError, ValueError)."""
        return Pending(self, framelog.decode, [(raw,) for raw in records], "frames log record")

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _in_a_process(self, fmt: str, data: bytes, h: int, w: int) -> bytes:
        return self._in_processes(decode_image, [(fmt, data, h, w)], f"{fmt} image")[0]

    def _in_processes(self, fn: Callable[..., Any], calls: Sequence[tuple], what: str) -> list[Any]:
        return Pending(self, fn, calls, what).result()

    def _running(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = self._new_pool()
            return self._pool

    def _new_pool(self) -> ProcessPoolExecutor:
        context = multiprocessing.get_context("spawn")
        return ProcessPoolExecutor(self.processes, context, initializer=watch_parent, initargs=(os.getpid(),))

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            replacing = self._pool is broken  # not replaced yet by another thread that saw it break
            if replacing:
                self._pool = None
        if replacing:
            log.warning("a frame decoder process died; its pool is replaced", processes=self.processes)
        broken.shutdown(wait=False, cancel_futures=True)


class Pending:
    """`fn(*args)` for each of `calls`, all submitted to the decoder's processes at once; `result()`
    waits for them, in order. A pool that breaks is replaced and the calls tried once more (the
    second break: SchemaError naming `what`); `cancel()` drops those no process has started."""

    def __init__(self, decoder: FrameDecoder, fn: Callable[..., Any], calls: Sequence[tuple], what: str):
        self._decoder, self._fn, self._calls, self._what = decoder, fn, calls, what
        self._tries = 0
        self._submit()

    def result(self) -> list[Any]:
        while True:
            try:
                if self._futures is not None:
                    return [f.result() for f in self._futures]
            except BrokenProcessPool:
                pass
            self._decoder._replace(self._pool)
            if self._tries >= 2:
                raise SchemaError("data", f"undecodable {self._what}: its decoder process died twice")
            self._submit()

    def cancel(self) -> None:
        for future in self._futures or ():
            future.cancel()

    def _submit(self) -> None:
        self._tries += 1
        self._pool = self._decoder._running()
        try:
            self._futures: list[Future] | None = [self._pool.submit(self._fn, *args) for args in self._calls]
        except BrokenProcessPool:  # broken before these were all handed over: result() tries again
            self._futures = None


PARENT_CHECK_S = 1.0


def watch_parent(parent: int) -> None:
    """In a spawned process (a decoder's, the search indexes' one): exit once the worker that started
    it is gone (reparented), so that a killed worker leaves none behind (the pool's own shutdown
    never ran)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
