"""Searches, answered by any worker with the frames log: the question's vector (the model's own
queries, common/engine/features.py) against every camera's index beside the log.

The indexes are the recorder's (common/chunkindex.py), read memory-mapped. A camera's index is
opened by the first search that needs it; after that a thread opens it again whenever the
recorder saved it (every `features_save_s`, all cameras at once), so a search never waits for
that: opening a camera-day's index and building its table took 100-200 ms on a CPU, which at 64
cameras made the first search after every save take seconds. A camera's index holds vectors of
one model at some layers: the question is represented at those layers, once for all cameras
alike; an index of another model than this worker's is not comparable and is left out with a
warning. The chunks of all cameras are ranked by score and made into moments (moments.py): a
camera's adjacent matching chunks are one result. A search sees what the recorder saved
(every `features_save_s`), up to `REFRESH_S` and an opening later.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import structlog

from common.chunkindex import DELTA_META_NAME, META_NAME, ChunkIndex
from common.engine.features import question_vector
from common.engine.params import MAX_QUESTION_TOKENS
from common.engine.runtime import Runtime
from common.framelog import FrameLog
from common.wire.schemas import FinalAnswer, SchemaError, SearchHit
from common.wire.search_request import SearchRequest, parse_search
from common.wire.timeref import TimeRef
from qa_worker import moments

log = structlog.get_logger()

REFRESH_S = 1.0  # how often the held indexes are checked for a newer save
# A search asks each camera for this many chunks per moment wanted, and this many times more each
# time that was not enough to know the moments (an event of many chunks took them up).
CANDIDATES = 4
# Cameras searched at once: the graph search and the span's masks run without the GIL, and a day of
# 64 cameras searched one after another took about 5 ms a camera, most of a search's time.
SEARCH_THREADS = 8
# Question vectors kept, by text and layers: each is a forward on the GPU loop (81 ms a task beside
# 64 cameras, H200), and the same searches come again (a page reloaded, a saved search, an alert).
VECTORS_KEPT = 256


class SearchError(Exception):
    """Why a search cannot be answered: its final's `error` (and `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def search_span(since: TimeRef | None, until: TimeRef | None, asked_at: float) -> tuple[float, float]:
    """The span as capture times: all the log holds without `since`, up to the asking without `until`."""
    t0 = since.resolve(asked_at) if since is not None else -math.inf
    t1 = until.resolve(asked_at) if until is not None else math.inf
    if t1 <= t0:
        raise SearchError("until must be later than since: the span is empty", param="until")
    return t0, t1


class Searcher:
    def __init__(self, rt: Runtime, framelog_dir: str | None):
        self.rt = rt
        self.framelog = FrameLog(framelog_dir) if framelog_dir is not None else None
        self._open: dict[str, tuple[tuple[int, ...], ChunkIndex]] = {}  # camera -> (meta files' stamps, index)
        self._refresher: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(SEARCH_THREADS, thread_name_prefix="search")
        self._vectors: OrderedDict[tuple[str, tuple[int, ...]], np.ndarray] = OrderedDict()  # least recent first
        self._vectors_lock = threading.Lock()

    def answer(self, qid: str, fields: dict, asked_at: float) -> tuple[FinalAnswer, SearchRequest | None]:
        """A search entry's final (errors are finals) and the request, when it parsed."""
        try:
            req = parse_search(fields)
        except SchemaError as e:
            return FinalAnswer(id=qid, stream=None, error=f"bad search: {e}", param=e.field), None
        t0 = time.perf_counter()
        try:
            since, until = search_span(req.since, req.until, asked_at)
            hits = self.search(req.text, [req.stream] if req.stream else None, since, until, req.limit)
        except SearchError as e:
            return FinalAnswer(id=qid, stream=req.stream, error=str(e), param=e.param), req
        log.info("searched", qid=qid, stream=req.stream, hits=len(hits), best=hits[0].score if hits else None)
        return FinalAnswer(id=qid, stream=req.stream, text="", hits=tuple(hits), total_s=time.perf_counter() - t0), req

    def search(self, text: str, streams: list[str] | None, since: float, until: float, limit: int) -> list[SearchHit]:
        """The `limit` best moments of ``streams`` (None: every camera the log holds) captured in
        [since, until], best first: runs of adjacent chunks that match (moments.py); none when
        nothing of the span is indexed. Each camera's best chunks are asked for, more each time
        until the chunks taken stop above the score of every camera's last one given (so none
        not given could have been taken), or every camera has given all it has."""
        indexes = self._indexes(text, streams)
        k = CANDIDATES * limit
        while True:
            found = self._each_camera(indexes, k, since, until)
            found_moments, stop = moments.moments(moments.order([c for cs in found for c in cs]), limit)
            unseen = max((cs[-1].score for cs in found if len(cs) == k), default=None)
            if unseen is None or (stop is not None and stop > unseen):
                return found_moments
            k *= CANDIDATES

    def chunks(self, text: str, streams: list[str] | None, since: float, until: float, limit: int) -> list[SearchHit]:
        """The `limit` best chunks, one by one (scope history answers over them), best first."""
        found = self._each_camera(self._indexes(text, streams), limit, since, until)
        return moments.order([c for cs in found for c in cs])[:limit]

    def _each_camera(
        self, indexes: list[tuple[str, ChunkIndex, np.ndarray]], k: int, since: float, until: float
    ) -> list[list[SearchHit]]:
        """Each camera's ``k`` best chunks in the span, the cameras searched side by side."""
        return list(self._pool.map(lambda held: self._chunks(*held, k, since, until), indexes))

    def _indexes(self, text: str, streams: list[str] | None) -> list[tuple[str, ChunkIndex, np.ndarray]]:
        """The cameras' indexes comparable with this worker's model, each with the question's vector
        at its layers (computed once per layers)."""
        if self.framelog is None:
            raise SearchError("this worker has no frames log (framelog_dir): it cannot search")
        indexes = [(cam, index) for cam in streams or self.framelog.cameras() if (index := self._index(cam))]
        vectors: dict[tuple[int, ...], np.ndarray] = {}
        out = []
        for cam, index in indexes:
            if index.model != self.rt.loaded.name:
                log.warning("search index of another model; left out", stream=cam, model=index.model)
                continue
            if index.layers not in vectors:
                vectors[index.layers] = self._question(text, index.layers)
            out.append((cam, index, vectors[index.layers]))
        return out

    @staticmethod
    def _chunks(cam: str, index: ChunkIndex, vector: np.ndarray, k: int, since: float, until: float) -> list[SearchHit]:
        """The camera's ``k`` best chunks in the span, best first."""
        return [
            SearchHit.chunk(cam, m.start, m.end, m.score, m.first_seq, m.last_seq, m.frames)
            for m in index.search(vector, k, since, until)
        ]

    def _question(self, text: str, layers: tuple[int, ...]) -> np.ndarray:
        if len(self.rt.encode(text, user=True)) > MAX_QUESTION_TOKENS:
            raise SearchError(f"the search is longer than {MAX_QUESTION_TOKENS} tokens", param="search")
        key = (text, layers)
        with self._vectors_lock:
            if (kept := self._vectors.get(key)) is not None:
                self._vectors.move_to_end(key)
                return kept
        vector = self.rt.executor.call(lambda: question_vector(self.rt, text, layers))
        with self._vectors_lock:
            self._vectors[key] = vector
            while len(self._vectors) > VECTORS_KEPT:
                self._vectors.popitem(last=False)
        return vector

    def _index(self, cam: str) -> ChunkIndex | None:
        """The camera's index as last opened; opened now only the first time it is searched."""
        held = self._open.get(cam) or self._reopen(cam)
        if self._refresher is None:
            self._refresher = threading.Thread(target=self._refresh_forever, name="search-indexes", daemon=True)
            self._refresher.start()
        return held[1] if held else None

    def _reopen(self, cam: str) -> tuple[tuple[int, ...], ChunkIndex] | None:
        """Open the camera's saved index again if its files changed since it was opened (its
        table built here too, not in a search); the index held now, None when there is none."""
        assert self.framelog is not None
        d = Path(self.framelog.root) / cam
        stamp = _stamp(d / META_NAME) + _stamp(d / DELTA_META_NAME)  # a delta is saved without its base
        if not stamp:
            self._open.pop(cam, None)
            return None
        held = self._open.get(cam)
        if held is None or held[0] != stamp:
            index = ChunkIndex.view(d)
            if index is None:
                return held  # unreadable mid-save, say: the last one opened serves until the next
            index.table()
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
