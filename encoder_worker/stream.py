"""One stream owned by this encoder: frames -> chunks -> engine -> published version -> XACK.

Exactly-once into the cache: a version records the last frame seq it holds, frames are acked
only after the version containing them is published, and a redelivered frame at or below
that seq is acked and skipped.
"""

from __future__ import annotations

import time

import redis
import structlog

from common import metrics, redisio
from common.engine.eviction import EvictionPolicy
from common.engine.grid import StreamSpec
from common.engine.kvcache import Segment, Version
from common.engine.runtime import Runtime
from common.engine.stream import StreamEngine
from common.segment_store import SegmentStore
from common.wire import keys
from common.wire.manifest import from_manifest, to_manifest
from common.wire.meta import StreamMeta
from common.wire.schemas import (
    EndOfStream,
    FrameMsg,
    Manifest,
    SchemaError,
    encode_manifest,
    manifest_from_bytes,
    manifest_to_bytes,
)
from encoder_worker.config import EncoderConfig

log = structlog.get_logger()

DROP_EVENT_EVERY_S = 5.0


class StreamNotReady(RuntimeError):
    """The stream has no meta yet (ingest has not started it)."""


class LeaseLost(RuntimeError):
    """Another encoder owns the stream now; this one must stop writing it."""


class OwnedStream:
    """A stream this worker holds the lease for, with its engine and not-yet-encoded frames."""

    def __init__(self, r: redis.Redis, store: SegmentStore, cfg: EncoderConfig, engine: StreamEngine, live: bool):
        self.r, self.store, self.cfg = r, store, cfg
        self.engine = engine
        self.name = engine.spec.name
        self.live = live
        self.pending: list[tuple[str, FrameMsg]] = []
        self.recent_manifests: list[Manifest] = []
        self.dropped_late = 0
        self._last_drop_event = -DROP_EVENT_EVERY_S
        self.ended = False

    @property
    def last_seq(self) -> int:
        cached = self.engine.head.last_frame_seq
        return max(cached, self.pending[-1][1].seq) if self.pending else cached

    def add(self, entry_id: str, msg: FrameMsg | EndOfStream) -> Version | None:
        """Take one frames-stream entry; returns the version published because of it, if any."""
        frames_key = keys.frames(self.name)
        if isinstance(msg, EndOfStream):
            version = self.flush()
            self.ended = True
            self.r.xack(frames_key, keys.ENCODER_GROUP, entry_id)
            event(self.r, self.name, "eos", last_frame_seq=self.engine.head.last_frame_seq)
            return version
        if msg.seq <= self.last_seq:
            metrics.FRAMES_DROPPED.labels(self.name, "duplicate").inc()
            self.r.xack(frames_key, keys.ENCODER_GROUP, entry_id)
            return None
        grid = self.engine.spec.grid
        if (msg.h, msg.w) != (grid.height, grid.width):
            metrics.FRAMES_DROPPED.labels(self.name, "bad").inc()
            reason = f"frame is {msg.h}x{msg.w}, the stream's grid is {grid.height}x{grid.width}"
            redisio.dead_letter(self.r, frames_key, entry_id, {"seq": str(msg.seq)}, reason, group=keys.ENCODER_GROUP)
            return None
        if self.live and time.time() - msg.ts > self.cfg.max_lag_s:
            self._drop_late(entry_id)  # behind real time: skip rather than fall further behind
            return None
        self.pending.append((entry_id, msg))
        return self.flush() if len(self.pending) >= self.engine.spec.chunk_frames else None

    def _drop_late(self, entry_id: str) -> None:
        metrics.FRAMES_DROPPED.labels(self.name, "late").inc()
        self.r.xack(keys.frames(self.name), keys.ENCODER_GROUP, entry_id)
        self.dropped_late += 1
        if time.monotonic() - self._last_drop_event > DROP_EVENT_EVERY_S:  # tell operators, without flooding
            self._last_drop_event = time.monotonic()
            event(self.r, self.name, "dropped", reason="late", total=self.dropped_late, max_lag_s=self.cfg.max_lag_s)

    def flush(self) -> Version | None:
        """Encode the pending frames as one chunk (an odd tail is padded), publish, then ack them."""
        if not self.pending:
            return None
        ids = [eid for eid, _ in self.pending]
        frames = [m for _, m in self.pending]
        t0 = time.perf_counter()
        version = self.engine.append([m.rgb() for m in frames], [m.ts for m in frames], [m.seq for m in frames])
        metrics.CHUNK_SECONDS.labels(self.name).observe(time.perf_counter() - t0)
        metrics.FRAMES_ENCODED.labels(self.name).inc(len(frames))
        self.publish(version)
        self.r.xack(keys.frames(self.name), keys.ENCODER_GROUP, *ids)
        self.pending = []
        lag = time.time() - frames[-1].ts if self.live else None
        if lag is not None:
            metrics.ENCODER_LAG.labels(self.name).set(lag)
        log.info(
            "version published",
            stream=self.name,
            version=version.id,
            tokens=version.tokens,
            last_frame_seq=version.last_frame_seq,
            evictions=version.stats.evictions,
            lag_s=lag,
        )
        return version

    def publish(self, version: Version) -> None:
        """Manifest to `versions` and `head`; segments are already in the store (on_segment)."""
        manifest = to_manifest(version, self.engine.spec)
        lease = keys.lease(self.name)
        with self.r.pipeline(transaction=True) as pipe:
            # Fenced by the lease: if it expired and another encoder owns the stream now, this
            # write must not land (WATCH aborts the transaction when the lease key changes).
            pipe.watch(lease)
            if pipe.get(lease) != self.cfg.consumer.encode():
                raise LeaseLost(self.name)
            pipe.multi()
            pipe.xadd(
                keys.versions(self.name), encode_manifest(manifest), maxlen=self.cfg.versions_maxlen, approximate=True
            )
            pipe.set(keys.head(self.name), manifest_to_bytes(manifest))
            try:
                pipe.execute()
            except redis.WatchError:
                raise LeaseLost(self.name) from None
        metrics.record_version(self.name, version)
        self.recent_manifests = [*self.recent_manifests, manifest][-self.cfg.keep_versions :]
        self.store.gc(self.name, {sid for m in self.recent_manifests for sid in m.segment_ids})


def stream_spec(r: redis.Redis, name: str, chunk_frames: int) -> tuple[StreamSpec, bool]:
    try:
        meta = StreamMeta.from_hash(r.hgetall(keys.meta(name)))
    except SchemaError as e:  # a forged or damaged description: not startable until ingest re-states it
        raise StreamNotReady(f"{name}: {e}") from None
    if meta is None:
        raise StreamNotReady(name)
    return meta.spec(name, chunk_frames), meta.live


def open_stream(rt: Runtime, r: redis.Redis, store: SegmentStore, cfg: EncoderConfig, name: str) -> OwnedStream:
    """Continue from the published head (nothing re-encoded, nothing skipped) or start empty."""
    policy = EvictionPolicy(cfg.max_cache_tokens, cfg.low_watermark, cfg.sink_chunks, cfg.rebase)
    spec, live = stream_spec(r, name, cfg.chunk_frames)

    def persist(segment: Segment, kv) -> None:
        store.put(name, segment.id, kv)

    raw = r.get(keys.head(name))
    if raw is None:
        owned = OwnedStream(r, store, cfg, StreamEngine(rt, spec, policy, on_segment=persist), live)
        owned.publish(owned.engine.head)
        return owned
    state = from_manifest(manifest_from_bytes(raw))
    engine = StreamEngine(
        rt,
        state.spec,
        policy,
        on_segment=persist,
        restore=(state.cache, lambda seg: store.get(name, seg.id, rt.loaded.device)),
    )
    log.info("stream restored", stream=name, version=state.cache.version_id, last_frame_seq=engine.head.last_frame_seq)
    return OwnedStream(r, store, cfg, engine, live)


def event(r: redis.Redis, stream: str, kind: str, **fields: object) -> None:
    redisio.event(r, stream, "encoder", kind, **fields)
