"""One stream owned by this encoder: frames -> chunks -> engine -> published version -> XACK.

Exactly-once into the cache: a version records the last frame seq it holds, frames are acked
only after the version containing them is published, and a redelivered frame at or below
that seq is acked and skipped.

The stream's own history is the reference for what a frame may claim: its seq must follow the
last one within a bound that grows with the time passed up to now (``frame_follow_problem``), and
an end-of-stream marker is obeyed only when it names the last frame seen, nothing follows it on
the frames stream (ingest writes EndOfStream(last seq it sent) after that frame, then nothing) and
no other marker was obeyed in the last EOS_EVERY_S. Anything else is dead-lettered with an event,
so one forged entry cannot stop the stream. A forgery inside the bound still turns the real frames
up to its seq into duplicates: a run of them longer than a crash can redeliver is reported.

Frames are read, acked and claimed on the ``frames`` Redis (it may be an instance without
persistence); versions, head, lease, events and dead letters stay on the durable one, ``r``.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import redis
import structlog
import torch

from common import metrics, redisio
from common.clock import SharedClock
from common.engine.grid import StreamSpec
from common.engine.kvcache import CacheState, Segment, Version
from common.engine.pool import PoolFull
from common.engine.runtime import Runtime
from common.engine.stream_engine import StreamEngine
from common.faults import fault_point
from common.framelog import FrameLog, FrameLogError, decode
from common.segment_store import SegmentStoreError, embeds_id
from common.segment_writer import SegmentWriter, WriterClosed
from common.wire import keys
from common.wire.feature_record import FEATURES_MAXLEN, ChunkFeatures, encode_features
from common.wire.manifest import from_manifest, new_epoch, to_manifest
from common.wire.meta import StreamMeta
from common.wire.schemas import (
    FIELD,
    EndOfStream,
    FrameMsg,
    Manifest,
    SchemaError,
    check_frame_entry,
    decode_manifest,
    encode_manifest,
    frame_entry_cap,
    frame_follow_problem,
    frame_grid,
    frame_header,
    manifest_from_bytes,
    unpack_frame,
)
from encoder_worker.config import EncoderConfig
from encoder_worker.restore import Restorer

log = structlog.get_logger()

DROP_EVENT_EVERY_S = 5.0  # per reason: a `dropped` event (and a log line) at most this often
# A chunk the KV pool has no room for (questions hold old versions' pages) is tried again after
# this wait, doubling up to the most, until its deadline: backpressure, not bad frames
NO_ROOM_FIRST_WAIT_S = 0.05
NO_ROOM_MOST_WAIT_S = 1.0
EOS_EVERY_S = 60.0  # end-of-stream markers obeyed at most this often per stream (each flushes a padded chunk)


class StreamNotReady(RuntimeError):
    """The stream has no meta yet (ingest has not started it)."""


class BadDescription(ValueError):
    """The stream's description (meta) does not decode: bad data, said in one line (no traceback)
    until ingest re-states it."""


class LeaseLost(RuntimeError):
    """Another encoder owns the stream now; this one must stop writing it."""


class WriteFailed(RuntimeError):
    """A segment of the stream's next version could not be written (not an outage: those are
    retried by the writer). The stream is reopened from its published head."""


class OwnedStream:
    """A stream this worker holds the lease for, with its engine and not-yet-encoded frames."""

    def __init__(
        self,
        r: redis.Redis,
        writer: SegmentWriter,
        cfg: EncoderConfig,
        engine: StreamEngine,
        live: bool,
        frames: redis.Redis | None = None,
        writes: list[Future] | None = None,
        features: list[tuple[Segment, torch.Tensor]] | None = None,
        recent_manifests: list[Manifest] | None = None,
        owner: str | None = None,
        clock: SharedClock | None = None,
    ):
        """``recent_manifests``: the newest versions already published (a new owner's), whose
        segments collections keep until newer versions take their place. ``owner``: the lease's
        value that fences its publishes (`common.lease.lease_owner`; default the consumer name).
        ``clock``: what frames' capture times are judged by (default: one of its own on ``frames``;
        the service gives every stream its one, refreshed with the lease checks)."""
        self.r, self.writer, self.cfg = r, writer, cfg
        self.owner = owner or cfg.consumer
        self.writes = writes if writes is not None else []  # the writer's futures for the unpublished segments
        self.features = features if features is not None else []  # the unpublished chunks' retrieval vectors
        self.frames = frames or r
        # Redis's clock, not this host's: ingest stamps frames with it, and a host whose own clock
        # is off (NTP broken) would judge every frame late, or ahead, for as long as it holds the stream
        self.clock = clock or SharedClock(self.frames)
        self.engine = engine
        self.name = engine.spec.name
        self.live = live
        self.pending: list[tuple[str, FrameMsg]] = []
        self.recent_manifests: list[Manifest] = list(recent_manifests or [])
        self.dropped: Counter[str] = Counter()  # frames dropped, by reason
        self._drop_event_at: dict[str, float] = {}  # when each reason's last `dropped` event went out
        self.duplicate_run = 0  # duplicates since the last frame taken
        self.ended_seq: int | None = None  # the seq an obeyed end-of-stream marker named, until frames go on
        self._eos_at = -EOS_EVERY_S  # when a marker was last obeyed (monotonic)
        self.lost = False  # its task found the lease gone; the main loop drops the stream
        self.renewed_at = time.monotonic()  # when its lease was last renewed
        self.published = engine.head.id  # the newest version on `head` that this worker wrote or restored
        self.taken_at = self.clock.now()  # when this worker took the stream's lease (the service sets it)
        self.opened: dict[str, float] = {}  # how opening it went, in seconds and GB (the `encoder_attached` event)
        # keeps the lease while a chunk waits for KV room (the service's renewal; False: lost)
        self.keep_lease: Callable[[], bool] = lambda: True

    @property
    def last_seq(self) -> int:
        cached = self.engine.head.last_frame_seq
        return max(cached, self.pending[-1][1].seq) if self.pending else cached

    @property
    def last_ts(self) -> float | None:
        if self.pending:
            return self.pending[-1][1].ts
        captured = self.engine.head.capture_range
        return captured[1] if captured else None

    @property
    def entry_cap(self) -> int:
        """The most bytes a frames entry of this stream may hold (refused before unpacking)."""
        grid = self.engine.spec.grid
        return frame_entry_cap(grid.height, grid.width)

    def add(self, entry_id: str, msg: FrameMsg | EndOfStream) -> Version | None:
        """Take one frames-stream entry; returns the version published because of it, if any."""
        if any(eid == entry_id for eid, _ in self.pending):
            return None  # read again after an outage: already waiting for its chunk, not acked yet
        if isinstance(msg, EndOfStream):
            return self._end(entry_id, msg)
        if msg.seq <= self.last_seq:
            self._duplicate(entry_id, msg.seq)
            return None
        grid = self.engine.spec.grid
        if (msg.h, msg.w) != (grid.height, grid.width):
            reason = f"frame is {msg.h}x{msg.w}, the stream's grid is {grid.height}x{grid.width}"
            self.reject(entry_id, {"seq": str(msg.seq)}, reason)
            return None
        fps, skew = self.engine.spec.fps, self.cfg.max_clock_skew_s
        now = self.clock.now()
        problem = frame_follow_problem(self.last_seq, self.last_ts, msg, fps, self.live, now=now, max_skew_s=skew)
        if problem is not None:
            self.reject(entry_id, {"seq": str(msg.seq), "ts": repr(msg.ts)}, problem)
            return None
        if self.skip_late(entry_id, msg.ts):
            return None
        self._taken(msg)
        self.pending.append((entry_id, msg))
        return self.flush() if len(self.pending) >= self.engine.spec.chunk_frames else None

    def skip_late(self, entry_id: str, ts: float | None) -> bool:
        """Drop a live frame that waited over `max_lag_s` for this worker (behind real time: skip
        rather than fall further behind); the service asks before it decodes the frame's pixels.
        A frame captured before this worker took the stream waited for it only since then: the
        backlog a failover leaves (the lease running out, the restore) is encoded if caught up
        within `max_lag_s` of the takeover, and frames already over `max_lag_s` old at the
        takeover are dropped as before. False for a frame already waiting for its chunk (read
        again after an outage)."""
        if not self.live or ts is None or not self._late(ts):
            return False
        if any(eid == entry_id for eid, _ in self.pending):
            return False
        self._drop(entry_id, "late", max_lag_s=self.cfg.max_lag_s)
        return True

    def refused_grid(self, entry_id: str, m: Mapping[str, Any]) -> bool:
        """Dead-letter a frame whose header declares another grid than the stream's, before its
        pixels are decoded: a WebP of 700 bytes, well under the entry cap, declares 4096x4096 and
        costs half a second of CPU and 50 MB to decode, for a frame refused anyway."""
        grid = self.engine.spec.grid
        size = frame_grid(m)
        if size is None or size == (grid.height, grid.width):
            return False
        reason = f"frame is {size[0]}x{size[1]}, the stream's grid is {grid.height}x{grid.width}"
        self.reject(entry_id, {"seq": str(m.get("seq"))[:40]}, reason)
        return True

    def _late(self, ts: float) -> bool:
        waited_from = max(ts, self.taken_at) if self.taken_at - ts <= self.cfg.max_lag_s else ts
        return self.clock.now() - waited_from > self.cfg.max_lag_s

    def refused_duplicate(self, entry_id: str, fields: Mapping[Any, Any]) -> bool:
        """An entry refused (delivered too often, say) whose frame the stream already holds: crashes
        between its chunk's publish and its ack redelivered it to every life since. It is taken as
        the duplicate it is, not dead-lettered: a frame in the cache must not also be reported as
        dropped. Its pixels are not decoded; False for anything but a frame's valid header."""
        try:
            check_frame_entry(fields, self.entry_cap)
            m = unpack_frame(fields)
            seq = None if m.get("eos", False) else frame_header(m)[0]
        except SchemaError:
            return False
        if seq is None or seq > self.engine.head.last_frame_seq:  # not in the cache (perhaps pending)
            return False
        self._duplicate(entry_id, seq)
        return True

    def _duplicate(self, entry_id: str, seq: int) -> None:
        """A frame at or below the stream's last seq: acked, not encoded. A crash between a publish
        and its ack redelivers at most one chunk of them; a longer run is real frames behind a seq
        that ran ahead of them (a forged frame inside the bound): dropped as `seq_behind`, reported."""
        self.duplicate_run += 1
        if self.duplicate_run <= self.engine.spec.chunk_frames:
            metrics.FRAMES_DROPPED.labels(self.name, "duplicate").inc()
            self.frames.xack(keys.frames(self.name), keys.ENCODER_GROUP, entry_id)
            return
        self._drop(entry_id, "seq_behind", seq=seq, last_frame_seq=self.last_seq, run=self.duplicate_run)

    def _taken(self, msg: FrameMsg) -> None:
        """A frame goes into the next chunk: a run of duplicates is over, and an end-of-stream
        marker obeyed before it was no end (forged, or its source came back)."""
        self.duplicate_run = 0
        if self.ended_seq is not None:
            log.warning("frames go on after an end-of-stream marker", stream=self.name, eos_seq=self.ended_seq)
            event(self.r, self.name, "frames_after_eos", eos_seq=self.ended_seq, seq=msg.seq)
            self.ended_seq = None

    def _end(self, entry_id: str, msg: EndOfStream) -> Version | None:
        """Obey an end-of-stream marker (flush the partial chunk) only when it is consistent with
        the stream's history (see module doc); otherwise dead-letter it."""
        problem = self._end_problem(entry_id, msg)
        if problem is not None:
            self.reject(entry_id, {"seq": str(msg.seq)}, problem)
            return None
        version = self.flush()
        self.ended_seq, self._eos_at = msg.seq, time.monotonic()
        self.frames.xack(keys.frames(self.name), keys.ENCODER_GROUP, entry_id)
        event(self.r, self.name, "eos", last_frame_seq=self.engine.head.last_frame_seq)
        return version

    def _end_problem(self, entry_id: str, msg: EndOfStream) -> str | None:
        if msg.seq != self.last_seq:
            return f"end of stream at seq {msg.seq}, but the last frame is {self.last_seq}"
        if (ago := time.monotonic() - self._eos_at) < EOS_EVERY_S:
            return f"end of stream {ago:.0f} s after the last one obeyed (at most one every {EOS_EVERY_S:g} s)"
        if self.frames.xrange(keys.frames(self.name), min=f"({entry_id}", count=1):
            return "end of stream with entries after it: the stream goes on"
        return None

    def reject(self, entry_id: str, fields: dict, reason: str) -> None:
        """Dead-letter one frames entry (acked) and say so on the stream's events."""
        metrics.FRAMES_DROPPED.labels(self.name, "bad").inc()
        log.warning("frame dead-lettered", stream=self.name, entry=entry_id, reason=reason)
        dead_letter_frame(self.r, self.frames, keys.frames(self.name), entry_id, fields, reason)
        event(self.r, self.name, "dead_letter", entry_id=entry_id, reason=reason[:200])

    def _drop(self, entry_id: str, reason: str, **fields: object) -> None:
        """Ack a frame that is not encoded and count it: in this life's metric and `dropped`, and in
        the stream's count of every life (`keys.drops`, what status shows: a burst's events, below,
        name only its first frame, and a metric starts again with each process); tell operators (an
        event with that total, and a log line) at most every DROP_EVENT_EVERY_S per reason."""
        metrics.FRAMES_DROPPED.labels(self.name, reason).inc()
        self.frames.xack(keys.frames(self.name), keys.ENCODER_GROUP, entry_id)
        self.dropped[reason] += 1
        count = functools.partial(self.r.hincrby, keys.drops(self.name), reason, 1)
        total = redisio.unless_refused(count, self.dropped[reason], "the stream's drop count")
        now = time.monotonic()
        if now - self._drop_event_at.get(reason, -math.inf) > DROP_EVENT_EVERY_S:
            self._drop_event_at[reason] = now
            log.warning("frames dropped", stream=self.name, reason=reason, total=total, **fields)
            event(self.r, self.name, "dropped", reason=reason, total=total, **fields)

    def flush(self) -> Version | None:
        """Encode the pending frames as one chunk (an odd tail is padded), publish, then ack them.

        Resumable: after an outage between encoding and acking, calling it again publishes and
        acks what is already encoded instead of encoding it twice.
        """
        if not self.pending:
            return None
        ids = [eid for eid, _ in self.pending]
        frames = [m for _, m in self.pending]
        if self.engine.head.last_frame_seq < frames[-1].seq:
            t0 = time.perf_counter()
            seqs, since = [m.seq for m in frames], self._waiting_since(frames[-1])
            deadline = since + self.cfg.max_lag_s  # the frames after it are dropped from then on (skip_late)
            if not self._append_when_room(frames, seqs, since, deadline):
                return None
            metrics.CHUNK_SECONDS.labels(self.name).observe(time.perf_counter() - t0)
            metrics.FRAMES_ENCODED.labels(self.name).inc(len(frames))
        version = self.engine.head
        if self.published != version.id:
            self.publish(version)
        fault_point("persist.before_ack")
        self.frames.xack(keys.frames(self.name), keys.ENCODER_GROUP, *ids)
        self.pending = []
        lag = self.clock.now() - frames[-1].ts if self.live else None
        if lag is not None:
            metrics.ENCODER_LAG.labels(self.name).set(lag)
        # one a chunk: on a GPU, where scripts/probes/encode_steps.py reads how steps batched them;
        # on a CPU, where chunks are few and slow, only a debug line
        (log.info if self.engine.rt.device.type == "cuda" else log.debug)(
            "version published",
            stream=self.name,
            version=version.id,
            tokens=version.tokens,
            last_frame_seq=version.last_frame_seq,
            evictions=version.stats.evictions,
            lag_s=lag,
        )
        return version

    def _append_when_room(self, frames: list[FrameMsg], seqs: list[int], since: float, deadline: float) -> bool:
        """Encode the chunk; while the KV pool has no room for it (`PoolFull`: questions hold the
        pages of old versions, and this chunk's eviction must copy the cache), wait and try again,
        keeping the lease. The engine's head is unchanged by a refused chunk, so a retry is the
        chunk as if it came now. Room is backpressure, not bad data: the frames stay pending
        (no dead letter), and are dropped as `late` only once the chunk's deadline (`max_lag_s`)
        would pass while waiting. False then: nothing was encoded, the frames are acked as dropped."""
        wait, waited_from = NO_ROOM_FIRST_WAIT_S, None
        while True:
            try:
                self.engine.append([m.rgb() for m in frames], [m.ts for m in frames], seqs, since, deadline)
            except PoolFull as e:
                if waited_from is None:  # once an episode: an event, a log line, the counter
                    waited_from = time.monotonic()
                    metrics.CHUNKS_WAITED_FOR_ROOM.labels(self.name).inc()
                    log.warning("chunk waits for KV room", stream=self.name, seq=seqs[-1], error=str(e)[:200])
                    event(self.r, self.name, "waiting_for_kv_room", seq=seqs[-1], error=str(e)[:200])
                if time.monotonic() + wait > deadline:
                    for eid, _ in self.pending:
                        self._drop(eid, "late", max_lag_s=self.cfg.max_lag_s, waited_for_kv_room=True)
                    self.pending = []
                    return False
                time.sleep(wait)
                wait = min(2 * wait, NO_ROOM_MOST_WAIT_S)
                if not self.keep_lease():
                    raise LeaseLost(self.name) from None
                continue
            if waited_from is not None:
                log.info("chunk had KV room again", stream=self.name, waited_s=round(time.monotonic() - waited_from, 3))
            return True

    def _waiting_since(self, last: FrameMsg) -> float:
        """A live chunk has waited since its last frame was captured (clocks: Redis's, which ingest
        stamps with, read as this process's monotonic time); a file's, since the GPU was asked."""
        return time.monotonic() - max(0.0, self.clock.now() - last.ts) if self.live else math.inf

    def publish(self, version: Version) -> None:
        """Manifest to `versions` and `head`, once its new segments are written (queued by
        `on_segment`); then the segments no recent version holds are collected, by the writer."""
        self._await_writes()
        fault_point("persist.before_publish")
        manifest = to_manifest(version, self.engine.spec)
        if not publish_fenced(self.r, self.name, self.owner, manifest, self.cfg.versions_maxlen):
            raise LeaseLost(self.name)
        self.published = version.id
        self._publish_features()
        metrics.record_version(self.name, version)
        self.recent_manifests = [*self.recent_manifests, manifest][-self.cfg.keep_versions :]
        self.writer.gc(self.name, {sid for m in self.recent_manifests for sid in m.segment_ids})

    def _publish_features(self) -> None:
        """The published chunks' retrieval vectors to the stream's features stream (beside its
        frames: in transit to the recorder, which indexes them with the frames log)."""
        if not self.features:
            return
        model, layers = self.engine.rt.loaded.name, self.engine.feature_layers
        tp = self.engine.rt.loaded.temporal_patch_size
        pipe = self.frames.pipeline(transaction=False)
        for segment, vector in self.features:
            frames = segment.n_patches * tp - segment.padded_frames
            f = ChunkFeatures(segment.capture_range, segment.frame_seqs, frames, model, layers, vector.numpy())
            pipe.xadd(keys.features(self.name), encode_features(f), maxlen=FEATURES_MAXLEN, approximate=True)
        pipe.execute()
        self.features.clear()

    def _await_writes(self) -> None:
        """Wait for the writer to hold every segment the next version adds (a full disk is
        waited out there, with frames pending); a write that failed for good ends the stream's
        run here (WriteFailed): its head would otherwise reference a segment that is not stored."""
        writes, self.writes[:] = list(self.writes), []
        for future in writes:
            try:
                future.result()
            except WriterClosed:
                raise
            except Exception as e:
                event(self.r, self.name, "store_write_failed", error=str(e)[:200])
                raise WriteFailed(f"{self.name}: {e}") from e

    def resume(self) -> bool:
        """After an outage: False if the stream is no longer ours (the lease went to another
        encoder, or `head` holds a version we did not write); else finish an interrupted chunk."""
        raw = self.r.get(keys.head(self.name))
        on_head = manifest_from_bytes(raw).version if raw is not None else None
        if on_head == self.engine.head.id:
            self.published = on_head  # the publish landed; only its reply was lost
        elif on_head != self.published:
            log.warning("head changed during the outage; reopening", stream=self.name, head=on_head)
            return False
        if self.pending and self.engine.head.last_frame_seq >= self.pending[-1][1].seq:
            self.flush()
        return True


# Fenced by the lease: the manifest lands only while this encoder holds the stream (KEYS: lease,
# versions, head; ARGV: owner, versions maxlen, head bytes, then the versions entry's field, value,
# ...). One script on the stream's slot: atomic, and legal on a cluster, where a WATCH transaction
# would abort whenever the slot moves. A lease key of a wrong type (pcall: its error, no string)
# fences like another owner's: the chunk stays pending, the lease check removes the key.
_PUBLISH = """
if redis.pcall('get', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('xadd', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 4))
redis.call('set', KEYS[3], ARGV[3])
return 1
"""


def publish_fenced(r: redis.Redis, name: str, owner: str, manifest: Manifest, versions_maxlen: int) -> bool:
    """Append ``manifest`` to the stream's versions and make it its head, if ``owner`` holds the
    lease; False (nothing written) if it does not."""
    fields = encode_manifest(manifest)  # packed once: the head holds the versions entry's bytes
    flat = [x for kv in fields.items() for x in kv]
    lease, versions, head = keys.lease(name), keys.versions(name), keys.head(name)
    return bool(r.eval(_PUBLISH, 3, lease, versions, head, owner, versions_maxlen, fields[FIELD], *flat))


def stream_spec(r: redis.Redis, name: str, chunk_frames: int) -> tuple[StreamSpec, bool]:
    """The stream's spec and liveness from its description; StreamNotReady before ingest wrote one.
    A forged or damaged one (a grid over the frame limit, say) fails this stream's open, said in an
    `open_failed` event: the stream was opened on a grid over the limit, and let go of without a
    word when its description did not decode."""
    try:
        meta = StreamMeta.from_hash(r.hgetall(keys.meta(name)))
    except SchemaError as e:  # not startable until ingest re-states it (with its next frame)
        raise BadDescription(f"{name}: bad stream description: {e}") from None
    if meta is None:
        raise StreamNotReady(name)
    return meta.spec(name, chunk_frames), meta.live


def open_stream(
    rt: Runtime,
    r: redis.Redis,
    writer: SegmentWriter,
    cfg: EncoderConfig,
    name: str,
    frames: redis.Redis | None = None,
    restorer: Restorer | None = None,
    owner: str | None = None,
) -> OwnedStream:
    """Continue from the published head (nothing re-encoded, nothing skipped) or start empty.

    The head's segments are read into host memory by `restorer` (the service's, shared by the
    streams it opens; by default one of a single reader and slot) from this thread; the GPU loop
    copies them to the device as it lays them out in the cache. A head whose segments cannot all
    be read back (missing, truncated, checksum mismatch: the store was wiped or damaged) is rebuilt
    from the frames log (`framelog_dir`) or, without one, starts this stream over (`_recover`); it
    never stops the worker or another stream."""
    if restorer is None:
        restorer = Restorer(rt.loaded.device, threads=1, slot_bytes=0)  # every segment in memory of its own
        try:
            return open_stream(rt, r, writer, cfg, name, frames, restorer, owner)
        finally:
            restorer.close()
    policy = cfg.eviction_policy()
    spec, live = stream_spec(r, name, cfg.chunk_frames)
    kept = _kept_manifests(r, name, cfg.keep_versions)
    writes: list[Future] = []
    features: list[tuple[Segment, torch.Tensor]] = []

    def sinks(epoch: str) -> dict:  # each record names the life it is K/V of (checked at restore)
        return dict(
            on_segment=lambda segment, kv: writes.append(writer.put(name, segment.id, kv, epoch=epoch)),
            on_embeds=lambda segment, embeds: writes.append(
                writer.put(name, embeds_id(segment.chunk_id), embeds, epoch=epoch)
            ),
            on_features=lambda segment, vector: features.append((segment, vector)),
        )

    def new_life() -> OwnedStream:  # version ids start over, under a new epoch
        epoch = new_epoch()
        engine = StreamEngine(rt, spec, policy, epoch=epoch, **sinks(epoch))
        return OwnedStream(r, writer, cfg, engine, live, frames, writes, features, kept, owner)

    raw = r.get(keys.head(name))
    state = loaded = None
    try:
        state = from_manifest(manifest_from_bytes(raw)) if raw is not None else None
        loaded = restorer.load_head(writer.store, name, state.cache) if state else None
    except (SchemaError, SegmentStoreError, KeyError, ValueError) as e:  # a bad manifest too: never a crash loop
        return _recover(new_life(), state.cache if state else None, str(e)[:200])
    if state is None or loaded is None:
        return _started(new_life())
    if (foreign := _foreign(rt, state.cache, loaded.kv)) is not None:  # laid out, it would kill or corrupt
        loaded.release()
        return _recover(new_life(), state.cache, foreign)
    t0 = time.perf_counter()
    device = rt.loaded.device
    try:  # the loop copies each segment to the device as it lays it out
        engine = StreamEngine(
            rt,
            state.spec,
            policy,
            restore=(state.cache, lambda seg: loaded.to(loaded.kv[seg.id], device)),
            load_embeds=lambda chunk: loaded.to(e, device) if (e := loaded.embeds.get(chunk)) is not None else None,
            **sinks(state.cache.epoch),
        )
    finally:
        loaded.release()  # its copies are queued: the slot is reused once they are done
    owned = OwnedStream(r, writer, cfg, engine, live, frames, writes, features, kept, owner)
    owned.opened = {
        "gb": round(loaded.nbytes / 1e9, 3),
        "read_s": round(loaded.read_s, 3),  # read and checked into host memory, a slot's wait included
        "apply_s": round(time.perf_counter() - t0, 3),  # copied and laid out by the GPU loop, waiting for it included
    }
    log.info(
        "stream restored",
        stream=name,
        version=state.cache.version_id,
        last_frame_seq=engine.head.last_frame_seq,
        **owned.opened,
    )
    return owned


def _foreign(rt: Runtime, cache: CacheState, kv: dict[str, torch.Tensor]) -> str | None:
    """Why a head's K/V, read back whole, is not this model's (the model was changed over a kept
    store: other layers, heads or sizes), or None. Laid out in the cache, such K/V raised in the GPU
    loop's copy, out of the stream's task and the worker, or was broadcast into place (a size 1)."""
    pool = rt.pool
    for p in cache.placements:
        want = (pool.layers, 2, pool.kv_heads, p.segment.tokens, pool.head_dim)
        if (got := tuple(kv[p.segment.id].shape)) != want:
            return f"segment {p.segment.id} is {got}, this model's K/V {want}: another model's cache"
    return None


def _kept_manifests(r: redis.Redis, name: str, keep: int) -> list[Manifest]:
    """The newest ``keep`` manifests on the stream's versions, oldest first. A new owner's first
    collections keep their segments too: a mirror may still be loading one of those versions, and
    collected with only the new owner's own versions in mind, they were gone at its first publish."""
    kept = []
    for _, fields in reversed(r.xrevrange(keys.versions(name), count=keep)):
        try:
            kept.append(decode_manifest(fields))
        except SchemaError:
            continue  # a damaged entry names nothing to keep
    return kept


def _started(owned: OwnedStream) -> OwnedStream:
    """An empty cache published as the stream's head."""
    owned.publish(owned.engine.head)
    event(owned.r, owned.name, "started", epoch=owned.engine.head.epoch)
    return owned


def _recover(owned: OwnedStream, lost: CacheState | None, reason: str) -> OwnedStream:
    """A head that cannot be restored: its kept chunks re-encoded from the frames log into
    ``owned`` (a new life), published with a `rebuilt` event and metric; with no log, or none of
    the chunks in it, the stream starts over (`cache_restarted`)."""
    name = owned.name
    t0 = time.perf_counter()
    done = _rebuild(owned, lost) if lost is not None and owned.cfg.framelog_dir else None
    if done is None or not done[0]:
        metrics.CACHE_RESTARTS.labels(name).inc()
        log.error("cache not restorable; the stream starts over", stream=name, error=reason)
        event(owned.r, name, "cache_restarted", reason=reason)
        return _started(owned)
    chunks, frames, skipped = done
    owned.publish(owned.engine.head)
    seconds = round(time.perf_counter() - t0, 3)
    metrics.CACHE_REBUILDS.labels(name).inc()
    log.warning("cache rebuilt from the frames log", stream=name, chunks=chunks, frames=frames, skipped=len(skipped))
    ranges = " ".join(f"{a}-{b}" for a, b in skipped)[:200]
    event(
        owned.r,
        name,
        "rebuilt",
        chunks=chunks,
        frames=frames,
        seconds=seconds,
        skipped=len(skipped),
        skipped_seqs=ranges,
        reason=reason,
        epoch=owned.engine.head.epoch,
        last_frame_seq=owned.engine.head.last_frame_seq,
    )
    return owned


def _rebuild(owned: OwnedStream, lost: CacheState) -> tuple[int, int, list[tuple[int, int]]]:
    """Re-encode the lost version's chunks, oldest first, from the frames log through the ordinary
    append path (batched with live work by the scheduler), so positions come out re-based and
    contiguous: the cache of a fresh encode of the kept frames. A chunk whose frames the log does
    not hold exactly is skipped. Returns (chunks and frames re-encoded, the skipped chunks' frame seqs)."""
    framelog = FrameLog(owned.cfg.framelog_dir)
    tp = owned.engine.rt.loaded.temporal_patch_size
    chunks, frames, skipped = 0, 0, []
    for placement in lost.placements:
        seg = placement.segment
        if not seg.n_patches:
            continue  # the prefix: a new engine has its own
        try:
            chunk = _logged_chunk(framelog, owned.name, seg, seg.n_patches * tp - seg.padded_frames)
            if chunk is not None:
                owned.engine.append([m.rgb() for m in chunk], [m.ts for m in chunk], [m.seq for m in chunk])
        except (FrameLogError, OSError, ValueError) as e:
            log.warning("chunk not rebuilt", stream=owned.name, frame_seqs=seg.frame_seqs, error=str(e))
            chunk = None
        if chunk is None:
            skipped.append(seg.frame_seqs)
            continue
        chunks, frames = chunks + 1, frames + len(chunk)
    return chunks, frames, skipped


def _logged_chunk(framelog: FrameLog, name: str, seg: Segment, count: int) -> list[FrameMsg] | None:
    """The ``count`` frames a chunk was encoded from, as the log holds them (its seqs, captured in
    its time range: a stream's numbering may have started over); None unless the log holds exactly
    that many (a frame missing, or one the encoder had dropped, makes the chunk ambiguous)."""
    (first, last), (t0, t1) = seg.frame_seqs, seg.capture_range
    records = {rec.seq: rec for rec in framelog.frames(name, first, last) if t0 <= rec.ts <= t1}
    if len(records) != count:
        return None
    return [decode(records[seq].raw) for seq in sorted(records)]


def dead_letter_frame(
    r: redis.Redis, frames: redis.Redis, frames_key: str, entry_id: str, fields: dict, reason: str
) -> None:
    """The record on the durable Redis (where operators read dead letters), then the ack where the
    frame is; one transaction when both are one Redis."""
    if frames is r:
        redisio.dead_letter(r, frames_key, entry_id, fields, reason, group=keys.ENCODER_GROUP)
        return
    redisio.dead_letter(r, frames_key, entry_id, fields, reason)
    frames.xack(frames_key, keys.ENCODER_GROUP, entry_id)


def event(r: redis.Redis, stream: str, kind: str, **fields: object) -> None:
    redisio.event(r, stream, "encoder", kind, **fields)
