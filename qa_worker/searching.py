"""Searches, answered by any worker with the frames log: the question's vector (the model's own
queries, common/engine/features.py) against every camera's index beside the log.

The indexes are the recorder's (common/chunkindex.py), held and searched in a process of their own
(index_process.py): searched in the worker's process they held its GIL a third of the time and
starved the GPU loop. Here a search is parsed, its question represented, and the ranking asked of
that process. A camera's index holds vectors of one model at some layers: the question is
represented at those layers, once for all cameras alike (a forward on the GPU loop, kept for the
same text asked again); an index of another model than this worker's is not comparable and is left
out with a warning. The chunks of all cameras are ranked by score and made into moments
(moments.py): a camera's adjacent matching chunks are one result. A search sees what the recorder
saved (every `features_save_s`), up to `index_process.REFRESH_S` and an opening later.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from typing import Literal

import numpy as np
import structlog

from common.engine.features import question_vector
from common.engine.params import MAX_QUESTION_TOKENS
from common.engine.runtime import Runtime
from common.wire.schemas import FinalAnswer, SchemaError, SearchHit
from common.wire.search_request import SearchRequest, parse_search
from common.wire.timeref import TimeRef, in_the_future
from qa_worker.index_process import Ended, IndexProcess, Layers

log = structlog.get_logger()

# Question vectors kept, by text and layers: each is a forward on the GPU loop (81 ms a task beside
# 64 cameras, H200), and the same searches come again (a page reloaded, a saved search, an alert).
VECTORS_KEPT = 256


class SearchError(Exception):
    """Why a search cannot be answered: its final's `error` (and `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def search_span(since: TimeRef | None, until: TimeRef | None, asked_at: float) -> tuple[float, float]:
    """The span as capture times: all the log holds without `since`, up to the asking without `until`.
    A `since` after the asking is refused as a question's is (history.span_of), not searched: it
    found nothing, read as "nothing of that span is indexed"."""
    t0 = since.resolve(asked_at) if since is not None else -math.inf
    if future := in_the_future(t0, asked_at, "search"):
        raise SearchError(future, param="since")
    t1 = until.resolve(asked_at) if until is not None else math.inf
    if t1 <= t0:
        raise SearchError("until must be later than since: the span is empty", param="until")
    return t0, t1


class Searcher:
    def __init__(self, rt: Runtime, framelog_dir: str | None):
        self.rt = rt
        self.indexes = IndexProcess(framelog_dir) if framelog_dir is not None else None
        self._vectors: OrderedDict[tuple[str, Layers], np.ndarray] = OrderedDict()  # least recent first
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
        [since, until], best first (`HeldIndexes.moments`)."""
        return self._ranked("moments", text, streams, since, until, limit)

    def chunks(self, text: str, streams: list[str] | None, since: float, until: float, limit: int) -> list[SearchHit]:
        """The `limit` best chunks, one by one (scope history answers over them), best first."""
        return self._ranked("chunks", text, streams, since, until, limit)

    def close(self) -> None:
        """End the index process, if a search started it."""
        if self.indexes is not None:
            self.indexes.close()

    def _ranked(
        self,
        ranking: Literal["moments", "chunks"],
        text: str,
        streams: list[str] | None,
        since: float,
        until: float,
        limit: int,
    ) -> list[SearchHit]:
        """What the index process ranks for the question, represented at the layers of each camera's
        index comparable with this worker's model."""
        if self.indexes is None:
            raise SearchError("this worker has no frames log (framelog_dir): it cannot search")
        try:
            kinds = self.indexes.kinds(streams)
            model = self.rt.loaded.name
            vectors: dict[Layers, np.ndarray] = {}
            cams = []
            for cam, (index_model, layers) in kinds.items():
                if index_model != model:
                    log.warning("search index of another model; left out", stream=cam, model=index_model)
                    continue
                if layers not in vectors:
                    vectors[layers] = self._question(text, layers)
                cams.append(cam)
            if not cams:
                return []
            rank = self.indexes.moments if ranking == "moments" else self.indexes.chunks
            return rank(cams, model, vectors, since, until, limit)
        except Ended:
            raise SearchError("the search process ended; try again") from None

    def _question(self, text: str, layers: Layers) -> np.ndarray:
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
