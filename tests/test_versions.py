"""Versions across processes: a mirror (QA worker) or a restarted encoder rebuilds exactly the cache
the encoder holds, from manifests and the segment store, with eviction (re-based or exact) in play."""

from __future__ import annotations

import numpy as np
import pytest
import redis
import torch

from common.engine.answer import ask
from common.engine.eviction import EvictionMode, EvictionPolicy
from common.engine.grid import Grid, StreamSpec
from common.engine.model import load_model
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.stream_engine import StreamEngine
from common.segment_store import DirectoryStore, embeds_id
from common.segment_writer import SegmentWriter
from common.wire import keys
from common.wire.manifest import from_manifest, to_manifest
from common.wire.schemas import FrameMsg, decode_manifest, encode_manifest, manifest_from_bytes
from encoder_worker.config import EncoderConfig
from encoder_worker.owned_stream import open_stream
from qa_worker.mirror import StreamMirror
from tests.engine_helpers import same_kv as same_cache

GRID = Grid(56, 84)


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


def frames(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, (GRID.height, GRID.width, 3), dtype=np.uint8) for _ in range(n)]


MODES = ["rebase", "exact"]
QUESTION = "what now?"


def policy(rt: Runtime, mode: EvictionMode = "rebase") -> EvictionPolicy:
    return EvictionPolicy(max_cache_tokens=len(rt.prefix_ids()) + 12 * 5, sink_chunks=1, low_watermark=0.6, mode=mode)


def writer(rt: Runtime, store: DirectoryStore, mode: EvictionMode = "rebase", **kw) -> StreamEngine:
    spec = StreamSpec("cam", 3.0, GRID, 4)  # fps 3: fractional temporal steps, per-patch deltas
    return StreamEngine(
        rt,
        spec,
        policy(rt, mode),
        on_segment=lambda seg, kv: store.put("cam", seg.id, kv),
        on_embeds=lambda seg, embeds: store.put("cam", embeds_id(seg.chunk_id), embeds),
        **kw,
    )


def same_answer(rt: Runtime, a, b) -> bool:
    """Same logits (to fp32 round-off) and the same greedy answer."""
    params = GenerationParams(max_tokens=10)
    answer_a, answer_b = (ask(rt, v, QUESTION, params, keep_logits=True) for v in (a, b))
    same_logits = torch.allclose(answer_a.first_logits, answer_b.first_logits, atol=1e-5, rtol=0)
    return answer_a.token_ids == answer_b.token_ids and same_logits


def append(engine: StreamEngine, video: list[np.ndarray], i: int):
    part = video[i : i + 4]
    return engine.append(part, [(i + k) / 3 for k in range(len(part))], list(range(i, i + len(part))))


def wire(version, spec):
    """Through msgpack, as on Redis."""
    return decode_manifest(encode_manifest(to_manifest(version, spec)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("every", [1, 3], ids=["every-version", "skipping-versions"])
def test_mirror_equals_the_encoder_through_eviction(rt, tmp_path, every, mode):
    store = DirectoryStore(tmp_path)
    engine = writer(rt, store, mode)
    mirror = StreamMirror(rt, store, "cam")
    video = frames(48)
    for n, i in enumerate(range(0, len(video), 4)):
        version = append(engine, video, i)
        if n % every == 0 or i + 4 >= len(video):
            mirrored = mirror.apply(wire(version, engine.spec))
            assert mirrored.id == version.id and mirrored.text_start == version.text_start
            assert [p.segment.id for p in mirrored.placements] == [p.segment.id for p in version.placements]
            assert same_cache(version, mirrored)
    assert engine.head.stats.evictions >= 2
    if mode == "exact":  # re-prefilled segments: new ids, nothing turned
        assert any(".r" in p.segment.id for p in engine.head.chunks)
        assert not any(any(p.t_delta) for p in engine.head.chunks)
    else:
        assert any(any(p.t_delta) for p in engine.head.chunks)
    assert same_answer(rt, mirror.head, engine.head)


@pytest.mark.parametrize("mode", MODES)
def test_restarted_encoder_continues_exactly_like_an_uninterrupted_one(rt, tmp_path, mode):
    video = frames(48)
    store = DirectoryStore(tmp_path / "a")
    steady = writer(rt, DirectoryStore(tmp_path / "b"), mode)
    first = writer(rt, store, mode)
    for i in range(0, 24, 4):
        append(steady, video, i)
        head = append(first, video, i)
    manifest = wire(head, first.spec)
    del first  # the process dies; the manifest and the store remain
    state = from_manifest(manifest)
    resumed = writer(
        rt,
        store,
        mode,
        restore=(state.cache, lambda seg: store.get("cam", seg.id)),
        load_embeds=lambda chunk: store.get("cam", embeds_id(chunk)),
    )
    assert resumed.head.id == head.id and resumed.head.last_frame_seq == 23
    evictions = head.stats.evictions
    for i in range(24, 48, 4):
        a, b = append(steady, video, i), append(resumed, video, i)
        assert a.id == b.id and a.stats == b.stats and same_cache(a, b)
    assert b.stats.evictions > evictions, "the resumed encoder evicted (from restored embeddings)"
    assert same_answer(rt, a, b)


def test_exact_cache_survives_an_encoder_restart_through_redis_and_gc(rt, tmp_path, redis_url):
    """The encoder service's own path: open_stream, frames in, gc after every version, restart from
    the head manifest; the restarted encoder and a QA mirror answer like an uninterrupted encoder."""
    r = redis.Redis.from_url(redis_url)
    prefix = len(rt.prefix_ids())
    cfg = EncoderConfig(
        redis_url=redis_url, streams=("cam",), consumer="me", chunk_frames=4, max_cache_tokens=prefix + 60,
        low_watermark=0.6, eviction="exact", keep_versions=2,
    )  # fmt: skip
    r.hset(keys.meta("cam"), mapping={"fps": 3, "height": GRID.height, "width": GRID.width, "live": 0})
    r.set(keys.lease("cam"), "me")
    store = DirectoryStore(tmp_path / "a")
    steady = writer(rt, DirectoryStore(tmp_path / "b"), "exact")
    video = frames(48)

    def feed(owned, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            owned.add(f"{i + 1}-0", FrameMsg.from_rgb(i, i / 3, i / 3, video[i]))
            if i % 4 == 3:
                append(steady, video, i - 3)

    first = SegmentWriter(store)
    feed(open_stream(rt, r, first, cfg, "cam"), 0, 24)  # then the process dies
    first.close()  # (its last gc may still be queued: a crash would leave those segments for the next gc)
    segments = SegmentWriter(store)
    owned = open_stream(rt, r, segments, cfg, "cam")
    feed(owned, 24, 48)
    segments.close()  # its queued collection done
    head = owned.engine.head
    assert head.stats.evictions >= 2 and head.id == steady.head.id and same_cache(head, steady.head)
    assert same_answer(rt, head, steady.head)
    mirror = StreamMirror(rt, store, "cam")
    mirrored = mirror.apply(manifest_from_bytes(r.get(keys.head("cam"))))
    assert same_cache(head, mirrored) and same_answer(rt, mirrored, head)
    held = [p for m in owned.recent_manifests for p in from_manifest(m).cache.placements[1:]]
    kept = {embeds_id(p.segment.chunk_id) for p in held}
    stored = {p.stem for p in (tmp_path / "a" / "cam").iterdir() if p.stem.endswith(".emb")}
    assert stored == kept, "gc keeps exactly the embeddings of chunks the kept versions hold"
    assert {embeds_id(p.segment.chunk_id) for p in head.chunks} <= stored


def test_mirror_keeps_recent_versions_answerable_without_pinning_evicted_arenas(rt, tmp_path):
    store = DirectoryStore(tmp_path)
    engine = writer(rt, store)
    mirror = StreamMirror(rt, store, "cam")
    video = frames(48)
    relayouts = dict(rt.pool.relayouts)
    for i in range(0, len(video), 4):
        mirror.apply(wire(append(engine, video, i), engine.spec))
        head = mirror.head
        assert head.id in mirror.recent
        assert all(v.layout is head.layout for v in mirror.recent.values()), "pages an eviction replaced are pinned"
        del head  # a reader holding it when the next eviction comes would make that one a copy
    assert engine.head.stats.evictions >= 2
    # the mirror let go of the old layout's versions before each eviction: moved in place, never copied
    assert rt.pool.relayouts["copied"] == relayouts["copied"]
    assert rt.pool.relayouts["in_place"] - relayouts["in_place"] == 2 * engine.head.stats.evictions


def test_mirror_follows_a_stream_that_started_over(rt, tmp_path, redis_url):
    """Redis lost its data and the encoder began again at version 0 with new frames under the same
    segment ids: the mirror must rebuild from the store, not reuse what it cached."""
    from qa_worker.mirror import Mirror

    store = DirectoryStore(tmp_path)
    old, video = writer(rt, store), frames(48)
    mirror = Mirror(rt, redis.Redis.from_url(redis_url), store, ["cam"])
    for i in range(0, 24, 4):
        mirror._apply("cam", wire(append(old, video, i), old.spec))
    new = writer(rt, store)
    reversed_video = video[::-1]
    for i in range(0, 8, 4):
        version = append(new, reversed_video, i)
    mirror._apply("cam", wire(version, new.spec))
    assert mirror.get("cam").id == version.id < 6
    assert same_cache(version, mirror.get("cam"))
