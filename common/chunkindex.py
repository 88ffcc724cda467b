"""One camera's search index: its chunks' retrieval vectors (common/wire/feature_record.py) beside its
frames log, written by the recorder, read by the workers that answer searches.

Two files in the camera's log directory: ``chunks.usearch``, the vectors in a USearch HNSW graph
(cosine, float16: the library's own file, memory-mapped by readers), and ``chunks.meta``, what each
vector's key is (msgpack: the model and layers every vector was taken at, then one row per chunk:
key, capture-time range, frame seqs, frame count). That pair is the base; beside it a second pair,
``chunks.delta.*``, holds the chunks added since the base and the time before which retention
removed the base's chunks since: a save writes only the delta until it passes `DELTA_SHARE` of the
index, then a new base (a day of a camera's vectors is 88 MB at 3B: written whole every 30 s it
was 3.2 MB/s a camera). Each file is replaced whole by rename (`save`), a graph before its meta:
a reader or a writer that finds keys in one file and not in the other ignores them (the writer
drops them when it opens), so a crash between the renames loses nothing that was saved before; a
delta names the base it follows (its next key), so one left beside a newer base is not used.

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
from usearch.index import Index, MetricKind
from usearch.index import search as exact_search

from common.files import fsync_dir
from common.wire.feature_record import ChunkFeatures

log = structlog.get_logger(__name__)

GRAPH_NAME, META_NAME = "chunks.usearch", "chunks.meta"
DELTA_GRAPH_NAME, DELTA_META_NAME = "chunks.delta.usearch", "chunks.delta.meta"
# A save writes only the chunks added since the base (the delta) until they are more than this share
# of the index, or DELTA_MIN_CHUNKS: rewriting a camera-day's whole index (88 MB at 3B) every
# `features_save_s` wrote 3.2 MB/s a camera (H200, 64 cameras, 2026-11-28)
DELTA_SHARE = 1 / 16
DELTA_MIN_CHUNKS = 2048
META_VERSION = 2  # 2: rows hold the frame count
ROW = np.dtype([("key", "<u8"), ("t0", "<f8"), ("t1", "<f8"), ("s0", "<i8"), ("s1", "<i8"), ("n", "<i8")])
EXACT_MAX = 4096  # a time filter leaving at most this many chunks is searched exactly, all of them
# The newest chunks' vectors a searched index keeps in memory (4 MB a camera at 3B's 1,024 float16;
# 2,048 chunks are 68 minutes at 2 fps): a span searched exactly reads its vectors, and read from
# the graph a camera-hour's took 4.5 ms of held GIL (one array a vector, then stacked).
TAIL_ROWS = 2048
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
    row: a day of 64 cameras' chunks (2.8 M) made into sets and dicts a search held the GIL for a
    second each time (H200, 2026-11-28, when searches ran beside the GPU loop: the GPU 18 % busy,
    64 % of frames dropped; they now run in a process of their own, qa_worker/index_process.py)."""

    def __init__(self, model: str, layers: tuple[int, ...], dim: int, graph: Index | None = None) -> None:
        self.model, self.layers, self.dim = model, layers, dim
        self.graph = graph if graph is not None else Index(ndim=dim, metric="cos", dtype="f16")
        self.rows: dict[int, tuple[float, float, int, int, int]] = {}  # key -> (t0, t1, s0, s1, frames)
        self.chunks: dict[tuple[int, float], int] = {}  # (s0, t0) -> key
        self.next_key = 0
        self.dirty = False
        self._table: np.ndarray | None = None  # the rows as an array (ROW), made again after a change
        self._keys = np.empty(0, dtype=np.uint64)  # the table's keys, contiguous
        self._tail: tuple[np.ndarray, np.ndarray] | None = None  # (the table, its last TAIL_ROWS' vectors)
        # On disk, a base and a delta: the base holds keys below `base_next_key` (None: no base
        # written yet); the delta the chunks added since, and `removed_before`, what retention
        # removed from the base since (its rows stay in the base's files until the next base)
        self.base_next_key: int | None = None
        self.removed_before = -math.inf
        self.delta: ChunkIndex | None = None  # a reader's: the delta's chunks, searched beside its own

    @classmethod
    def new_for(cls, f: ChunkFeatures) -> ChunkIndex:
        return cls(f.model, f.layers, f.vector.size)

    def fits(self, f: ChunkFeatures) -> bool:
        """Whether ``f``'s vector is comparable with this index's (same model, layers, size)."""
        return (f.model, f.layers, f.vector.size) == (self.model, self.layers, self.dim)

    def __len__(self) -> int:
        return len(self.table()) + (len(self.delta) if self.delta is not None else 0)

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
        self.removed_before = max(self.removed_before, ts)
        return len(gone)

    def save(self, d: Path) -> None:
        """What changed since the last save, on disk: the chunks added since the base as the delta
        (its two files replaced whole), or, with no base yet or a delta past its share, everything
        as a new base and no delta. Each file is written, fsynced and renamed, the graph before
        its meta, and the directory fsynced: a crash at any point leaves a readable index."""
        table = self.table()
        new = table if self.base_next_key is None else table[table["key"] >= self.base_next_key]
        if self.base_next_key is None or len(new) > max(DELTA_MIN_CHUNKS, DELTA_SHARE * len(self.rows)):
            self._write(d, GRAPH_NAME, META_NAME, self.graph, table, {})
            for name in (DELTA_META_NAME, DELTA_GRAPH_NAME):  # the meta first: no delta without its graph
                (d / name).unlink(missing_ok=True)
            fsync_dir(d)
            self.base_next_key, self.removed_before = self.next_key, -math.inf
        else:
            graph = Index(ndim=self.dim, metric="cos", dtype="f16")
            if len(new):
                keys = np.ascontiguousarray(new["key"])
                graph.add(keys, np.atleast_2d(np.asarray(self.graph.get(keys))))
            base = {"base_next_key": self.base_next_key, "removed_before": self.removed_before}
            self._write(d, DELTA_GRAPH_NAME, DELTA_META_NAME, graph, new, base)
        self.dirty = False

    def _write(self, d: Path, graph_name: str, meta_name: str, graph: Index, rows: np.ndarray, extra: dict) -> None:
        path, meta = d / graph_name, d / meta_name
        graph.save(str(path) + ".tmp")
        _fsync(path.with_name(path.name + ".tmp"))
        header = {"v": META_VERSION, "model": self.model, "layers": list(self.layers), "dim": self.dim}
        body = msgpack.packb({**header, **extra, "next_key": self.next_key, "rows": rows.tobytes()}, use_bin_type=True)
        tmp = meta.with_name(meta.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path.with_name(path.name + ".tmp"), path)
        os.replace(tmp, meta)
        fsync_dir(d)

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
        """The base, then the delta that belongs to it, if any (one written for an older base, left
        by a crash before its removal, is not used)."""
        loaded = cls._files(d, GRAPH_NAME, META_NAME, view)
        if loaded is None:
            return None
        index, rows, _ = loaded
        index.base_next_key = index.next_key
        delta = cls._files(d, DELTA_GRAPH_NAME, DELTA_META_NAME, view)
        follows = (index.next_key, index.model, index.layers, index.dim)
        if (
            delta is not None
            and (delta[2].get("base_next_key"), delta[0].model, delta[0].layers, delta[0].dim) != follows
        ):
            delta = None  # another base's
        if delta is not None:
            index.removed_before = delta[2]["removed_before"]
            rows = rows[rows["t0"] >= index.removed_before]
        if view:
            index._set_table(rows)
            if delta is not None:
                index.delta = delta[0]
                index.delta._set_table(delta[1])
            return index
        index._adopt(rows)
        if delta is not None:
            d_index, d_rows, d_meta = delta
            if len(d_rows):  # a delta of removals alone has none
                index.graph.add(d_rows["key"], np.atleast_2d(np.asarray(d_index.graph.get(d_rows["key"]))))
            index._adopt(d_rows)
            index.next_key = int(d_meta["next_key"])
        if len(stray := np.setdiff1d(np.asarray(index.graph.keys, dtype=np.uint64), index.table()["key"])):
            index.graph.remove(stray)  # a crash between the renames, or rows retention removed
        return index

    @classmethod
    def _files(cls, d: Path, graph_name: str, meta_name: str, view: bool) -> tuple[ChunkIndex, np.ndarray, dict] | None:
        """One graph and its meta: (an index of its graph, its rows that the graph holds, the meta)."""
        at = meta_name  # the file being read: the one a warning names (it named the meta, the graph damaged)
        try:
            meta = msgpack.unpackb((d / meta_name).read_bytes(), raw=False)
            if not isinstance(meta, dict):
                raise TypeError("its meta is not a map")
            if meta.get("v") != META_VERSION:
                raise ValueError("not an index of this version")
            model, layers, dim = meta["model"], tuple(meta["layers"]), int(meta["dim"])
            rows = np.frombuffer(meta["rows"], dtype=ROW)
            next_key = int(meta["next_key"])
            if meta_name == DELTA_META_NAME:  # what _load reads of a delta's, checked here with the rest
                meta["removed_before"] = float(meta["removed_before"])
            at = graph_name
            graph = Index.restore(str(d / graph_name), view=view)
            if graph is None:
                raise ValueError("not a graph of this version")
            if graph.ndim != dim:  # a graph of another index's: every search and add of it raised
                raise ValueError(f"its graph holds vectors of {graph.ndim} dimensions, its meta says {dim}")
            index = cls(model, layers, dim, graph)
            index.next_key = next_key
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, OverflowError, RuntimeError, msgpack.UnpackException) as e:
            log.warning("search index unreadable; not used", dir=str(d), file=at, error=str(e)[:200])
            return None
        in_graph = np.asarray(graph.keys, dtype=np.uint64)
        return index, rows[np.isin(rows["key"], in_graph)], meta  # a crash between the renames: the graph is newer

    def _adopt(self, rows: np.ndarray) -> None:
        """A writer's rows from its files."""
        for key, t0, t1, s0, s1, n in rows.tolist():
            self.rows[key] = (t0, t1, s0, s1, n)
            self.chunks[(s0, t0)] = key
        self._table = None

    def every_row(self) -> np.ndarray:
        """The rows (ROW) a search sees: the base's, then the delta's."""
        return self.table() if self.delta is None else np.concatenate([self.table(), self.delta.table()])

    def table(self) -> np.ndarray:
        """The rows (ROW), by key (a reader's own: its delta has its own)."""
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
        """The ``k`` chunks nearest to ``vector`` in the span, of the base and the delta alike."""
        found = self._search_own(vector, k, since, until)
        if self.delta is not None:  # ties: the base's first, as one index's stable order would
            found = sorted(found + self.delta._search_own(vector, k, since, until), key=lambda m: -m.score)[:k]
        return found

    def _search_own(self, vector: np.ndarray, k: int, since: float, until: float) -> list[Match]:
        """The ``k`` chunks nearest to ``vector`` (a question's, features.py) among those whose
        capture range meets [since, until], best first. Few such chunks: all of them are scored
        exactly; many: the HNSW graph is searched wider until ``k`` of its hits fall in the span.
        Rows are handled as arrays throughout: a day of 64 cameras' rows as Python objects held the
        GIL for a second (`ChunkIndex`)."""
        table = self.table()
        in_span = (table["t1"] >= since) & (table["t0"] <= until)
        inside = np.flatnonzero(in_span)  # rows
        if not len(inside) or k < 1:
            return []
        query = vector.astype(np.float32)
        if not np.linalg.norm(query):  # no direction: every chunk scores NO_DIRECTION, as exactly
            return self._matches(inside[:k], np.full(min(k, len(inside)), NO_DIRECTION))
        if len(inside) <= EXACT_MAX:
            # The vectors as stored (float16), scored by the library's own brute force: read as
            # float32 and scored in numpy, a last-hour search of 64 cameras took 0.66 s (2 cores)
            vectors = self._vectors(inside)
            count = min(k, len(inside))
            # the query as the vectors are, float16, as the graph's search takes it: converted
            # for every vector otherwise (0.82 against 0.58 ms a camera-hour, 2 cores)
            query16 = query.astype(np.float16)
            while True:
                found = exact_search(vectors, query16, count, MetricKind.Cos, exact=True, threads=1)
                at = np.asarray(found.keys, dtype=np.int64)
                zero = ~vectors[at].any(axis=1)
                if not zero.any() or count == len(inside):
                    break
                count = len(inside)  # the library scores a zero vector 0: rank them all, it goes last
            cosine = 1.0 - np.asarray(found.distances, dtype=np.float64)
            scores = np.where(zero, NO_DIRECTION, cosine)
            order = np.lexsort((at, -scores))[:k]  # best first; ties in row order, as the table's
            return self._matches(inside[at[order]], scores[order])
        # As many hits as should hold k of the span, were the span's chunks spread evenly over the
        # graph's (a whole day: k; a tenth of it: 10 k), at least k; more while too few fall in
        # it. A search for 4 k where k do: twice the graph's work (random vectors, 43,200 chunks).
        count = max(k, math.ceil(1.25 * k * len(table) / len(inside)))
        while True:
            found = self.graph.search(query, min(count, len(self.graph)))
            keys = np.asarray(found.keys, dtype=np.uint64)
            at = np.searchsorted(self._keys, keys).clip(max=len(table) - 1)
            ok = (self._keys[at] == keys) & in_span[at]  # a row of the span (a graph newer than the rows: not)
            rows = at[ok]
            # The graph gives a zero vector cosine distance 1, a score of 0, above every chunk of
            # negative cosine: scored NO_DIRECTION, as the exact search scores it, and moved behind
            # the others (a stable sort: the graph's order otherwise). Only a distance of exactly
            # 1 can be one: only those hits' vectors are read to know.
            distances = np.asarray(found.distances, dtype=np.float64)[ok]
            zero = distances == 1.0
            zero[zero] = self._zero(keys[ok][zero])
            scores = np.where(zero, NO_DIRECTION, 1.0 - distances)
            if len(rows) >= k or count >= len(self.graph):
                order = np.argsort(-scores, kind="stable")[:k]
                return self._matches(rows[order], scores[order])
            count *= 4

    def prepare(self) -> None:
        """Build now what a search would (the table, the newest vectors), for it and its delta."""
        for index in (self, self.delta):
            if index is not None:
                index._vectors(np.empty(0, dtype=np.int64))

    def _vectors(self, rows: np.ndarray) -> np.ndarray:
        """The vectors of ``rows`` (ascending) as stored, (len(rows), dim): the newest TAIL_ROWS
        from memory, kept while this table is; older ones read from the graph."""
        table = self.table()
        first = max(0, len(table) - TAIL_ROWS)
        if self._tail is None or self._tail[0] is not table:
            self._tail = (table, self._read(self._keys[first:]))
        old = rows[rows < first]
        newer = rows[len(old) :] - first
        if len(newer) and newer[-1] - newer[0] == len(newer) - 1:  # a span's newest rows, in a row:
            new = self._tail[1][newer[0] : newer[-1] + 1]  # a view, not a copy (0.7 ms a camera-hour)
        else:
            new = self._tail[1][newer]
        return np.concatenate([self._read(self._keys[old]), new]) if len(old) else new

    def _read(self, keys: np.ndarray) -> np.ndarray:
        return np.asarray(self.graph.get(keys)).reshape(len(keys), self.dim)

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
