"""Search features kept with the frames log, on a real redis-server, real files, the real index
library (USearch) and a tiny random-weight model: the encoder publishes each chunk's vector, the
recorder indexes it beside the camera's log; the index survives a restart (and a crash between its
two files), and retention removes the vectors of the frames it deletes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from common import redisio
from common.chunkindex import ChunkIndex
from common.engine.grid import Grid
from common.engine.model import load_model
from common.engine.runtime import Runtime
from common.segment_store import DirectoryStore
from common.wire import keys
from common.wire.feature_record import ChunkFeatures, decode_features, encode_features
from common.wire.schemas import FrameMsg, encode_frame
from encoder_worker.config import EncoderConfig
from encoder_worker.service import EncoderService
from recorder import service as recorder_service
from recorder.config import RecorderConfig
from tests.engine_helpers import make_frames
from tests.retrieval_oracle import chunk_means
from tests.test_features import unit_layers
from tests.test_persistence import encoded, run_until, stop

CAM = "cam"
GRID = Grid(56, 56)
FPS, CHUNK = 2.0, 4
T0 = 1_700_000_000.0  # capture times in the past: the recorder refuses frames stamped ahead of its clock
LAYERS = (0, 1)


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


def push_frames(r: redis.Redis, frames: list[np.ndarray], seqs: range) -> None:
    for s in seqs:
        r.xadd(keys.frames(CAM), encode_frame(FrameMsg.from_rgb(s, T0 + s / FPS, s / FPS, frames[s])))


def encoder(rt: Runtime, r: redis.Redis, url: str, tmp_path: Path, cam: str = CAM) -> EncoderService:
    r.hset(keys.meta(cam), mapping={"fps": FPS, "height": GRID.height, "width": GRID.width, "live": 0})
    cfg = EncoderConfig(redis_url=url, streams=(cam,), consumer="enc", chunk_frames=CHUNK, block_ms=50)
    return EncoderService(cfg, rt, r, DirectoryStore(tmp_path / "segments"))


def recorder(url: str, log_dir: Path, **settings) -> recorder_service.Recorder:
    options = dict(streams=(CAM,), framelog_sync_s=0.05, features_save_s=0.05, block_ms=50) | settings
    cfg = RecorderConfig(framelog_dir=str(log_dir), **options)
    rec = recorder_service.Recorder(cfg, redisio.connect(url, block_ms=50))
    rec.open_writers()
    return rec


def end(rec: recorder_service.Recorder) -> None:
    """The process is gone (exit or crash): its log lock with it."""
    for w in rec.writers.values():
        w.close()


def unacked_features(r: redis.Redis, cam: str = CAM) -> int:
    groups = {redisio.text(g["name"]): g for g in r.xinfo_groups(keys.features(cam))}
    g = groups.get(keys.RECORDER_GROUP)
    return r.xlen(keys.features(cam)) if g is None else int(g.get("lag") or 0) + int(g["pending"])


def step_until(rec: recorder_service.Recorder, check, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        rec.step()


def saved(log_dir: Path) -> ChunkIndex:
    index = ChunkIndex.view(log_dir / CAM)
    assert index is not None
    return index


def rows(index: ChunkIndex) -> list[tuple[int, int]]:
    return sorted((s0, s1) for _, _, _, s0, s1, _ in index.every_row().tolist())


def test_encoded_chunks_are_indexed_beside_the_frames_log_with_the_models_vectors(rt, redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    frames = make_frames(16, GRID, seed=5)
    svc = encoder(rt, r, redis_url, tmp_path)
    push_frames(r, frames, range(16))
    run_until(svc, lambda: encoded(r, CAM, 15), "16 frames")
    stop(svc, r)

    published = [decode_features(f) for _, f in r.xrange(keys.features(CAM))]
    assert [f.frame_seqs for f in published] == [(0, 3), (4, 7), (8, 11), (12, 15)]
    assert published[1].capture_range == (T0 + 2.0, T0 + 3.5) and published[1].frames == 4
    assert {(f.model, f.layers) for f in published} == {("tiny-random", svc.owned[CAM].engine.feature_layers)}
    oracle = chunk_means(rt, frames, GRID, FPS, CHUNK, published[0].layers)
    for f, means in zip(published, oracle, strict=True):
        np.testing.assert_allclose(f.vector.astype(np.float32), unit_layers(means), atol=2e-3)

    rec = recorder(redis_url, tmp_path / "log")
    step_until(rec, lambda: unacked_features(r) == 0, "the features acked")
    index = saved(tmp_path / "log")
    assert rows(index) == [(0, 3), (4, 7), (8, 11), (12, 15)]
    assert (index.model, index.layers) == ("tiny-random", published[0].layers)
    for f in published:  # the index holds the published vectors, each found as its own nearest
        (best,) = index.search(f.vector, 1)
        assert (best.first_seq, best.start, best.end) == (f.frame_seqs[0], *f.capture_range)
        assert best.score == pytest.approx(1.0, abs=1e-3)


def planted(seq: int, vector: np.ndarray, model: str = "tiny-random") -> ChunkFeatures:
    """A chunk of 4 frames from ``seq``, captured at T0 + seq / FPS, with ``vector``."""
    return ChunkFeatures((T0 + seq / FPS, T0 + (seq + 3) / FPS), (seq, seq + 3), 4, model, LAYERS, vector)


def vectors(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 64)).astype(np.float16)


def send(r: redis.Redis, features: list[ChunkFeatures]) -> None:
    for f in features:
        r.xadd(keys.features(CAM), encode_features(f))


def test_the_index_survives_a_restart_and_a_crash_before_its_save(redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    vs = vectors(6)
    send(r, [planted(4 * i, vs[i]) for i in range(3)])
    rec = recorder(redis_url, tmp_path)
    step_until(rec, lambda: unacked_features(r) == 0, "the first three saved and acked")
    end(rec)
    # a second life reads three more but dies before saving: nothing acked, nothing lost
    send(r, [planted(4 * i, vs[i]) for i in range(3, 6)])
    crashed = recorder(redis_url, tmp_path, features_save_s=3600)
    step_until(crashed, lambda: len(crashed.indexes.index_of(CAM) or ()) == 6, "the next three read")
    assert rows(saved(tmp_path)) == [(0, 3), (4, 7), (8, 11)]
    assert unacked_features(r) == 3
    end(crashed)
    again = recorder(redis_url, tmp_path)
    step_until(again, lambda: unacked_features(r) == 0, "the pending three read again and saved")
    index = saved(tmp_path)
    assert rows(index) == [(0, 3), (4, 7), (8, 11), (12, 15), (16, 19), (20, 23)], "each chunk once"
    assert index.search(vs[4], 1)[0].first_seq == 16
    # the same chunk again (a stream rebuilt from the log re-encodes it) is not added twice
    send(r, [planted(8, vs[0])])
    step_until(again, lambda: unacked_features(r) == 0, "the duplicate acked")
    assert len(saved(tmp_path)) == 6


def test_retention_removes_the_vectors_of_the_files_it_deletes(redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    frames = make_frames(16, GRID, seed=1)
    rec = recorder(redis_url, tmp_path, framelog_roll_s=0.2, retention_hours=1.0, collect_every_s=3600)
    push_frames(r, frames, range(8))
    step_until(rec, lambda: rec.log.span(CAM) is not None and rec.log.span(CAM).frames == 8, "the first file")
    time.sleep(0.3)  # the next frames roll to a second file
    push_frames(r, frames, range(8, 16))
    vs = vectors(4, seed=2)
    send(r, [planted(4 * i, vs[i]) for i in range(4)])
    step_until(rec, lambda: rec.log.span(CAM).frames == 16 and unacked_features(r) == 0, "frames and vectors")
    assert rec.log.span(CAM).files == 2
    first = min((tmp_path / CAM).glob("*.log"))
    old = time.time() - 2 * 3600
    os.utime(first, (old, old))
    rec.last_collect = float("-inf")
    rec.step()
    assert rec.log.span(CAM).first_seq == 8, "the older file is gone"
    assert rows(saved(tmp_path)) == [(8, 11), (12, 15)], "and the vectors of its frames, saved at once"
    assert rec.indexes.index_of(CAM).search(vs[0], 4)[0].first_seq != 0


def test_vectors_of_another_model_start_the_index_anew_with_an_event(redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    vs = vectors(3)
    send(r, [planted(0, vs[0]), planted(4, vs[1]), planted(8, vs[2], model="another")])
    rec = recorder(redis_url, tmp_path)
    step_until(rec, lambda: unacked_features(r) == 0, "all acked")
    index = saved(tmp_path)
    assert (index.model, rows(index)) == ("another", [(8, 11)])
    (event,) = [f for _, f in r.xrange(keys.events(CAM)) if f[b"type"] == b"search_index_reset"]
    assert event[b"was_model"] == b"tiny-random" and event[b"chunks"] == b"2"


def test_a_planted_match_ranks_first_and_scores_are_ordered_exactly_and_through_the_graph(tmp_path, monkeypatch):
    from common import chunkindex

    vs = vectors(300, seed=3)
    index = ChunkIndex("tiny-random", LAYERS, 64)
    for i, v in enumerate(vs):
        index.add(planted(4 * i, v))
    question = vectors(1, seed=9)[0].astype(np.float32)
    index.add(planted(4 * 300, question.astype(np.float16)))  # planted to match
    exact = index.search(question, 10)
    assert exact[0].first_seq == 1200 and exact[0].score == pytest.approx(1.0, abs=1e-3)
    scores = [m.score for m in exact]
    assert scores == sorted(scores, reverse=True)
    cosines = sorted(
        (
            float(v.astype(np.float32) @ question / np.linalg.norm(v.astype(np.float32)) / np.linalg.norm(question))
            for v in vs
        ),
        reverse=True,
    )
    np.testing.assert_allclose(scores[1:], cosines[:9], atol=1e-3)
    span = index.search(question, 3, since=T0 + 20, until=T0 + 40)  # chunks meeting 20..40 s only
    assert all(m.end >= T0 + 20 and m.start <= T0 + 40 for m in span) and len(span) == 3
    assert index.search(question, 3, since=T0 + 10_000) == [], "nothing in the span: no match"
    monkeypatch.setattr(chunkindex, "EXACT_MAX", 0)  # the graph's search, widened until k fall in the span
    graph = index.search(question, 10)
    assert [m.first_seq for m in graph[:3]] == [m.first_seq for m in exact[:3]]
    assert [m.first_seq for m in index.search(question, 3, since=T0 + 20, until=T0 + 40)] == [m.first_seq for m in span]


def test_a_crash_between_the_two_files_leaves_a_consistent_index(tmp_path):
    vs = vectors(3)
    index = ChunkIndex("tiny-random", LAYERS, 64)
    index.add(planted(0, vs[0]))
    index.save(tmp_path)
    index.add(planted(4, vs[1]))
    index.graph.save(str(tmp_path / "chunks.usearch"))  # the graph renamed, the meta not yet
    reopened = ChunkIndex.open(tmp_path)
    assert rows(reopened) == [(0, 3)] and len(reopened.graph) == 1, "the stray vector dropped"
    reopened.add(planted(8, vs[2]))
    assert reopened.search(vs[2], 1)[0].first_seq == 8


@pytest.mark.parametrize("damage", ["no next_key", "next_key inf", "a list", "delta without removed_before"])
def test_a_meta_of_wellformed_msgpack_but_wrong_values_is_unreadable_not_a_raised_error(tmp_path, damage):
    """Its map checked with the rest: a meta without next_key, with an infinite one, or not a map
    at all escaped ChunkIndex.open from the recorder's step (and again after every restart)."""
    import msgpack

    from common.chunkindex import DELTA_META_NAME, META_NAME

    index = ChunkIndex("tiny-random", LAYERS, 64)
    index.add(planted(0, vectors(1)[0]))
    index.save(tmp_path)
    index.add(planted(4, vectors(2)[1]))
    index.save(tmp_path)  # a delta beside the base
    name = DELTA_META_NAME if damage.startswith("delta") else META_NAME
    meta = msgpack.unpackb((tmp_path / name).read_bytes(), raw=False)
    assert ChunkIndex.open(tmp_path) is not None
    damaged = {
        "no next_key": {k: v for k, v in meta.items() if k != "next_key"},
        "next_key inf": meta | {"next_key": float("inf")},
        "a list": [meta],
        "delta without removed_before": {k: v for k, v in meta.items() if k != "removed_before"},
    }[damage]
    (tmp_path / name).write_bytes(msgpack.packb(damaged))
    if name == META_NAME:
        assert ChunkIndex.open(tmp_path) is None and ChunkIndex.view(tmp_path) is None
    else:  # the base alone is used
        assert rows(ChunkIndex.open(tmp_path)) == [(0, 3)]


def test_a_graph_of_another_dimension_than_its_meta_is_unreadable_and_the_recorder_builds_anew(redis_url, tmp_path):
    """A graph file of another index's (32 dimensions beside a meta of 64: restored from another
    backup, say) was taken as the index: the recorder's add of the next chunk raised from its step
    (after every restart: a crash loop), and every search over the camera raised. Now it is unreadable,
    with a warning: the recorder starts the index anew and a search leaves it out."""
    r = redis.Redis.from_url(redis_url)
    other = ChunkIndex("tiny-random", LAYERS, 32)
    other.add(planted(0, np.ones(32, dtype=np.float16)))
    other.save(tmp_path)
    graph32 = (tmp_path / "chunks.usearch").read_bytes()
    index = ChunkIndex("tiny-random", LAYERS, 64)
    index.add(planted(0, vectors(1)[0]))
    (tmp_path / CAM).mkdir()
    index.save(tmp_path / CAM)
    (tmp_path / CAM / "chunks.usearch").write_bytes(graph32)
    assert ChunkIndex.view(tmp_path / CAM) is None and ChunkIndex.open(tmp_path / CAM) is None
    vs = vectors(3, seed=5)
    send(r, [planted(4 * i, vs[i]) for i in range(3)])
    rec = recorder(redis_url, tmp_path)
    step_until(rec, lambda: unacked_features(r) == 0, "the new chunks saved and acked")
    end(rec)
    rebuilt = saved(tmp_path)
    assert (rebuilt.dim, rows(rebuilt)) == (64, [(0, 3), (4, 7), (8, 11)])
    assert rebuilt.search(vs[2], 1)[0].first_seq == 8


@pytest.mark.parametrize("damaged", ["graph", "meta", "graph of another dimension"])
def test_an_unreadable_index_names_the_file_at_fault(tmp_path, damaged):
    """The warning named the meta file whatever was wrong, a damaged graph file included: the
    operator restored or removed the wrong file."""
    from structlog.testing import capture_logs

    from common.chunkindex import GRAPH_NAME, META_NAME

    index = ChunkIndex("tiny-random", LAYERS, 64)
    index.add(planted(0, vectors(1)[0]))
    index.save(tmp_path)
    if damaged == "graph":
        (tmp_path / GRAPH_NAME).write_bytes(b"\0" * 64)
    elif damaged == "meta":
        (tmp_path / META_NAME).write_bytes(b"\xc1")  # a byte msgpack never uses
    else:
        other = ChunkIndex("tiny-random", LAYERS, 32)
        other.add(planted(0, np.ones(32, dtype=np.float16)))
        (tmp_path / "other").mkdir()
        other.save(tmp_path / "other")
        (tmp_path / GRAPH_NAME).write_bytes((tmp_path / "other" / GRAPH_NAME).read_bytes())
    with capture_logs() as logs:
        assert ChunkIndex.open(tmp_path) is None
    (warning,) = [e for e in logs if e["event"] == "search index unreadable; not used"]
    assert warning["file"] == (META_NAME if damaged == "meta" else GRAPH_NAME)


def test_chunks_added_at_once_are_indexed_as_one_by_one(tmp_path):
    """`extend` (a day of chunks in one call to the graph) keeps what `add` keeps: the same rows
    under the same keys, each chunk once (given twice, or indexed already), each vector its own
    nearest; and it survives a save like any index."""
    vs = vectors(40, seed=5)
    chunks = [planted(4 * i, v) for i, v in enumerate(vs)]
    one_by_one = ChunkIndex("tiny-random", LAYERS, 64)
    assert [one_by_one.add(f) for f in chunks[:30]] == [True] * 30
    at_once = ChunkIndex("tiny-random", LAYERS, 64)
    assert at_once.extend([*chunks[:30], chunks[3]]) == 30, "a chunk given twice, once"
    assert at_once.rows == one_by_one.rows and at_once.next_key == one_by_one.next_key == 30
    assert at_once.extend(chunks[25:]) == 10, "those indexed already are left out"
    assert at_once.extend([]) == 0 and not at_once.add(chunks[0])
    (tmp_path / CAM).mkdir()
    at_once.save(tmp_path / CAM)
    reopened = saved(tmp_path)
    assert rows(reopened) == [(4 * i, 4 * i + 3) for i in range(40)]
    for i in (0, 29, 39):
        assert reopened.search(vs[i], 1)[0].first_seq == 4 * i


def test_a_search_uses_the_index_it_holds_while_a_newer_save_is_opened_beside_it(tmp_path):
    """Searches never open an index the recorder saved again (every camera's at once, every
    features_save_s): the one held serves until the index process's thread has opened the new save
    (its indexes held here, in the test's process)."""
    from qa_worker import index_process

    vs = vectors(3)
    index = ChunkIndex("tiny-random", LAYERS, 64)
    index.add(planted(0, vs[0]))
    (tmp_path / CAM).mkdir()
    index.save(tmp_path / CAM)
    held_indexes = index_process.HeldIndexes(tmp_path)
    first = held_indexes.index(CAM)
    assert first is not None and rows(first) == [(0, 3)]
    index.add(planted(4, vs[1]))
    index.save(tmp_path / CAM)
    assert held_indexes.index(CAM) is first, "the search did not wait for the newer save to open"
    deadline = time.monotonic() + 10 * index_process.REFRESH_S
    while (held := held_indexes.index(CAM)) is first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held is not first and rows(held) == [(0, 3), (4, 7)]
    assert held.search(vs[1], 1)[0].first_seq == 4


def test_a_zero_vector_scores_lowest_and_the_search_still_answers(tmp_path, monkeypatch):
    """A chunk or question vector of all zeros has no direction: its cosine was 0 / 0, a NaN that
    sorted anywhere and made the search's final fail to encode (JSON has no NaN). It scores
    NO_DIRECTION (-1), last, exactly and through the graph alike."""
    from common import chunkindex
    from common.wire.schemas import FinalAnswer, SearchHit, decode_final, encode_final

    vs = vectors(20, seed=4)
    vs[:, :32] = -vs[:, :32]
    index = ChunkIndex("tiny-random", LAYERS, 64)
    for i, v in enumerate(vs):
        index.add(planted(4 * i, v))
    index.add(planted(4 * 20, np.zeros(64, np.float16)))
    question = np.ones(64, np.float32)

    def searched(q: np.ndarray) -> list[chunkindex.Match]:
        found = index.search(q, 21)
        hits = tuple(SearchHit.chunk(CAM, m.start, m.end, m.score, m.first_seq, m.last_seq, m.frames) for m in found)
        assert decode_final(encode_final(FinalAnswer(id="q", stream=CAM, text="", hits=hits))).hits == hits
        return found

    for exact_max in (chunkindex.EXACT_MAX, 0):
        monkeypatch.setattr(chunkindex, "EXACT_MAX", exact_max)
        found = searched(question)
        assert len(found) == 21 and found[-1].first_seq == 80 and found[-1].score == chunkindex.NO_DIRECTION
        assert min(m.score for m in found[:-1]) < 0, "chunks of negative cosine rank above the zero one"
        assert [m.score for m in searched(np.zeros(64, np.float32))] == [chunkindex.NO_DIRECTION] * 21


@pytest.mark.parametrize("tail", [0, 8, 2048], ids=["read", "both", "kept"])
def test_the_exact_search_equals_numpy_cosines_and_a_zero_vector_takes_no_place_of_a_negative_one(
    tmp_path, monkeypatch, tail
):
    """A span searched exactly is scored by the index library's brute force over the stored
    vectors (the newest TAIL_ROWS kept in memory, older ones read from the graph): the same
    chunks, order and scores as cosines taken here in numpy, where the library scores a zero
    vector 0, above every negative cosine: asked for fewer than the span holds, it must still
    leave the zero one out for a chunk of negative cosine."""
    from common import chunkindex

    monkeypatch.setattr(chunkindex, "TAIL_ROWS", tail)
    vs = vectors(30, seed=5)
    vs[:, :40] = -vs[:, :40]  # many negative cosines against the question below
    vs[7] = 0
    index = ChunkIndex("tiny-random", LAYERS, 64)
    for i, v in enumerate(vs):
        index.add(planted(4 * i, v))
    question = np.ones(64, np.float32)
    stored = vs.astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        cosines = np.nan_to_num(stored @ question / (np.linalg.norm(stored, axis=1) * np.linalg.norm(question)), nan=-1)
    want = np.argsort(-cosines, kind="stable")[:28]
    assert cosines[want[-1]] < 0 and 7 not in want  # the 28th best is negative; the zero one is last of all
    found = index.search(question, 28)
    assert [m.first_seq for m in found] == [4 * int(i) for i in want]
    assert np.allclose([m.score for m in found], cosines[want], atol=1e-3)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _found(index: ChunkIndex, question: np.ndarray, k: int = 12) -> list[tuple[int, float]]:
    return [(m.first_seq, round(m.score, 4)) for m in index.search(question.astype(np.float32), k)]


def test_a_save_writes_what_was_added_until_the_delta_is_folded_into_a_new_base(tmp_path, monkeypatch):
    """Rewriting a camera-day's whole index every save wrote 3.2 MB/s a camera (H200, 2026-11-28).
    A save writes the chunks added since the base (the delta), the base's files untouched, until
    the delta passes its share; then one new base and no delta. A reader and a reopened writer see
    every chunk once, and a search finds what one index holding them all finds."""
    from common import chunkindex

    monkeypatch.setattr(chunkindex, "DELTA_MIN_CHUNKS", 8)
    d = tmp_path / CAM
    d.mkdir()
    vs = vectors(120, seed=11)
    index = ChunkIndex("tiny-random", LAYERS, 64)
    whole = ChunkIndex("tiny-random", LAYERS, 64)  # the oracle: never saved
    for i in range(100):
        index.add(planted(4 * i, vs[i]))
        whole.add(planted(4 * i, vs[i]))
    index.save(d)
    assert set(_files(d)) == {chunkindex.GRAPH_NAME, chunkindex.META_NAME}
    base = _files(d)
    for i in range(100, 106):
        index.add(planted(4 * i, vs[i]))
        whole.add(planted(4 * i, vs[i]))
    index.save(d)
    after = _files(d)
    assert {n: after[n] for n in base} == base, "the base is not written again"
    assert len(after[chunkindex.DELTA_GRAPH_NAME]) < len(base[chunkindex.GRAPH_NAME]) / 4, "the delta is small"
    reader = saved(tmp_path)
    assert rows(reader) == [(4 * i, 4 * i + 3) for i in range(106)] and len(reader) == 106
    for q in (vs[103], vs[7], vectors(1, seed=99)[0]):
        assert _found(reader, q) == _found(whole, q)
    writer = ChunkIndex.open(d)
    assert writer is not None and rows(writer) == rows(reader) and writer.next_key == 106
    assert len(writer.graph) == 106 and writer.base_next_key == 100
    for i in range(106, 120):  # past the delta's share (8 here): one new base
        writer.add(planted(4 * i, vs[i]))
        whole.add(planted(4 * i, vs[i]))
    writer.save(d)
    assert set(_files(d)) == {chunkindex.GRAPH_NAME, chunkindex.META_NAME}
    reader = saved(tmp_path)
    assert reader.delta is None and len(reader) == 120 and _found(reader, vs[115]) == _found(whole, vs[115])


def test_retention_removes_chunks_through_the_delta_and_a_stale_delta_is_not_used(tmp_path, monkeypatch):
    """Retention's removals ride in the delta (the base keeps its files until the next base): a
    reader and a reopened writer no longer see the removed chunks. A delta left beside a newer
    base (a crash before its removal) belongs to no base: it is not used, and nothing is twice."""
    from common import chunkindex

    d = tmp_path / CAM
    d.mkdir()
    vs = vectors(30, seed=12)
    index = ChunkIndex("tiny-random", LAYERS, 64)
    for i in range(20):
        index.add(planted(4 * i, vs[i]))
    index.save(d)
    assert index.remove_before(T0 + 4 * 5 / FPS) == 5  # chunks 0-4 captured before it
    index.save(d)  # a delta of removals alone: no chunk in it
    alone = ChunkIndex.open(d)
    assert alone is not None and rows(alone) == rows(saved(tmp_path)) == [(4 * i, 4 * i + 3) for i in range(5, 20)]
    index.add(planted(4 * 20, vs[20]))
    index.save(d)
    assert chunkindex.DELTA_META_NAME in _files(d)
    reader = saved(tmp_path)
    assert rows(reader) == [(4 * i, 4 * i + 3) for i in range(5, 21)]
    assert all(m.first_seq >= 20 for m in reader.search(vs[2].astype(np.float32), 16)), "removed: never found"
    writer = ChunkIndex.open(d)
    assert writer is not None and rows(writer) == rows(reader) and len(writer.graph) == 16
    stale = {n: b for n, b in _files(d).items() if "delta" in n}
    monkeypatch.setattr(chunkindex, "DELTA_MIN_CHUNKS", 0)
    monkeypatch.setattr(chunkindex, "DELTA_SHARE", 0.0)
    writer.add(planted(4 * 21, vs[21]))
    writer.save(d)  # a new base, the delta removed...
    for name, data in stale.items():  # ...and back, as if the process died before removing it
        (d / name).write_bytes(data)
    again = saved(tmp_path)
    assert again.delta is None and rows(again) == [(4 * i, 4 * i + 3) for i in range(5, 22)]
