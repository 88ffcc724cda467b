"""Versions across processes: a mirror (QA worker) or a restarted encoder rebuilds exactly the cache
the encoder holds, from manifests and the segment store, with eviction and re-basing in play."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.engine.answer import ask
from common.engine.eviction import EvictionPolicy
from common.engine.grid import Grid, StreamSpec
from common.engine.model import load_model
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.stream import StreamEngine
from common.segment_store import DirectoryStore
from common.wire.manifest import from_manifest, to_manifest
from common.wire.schemas import decode_manifest, encode_manifest
from qa_worker.mirror import StreamMirror

GRID = Grid(56, 84)


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


def frames(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, (GRID.height, GRID.width, 3), dtype=np.uint8) for _ in range(n)]


def policy(rt: Runtime) -> EvictionPolicy:
    return EvictionPolicy(max_cache_tokens=len(rt.prefix_ids()) + 12 * 5, sink_chunks=1, low_watermark=0.6)


def writer(rt: Runtime, store: DirectoryStore, **kw) -> StreamEngine:
    spec = StreamSpec("cam", 3.0, GRID, 4)  # fps 3: fractional temporal steps, per-patch deltas
    return StreamEngine(rt, spec, policy(rt), on_segment=lambda seg, kv: store.put("cam", seg.id, kv), **kw)


def append(engine: StreamEngine, video: list[np.ndarray], i: int):
    part = video[i : i + 4]
    return engine.append(part, [(i + k) / 3 for k in range(len(part))], list(range(i, i + len(part))))


def wire(version, spec):
    """Through msgpack, as on Redis."""
    return decode_manifest(encode_manifest(to_manifest(version, spec)))


def same_cache(a, b) -> bool:
    n = a.tokens
    return b.tokens == n and torch.allclose(a.view.kv[:, :, :, :n], b.view.kv[:, :, :, :n], atol=1e-5)


@pytest.mark.parametrize("every", [1, 3], ids=["every-version", "skipping-versions"])
def test_mirror_equals_the_encoder_through_eviction_and_rebasing(rt, tmp_path, every):
    store = DirectoryStore(tmp_path)
    engine = writer(rt, store)
    mirror = StreamMirror(rt, store, "cam")
    video = frames(48)
    for n, i in enumerate(range(0, len(video), 4)):
        version = append(engine, video, i)
        if n % every == 0 or i + 4 >= len(video):
            mirrored = mirror.apply(wire(version, engine.spec))
            assert mirrored.id == version.id and mirrored.text_start == version.text_start
            assert [p.segment.id for p in mirrored.placements] == [p.segment.id for p in version.placements]
            assert same_cache(version, mirrored)
    assert engine.head.stats.evictions >= 2 and any(any(p.t_delta) for p in engine.head.chunks)
    params = GenerationParams(max_tokens=10)
    assert ask(rt, mirror.head, "what now?", params).token_ids == ask(rt, engine.head, "what now?", params).token_ids


def test_restarted_encoder_continues_exactly_like_an_uninterrupted_one(rt, tmp_path):
    video = frames(48)
    store = DirectoryStore(tmp_path / "a")
    steady = writer(rt, DirectoryStore(tmp_path / "b"))
    first = writer(rt, store)
    for i in range(0, 24, 4):
        append(steady, video, i)
        head = append(first, video, i)
    manifest = wire(head, first.spec)
    del first  # the process dies; the manifest and the store remain
    state = from_manifest(manifest)
    resumed = writer(rt, store, restore=(state.cache, lambda seg: store.get("cam", seg.id)))
    assert resumed.head.id == head.id and resumed.head.last_frame_seq == 23
    for i in range(24, 48, 4):
        a, b = append(steady, video, i), append(resumed, video, i)
        assert a.id == b.id and a.stats == b.stats and same_cache(a, b)


def test_mirror_keeps_recent_versions_answerable_without_pinning_evicted_arenas(rt, tmp_path):
    store = DirectoryStore(tmp_path)
    engine = writer(rt, store)
    mirror = StreamMirror(rt, store, "cam")
    video = frames(48)
    for i in range(0, len(video), 4):
        mirror.apply(wire(append(engine, video, i), engine.spec))
        head = mirror.head
        assert head.id in mirror.recent
        assert all(v.view.kv is head.view.kv for v in mirror.recent.values()), "an old arena is pinned"
    assert engine.head.stats.evictions >= 2


def test_mirror_follows_a_stream_that_started_over(rt, tmp_path, redis_url):
    """Redis lost its data and the encoder began again at version 0 with new frames under the same
    segment ids: the mirror must rebuild from the store, not reuse what it cached."""
    import redis

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
