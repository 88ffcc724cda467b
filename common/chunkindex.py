"""One camera's search index: its chunks' retrieval vectors (common/wire/feature_record.py) beside its
frames log, written by the recorder, read by the workers that answer searches.

Two files in the camera's log directory: ``chunks.usearch``, the vectors in a USearch HNSW graph
(cosine, float16: the library's own file, memory-mapped by readers), and ``chunks.meta``, what each
vector's key is (msgpack: the model and layers every vector was taken at, then one row per chunk:
key, capture-time range, frame seqs, frame count). Both are replaced whole by rename (`save`), the graph first:
a reader or a writer that finds keys in one file and not in the other ignores them (the writer
drops them when it opens), so a crash between the renames loses nothing that was saved before.

Keys count up from 0 (``next_key`` in the meta). A chunk is one (first frame seq, first capture
time): the same chunk encoded again (a stream rebuilt from the log) is not added twice.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
import structlog
from usearch.index import Index

from common.files import fsync_dir
from common.wire.feature_record import ChunkFeatures

log = structlog.get_logger(__name__)

GRAPH_NAME, META_NAME = "chunks.usearch", "chunks.meta"
META_VERSION = 2  # 2: rows hold the frame count
ROW = np.dtype([("key", "<u8"), ("t0", "<f8"), ("t1", "<f8"), ("s0", "<i8"), ("s1", "<i8"), ("n", "<i8")])
EXACT_MAX = 4096  # a time filter leaving at most this many chunks is searched exactly, all of them
# The score of a chunk or question whose vector is all zeros: such a vector has no direction, so
# its cosine with anything is 0 / 0 (NaN, which sorts anywhere and is not JSON, so the search's
# final failed to encode). It resembles nothing, so it ranks last: the lowest cosine there is.
# Kept rather than left out so a search always answers over the same chunks of its span.
NO_DIRECTION = -1.0


@dataclass(frozen=True)
class Match:
    start: float
    end: float
    first_seq: int
    last_seq: int
    frames: int
    score: float  # cosine of question and chunk: the mean over the layers of each layer's


class ChunkIndex:
    """A camera's chunk vectors and rows. A writer's (`open`) grows and saves; a reader's (`view`)
    is memory-mapped and only searched, its rows one array (`table`) and never Python objects a
    row: a worker searches beside its GPU loop, and a day of 64 cameras' chunks (2.8 M) made into
    sets and dicts a search held the GIL for a second each time (H200, 2026-11-28: the GPU 18 %
    busy, 64 % of frames dropped)."""

    def __init__(self, model: str, layers: tuple[int, ...], dim: int, graph: Index | None = None) -> None:
        self.model, self.layers, self.dim = model, layers, dim
        self.graph = graph if graph is not None else Index(ndim=dim, metric="cos", dtype="f16")
        self.rows: dict[int, tuple[float, float, int, int, int]] = {}  # key -> (t0, t1, s0, s1, frames)
        self.chunks: dict[tuple[int, float], int] = {}  # (s0, t0) -> key
        self.next_key = 0
        self.dirty = False
        self._table: np.ndarray | None = None  # the rows as an array (ROW), made again after a change
        self._keys = np.empty(0, dtype=np.uint64)  # the table's keys, contiguous

    @classmethod
    def new_for(cls, f: ChunkFeatures) -> ChunkIndex:
        return cls(f.model, f.layers, f.vector.size)

    def fits(self, f: ChunkFeatures) -> bool:
        """Whether ``f``'s vector is comparable with this index's (same model, layers, size)."""
        return (f.model, f.layers, f.vector.size) == (self.model, self.layers, self.dim)

    def __len__(self) -> int:
        return len(self.table())

    # -- writing -------------------------------------------------------------------------------

    def add(self, f: ChunkFeatures) -> bool:
        """Index one chunk; False if it is there already."""
        return self.extend([f]) == 1

    def extend(self, features: Sequence[ChunkFeatures]) -> int:
        """Index these chunks, the new ones in one call to the graph (built by all its threads:
        a day of a camera's chunks at once); how many were new (one already indexed, or given
        twice, is added once)."""
        new: dict[tuple[int, float], ChunkFeatures] = {}
        for f in features:
            chunk = (f.frame_seqs[0], f.capture_range[0])
            if chunk not in self.chunks:
                new.setdefault(chunk, f)
        if not new:
            return 0
        keys = range(self.next_key, self.next_key + len(new))
        self.graph.add(np.array(keys, dtype=np.uint64), np.stack([f.vector for f in new.values()]))
        for key, (chunk, f) in zip(keys, new.items(), strict=True):
            self.rows[key] = (*f.capture_range, *f.frame_seqs, f.frames)
            self.chunks[chunk] = key
        self.next_key, self.dirty, self._table = keys.stop, True, None
        return len(new)

    def remove_before(self, ts: float) -> int:
        """Forget the chunks captured (from their first frame) before ``ts``; how many."""
        gone = [key for key, (t0, *_) in self.rows.items() if t0 < ts]
        if gone:
            self.graph.remove(np.array(gone, dtype=np.uint64))
            for key in gone:
                t0, _, s0, *_ = self.rows.pop(key)
                del self.chunks[(s0, t0)]
            self.dirty, self._table = True, None
        return len(gone)

    def save(self, d: Path) -> None:
        """Both files replaced whole (written, fsynced, renamed, the directory fsynced)."""
        graph, meta = d / GRAPH_NAME, d / META_NAME
        self.graph.save(str(graph) + ".tmp")
        _fsync(graph.with_name(graph.name + ".tmp"))
        rows = self.table()
        header = {"v": META_VERSION, "model": self.model, "layers": list(self.layers), "dim": self.dim}
        body = msgpack.packb({**header, "next_key": self.next_key, "rows": rows.tobytes()}, use_bin_type=True)
        tmp = meta.with_name(meta.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(graph.with_name(graph.name + ".tmp"), graph)
        os.replace(tmp, meta)
        fsync_dir(d)
        self.dirty = False

    # -- reading -------------------------------------------------------------------------------

    @classmethod
    def open(cls, d: Path) -> ChunkIndex | None:
        """The camera's saved index, to add to (None when there is none, or it does not load:
        then a new one is built, with a warning)."""
        return cls._load(d, view=False)

    @classmethod
    def view(cls, d: Path) -> ChunkIndex | None:
        """The camera's saved index, memory-mapped, to search (None when there is none)."""
        return cls._load(d, view=True)

    @classmethod
    def _load(cls, d: Path, view: bool) -> ChunkIndex | None:
        try:
            meta = msgpack.unpackb((d / META_NAME).read_bytes(), raw=False)
            graph = Index.restore(str(d / GRAPH_NAME), view=view)
            if graph is None or meta.get("v") != META_VERSION:
                raise ValueError("not an index of this version")
            index = cls(meta["model"], tuple(meta["layers"]), int(meta["dim"]), graph)
            rows = np.frombuffer(meta["rows"], dtype=ROW)
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, RuntimeError, msgpack.UnpackException) as e:
            log.warning("search index unreadable; not used", dir=str(d), error=str(e)[:200])
            return None
        index.next_key = int(meta["next_key"])
        in_graph = np.asarray(graph.keys, dtype=np.uint64)
        rows = rows[np.isin(rows["key"], in_graph)]  # a crash between the renames: the graph is the newer one
        if view:
            index._set_table(rows)
            return index
        for key, t0, t1, s0, s1, n in rows.tolist():
            index.rows[key] = (t0, t1, s0, s1, n)
            index.chunks[(s0, t0)] = key
        if len(stray := np.setdiff1d(in_graph, rows["key"])):
            graph.remove(stray)
        return index

    def table(self) -> np.ndarray:
        """The rows (ROW), by key."""
        if self._table is None:
            self._set_table(np.array([(k, *row) for k, row in self.rows.items()], dtype=ROW))
        assert self._table is not None
        return self._table

    def _set_table(self, rows: np.ndarray) -> None:
        keys = np.ascontiguousarray(rows["key"])  # searched: a column of `rows` is strided, copied each time
        if len(keys) > 1 and not (keys[1:] > keys[:-1]).all():  # saved by key: never, unless edited
            order = np.argsort(keys, kind="stable")
            rows, keys = rows[order], keys[order]
        self._table, self._keys = rows, keys

    def search(self, vector: np.ndarray, k: int, since: float = -math.inf, until: float = math.inf) -> list[Match]:
        """The ``k`` chunks nearest to ``vector`` (a question's, features.py) among those whose
        capture range meets [since, until], best first. Few such chunks: all of them are scored
        exactly; many: the HNSW graph is searched wider until ``k`` of its hits fall in the span.
        Rows are handled as arrays throughout: searches run beside the GPU loop, in its process."""
        table = self.table()
        in_span = (table["t1"] >= since) & (table["t0"] <= until)
        inside = np.flatnonzero(in_span)  # rows
        if not len(inside) or k < 1:
            return []
        query = vector.astype(np.float32)
        if not np.linalg.norm(query):  # no direction: every chunk scores NO_DIRECTION, as exactly
            return self._matches(inside[:k], np.full(min(k, len(inside)), NO_DIRECTION))
        if len(inside) <= EXACT_MAX:
            vectors = np.atleast_2d(np.asarray(self.graph.get(self._keys[inside], dtype=np.float32), dtype=np.float32))
            with np.errstate(invalid="ignore", divide="ignore"):
                scores = vectors @ query / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(query))
            scores = np.nan_to_num(scores, nan=NO_DIRECTION)  # a zero chunk vector: 0 / 0
            order = np.argsort(-scores, kind="stable")[:k]
            return self._matches(inside[order], scores[order])
        count = 4 * k
        while True:
            found = self.graph.search(query, min(count, len(self.graph)))
            keys = np.asarray(found.keys, dtype=np.uint64)
            at = np.searchsorted(self._keys, keys).clip(max=len(table) - 1)
            ok = (self._keys[at] == keys) & in_span[at]  # a row of the span (a graph newer than the rows: not)
            rows = at[ok]
            # The graph gives a zero vector cosine distance 1, a score of 0, above every chunk of
            # negative cosine: scored NO_DIRECTION, as the exact search scores it, and moved behind
            # the others (a stable sort: the graph's order otherwise)
            cosine = 1.0 - np.asarray(found.distances, dtype=np.float64)[ok]
            scores = np.where(self._zero(keys[ok]), NO_DIRECTION, cosine)
            if len(rows) >= k or count >= len(self.graph):
                order = np.argsort(-scores, kind="stable")[:k]
                return self._matches(rows[order], scores[order])
            count *= 4

    def _zero(self, keys: np.ndarray) -> np.ndarray:
        """Whether each of these chunks' vectors is all zeros (no direction)."""
        if not len(keys):
            return np.zeros(0, dtype=bool)
        return ~np.atleast_2d(np.asarray(self.graph.get(keys))).any(axis=1)

    def _matches(self, rows: np.ndarray, scores: np.ndarray) -> list[Match]:
        return [
            Match(t0, t1, s0, s1, n, score)
            for (_, t0, t1, s0, s1, n), score in zip(self.table()[rows].tolist(), scores.tolist(), strict=True)
        ]


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
