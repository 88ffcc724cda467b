"""The cameras' search indexes (common/chunkindex.py), held and searched in a process of their own.

Searching in the worker's process starved its GPU loop: with 64 live cameras and one client
searching 64 cameras' 24 h back to back, the search threads held the GIL 34 % of the time (H200),
the GPU was busy 18-34 % and 44-64 % of the cameras' frames were dropped. So the indexes are opened,
refreshed and searched in one spawned process (its own GIL; spawned, not forked: the worker holds
CUDA, and this module imports nothing of the model), started by the first search: a worker that
never searches never starts it. The worker computes the question's vector (a forward on its GPU
loop) and sends only that, the cameras and the span; the ranking (each camera's chunks, the
moments of all, `moments.py`) runs here and only the final hits come back.

A search is two round trips: `kinds`, the model and layers of each wanted camera's index (the
question's vector depends on the layers); then `moments` or `chunks` with one vector per layers.
An index saved anew between the two (another model or layers) is left out of that search.

A camera's index is opened by the first search that needs it; after that a thread opens it again
whenever the recorder saved it (every `features_save_s`, all cameras at once), so a search never
waits for that: opening a camera-day's index and building its table took 100-200 ms on a CPU,
which at 64 cameras made the first search after every save take seconds. A search sees what the
recorder saved, up to `REFRESH_S` and an opening later.

The process ending (killed, out of memory, a crash in the index library) fails the searches it
held, or the one that finds it gone (`Ended`), and nothing else; the next search starts another.
A failed search is not tried again here: one that crashes the process would crash the next too.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from common.chunkindex import DELTA_META_NAME, META_NAME, ChunkIndex
from common.decoding import watch_parent
from common.framelog import FrameLog
from common.logs import configure_logging
from common.wire.schemas import SearchHit
from qa_worker import moments

log = structlog.get_logger()

REFRESH_S = 1.0  # how often the held indexes are checked for a newer save
# A search asks each camera for this many chunks per moment wanted, and this many times more each
# time that was not enough to know the moments (an event of many chunks took them up).
CANDIDATES = 4
# Cameras searched at once: the graph search and the span's masks run without the GIL, and a day of
# 64 cameras searched one after another took about 5 ms a camera, most of a search's time.
SEARCH_THREADS = 8

Layers = tuple[int, ...]
Vectors = Mapping[Layers, np.ndarray]  # the question's vector at each layers wanted


class Ended(Exception):
    """The index process ended while it held the call (or before it was given it)."""


class IndexProcess:
    """The worker's handle on the index process of the frames log at ``root``: each call is run
    there and waited for. One process, its calls one at a time (each spreads over SEARCH_THREADS
    there): a `ProcessPoolExecutor` of one spawned worker, since it already sends calls and their
    exceptions, and tells a process that died (BrokenProcessPool) from a call that failed."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None

    def kinds(self, streams: list[str] | None) -> dict[str, tuple[str, Layers]]:
        """(model, layers) of each camera's index (None: every camera the log holds) that holds
        chunks; opened there now if it is the first search of the camera."""
        return self._call(_on_held, "kinds", streams)

    def moments(
        self, cams: list[str], model: str, vectors: Vectors, since: float, until: float, limit: int
    ) -> list[SearchHit]:
        """`HeldIndexes.moments` in the process."""
        return self._call(_on_held, "moments", cams, model, vectors, since, until, limit)

    def chunks(
        self, cams: list[str], model: str, vectors: Vectors, since: float, until: float, limit: int
    ) -> list[SearchHit]:
        """`HeldIndexes.chunks` in the process."""
        return self._call(_on_held, "chunks", cams, model, vectors, since, until, limit)

    @property
    def pid(self) -> int:
        """The process's id (started now if it was not)."""
        return self._call(os.getpid)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            if self._pool is None:  # the first search, or the first since the process ended
                level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
                spawn = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(1, spawn, initializer=_start, initargs=(self.root, os.getpid(), level))
            pool = self._pool
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool:  # its manager failed every call the process held, and reaps it
            with self._lock:
                if self._pool is pool:  # said once, by the first search that saw it end
                    self._pool = None
                    log.warning("the search index process ended; the next search starts another")
            raise Ended() from None


class HeldIndexes:
    """In the index process: the opened index of each camera searched so far, kept fresh."""

    def __init__(self, root: Path) -> None:
        self.framelog = FrameLog(root)
        self._open: dict[str, tuple[tuple[int, ...], ChunkIndex]] = {}  # camera -> (meta files' stamps, index)
        self._refresher: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(SEARCH_THREADS, thread_name_prefix="search")

    def kinds(self, streams: list[str] | None) -> dict[str, tuple[str, Layers]]:
        return {
            cam: (index.model, index.layers) for cam in streams or self.framelog.cameras() if (index := self.index(cam))
        }

    def moments(
        self, cams: list[str], model: str, vectors: Vectors, since: float, until: float, limit: int
    ) -> list[SearchHit]:
        """The `limit` best moments of ``cams`` captured in [since, until], best first: runs of
        adjacent chunks that match (moments.py); none when nothing of the span is indexed. Each
        camera's best chunks are asked for, more each time until the chunks taken stop above the
        score of every camera's last one given (so none not given could have been taken), or every
        camera has given all it has."""
        indexes = self._comparable(cams, model, vectors)
        k = CANDIDATES * limit
        while True:
            found = self._each_camera(indexes, k, since, until)
            found_moments, stop = moments.moments(moments.order([c for cs in found for c in cs]), limit)
            unseen = max((cs[-1].score for cs in found if len(cs) == k), default=None)
            if unseen is None or (stop is not None and stop > unseen):
                return found_moments
            k *= CANDIDATES

    def chunks(
        self, cams: list[str], model: str, vectors: Vectors, since: float, until: float, limit: int
    ) -> list[SearchHit]:
        """The `limit` best chunks, one by one (scope history answers over them), best first."""
        found = self._each_camera(self._comparable(cams, model, vectors), limit, since, until)
        return moments.order([c for cs in found for c in cs])[:limit]

    def _comparable(self, cams: list[str], model: str, vectors: Vectors) -> list[tuple[str, ChunkIndex, np.ndarray]]:
        """The cameras' indexes of ``model`` at layers ``vectors`` has, each with its vector (one
        saved anew since `kinds` told the worker its layers may have others: left out)."""
        out = []
        for cam in cams:
            index = self.index(cam)
            if index and index.model == model and (vector := vectors.get(index.layers)) is not None:
                out.append((cam, index, vector))
        return out

    def _each_camera(
        self, indexes: list[tuple[str, ChunkIndex, np.ndarray]], k: int, since: float, until: float
    ) -> list[list[SearchHit]]:
        """Each camera's ``k`` best chunks in the span, the cameras searched side by side."""
        return list(self._pool.map(lambda held: self._chunks(*held, k, since, until), indexes))

    @staticmethod
    def _chunks(cam: str, index: ChunkIndex, vector: np.ndarray, k: int, since: float, until: float) -> list[SearchHit]:
        """The camera's ``k`` best chunks in the span, best first."""
        return [
            SearchHit.chunk(cam, m.start, m.end, m.score, m.first_seq, m.last_seq, m.frames)
            for m in index.search(vector, k, since, until)
        ]

    def index(self, cam: str) -> ChunkIndex | None:
        """The camera's index as last opened; opened now only the first time it is searched."""
        held = self._open.get(cam) or self._reopen(cam)
        if self._refresher is None:
            self._refresher = threading.Thread(target=self._refresh_forever, name="search-indexes", daemon=True)
            self._refresher.start()
        return held[1] if held else None

    def _reopen(self, cam: str) -> tuple[tuple[int, ...], ChunkIndex] | None:
        """Open the camera's saved index again if its files changed since it was opened (its
        table and newest vectors built here too, not in a search); the index held now, None when there is none."""
        d = self.framelog.root / cam
        stamp = _stamp(d / META_NAME) + _stamp(d / DELTA_META_NAME)  # a delta is saved without its base
        if not stamp:
            self._open.pop(cam, None)
            return None
        held = self._open.get(cam)
        if held is None or held[0] != stamp:
            index = ChunkIndex.view(d)
            if index is None:
                return held  # unreadable mid-save, say: the last one opened serves until the next
            index.prepare()
            held = self._open[cam] = (stamp, index)
        return held

    def _refresh_forever(self) -> None:
        while True:
            time.sleep(REFRESH_S)
            for cam in list(self._open):
                try:
                    self._reopen(cam)
                except Exception as e:  # a bad file must not end the refreshing of the others
                    log.warning("search index not reopened", stream=cam, error=str(e)[:200])


def _stamp(path: Path) -> tuple[int, ...]:
    """(modified, size) of a file; () when there is none."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return ()
    return (st.st_mtime_ns, st.st_size)


# -- in the index process ------------------------------------------------------------------------

_held: HeldIndexes | None = None  # the process's one, made at its start


def _start(root: str, parent: int, log_level: str) -> None:
    """The process's initializer: its log lines as the worker's (JSON, the worker's level), its
    end with the worker's (a killed worker runs no shutdown), its indexes (none opened yet)."""
    global _held
    configure_logging(log_level)
    watch_parent(parent)
    _held = HeldIndexes(Path(root))


def _on_held(method: str, *args: Any) -> Any:
    assert _held is not None, "not the index process"
    return getattr(_held, method)(*args)
