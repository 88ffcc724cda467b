"""`streamvqa recorder`: every camera's frames into the frames log (common/framelog.py).

One loop: read every camera's frames stream through the consumer group `rec` (its own pending
entries first after a restart), append each frame's payload to its camera's log, and every
`framelog_sync_s` commit each camera's batch (write + fdatasync) and only then ack its entries.
An acked frame is on disk; one not acked is read again after a crash and, found in the log
already (by its seq), acked without a second write. A failed commit (a full disk: `LogFull`) acks
nothing of that camera: readiness fails naming the reason, an event says so on the camera, reading
pauses and the writes are retried, with backoff, from the pending entries until they succeed.

Retention runs every `collect_every_s`: whole files last written more than `retention_hours` ago,
then the oldest while a camera's log exceeds `retention_gb` (then an event: space forced it); the
logs of cameras no longer recorded (removed, renamed) too, their newest file included.
A Redis outage is waited out for `redis_grace_s` (exit 3 past it).

Search: each camera's chunk vectors (its features stream, from the encoder) go into its index
beside its log (recorder/index.py), saved every `features_save_s` and collected with the files.
"""

from __future__ import annotations

import contextlib
import threading
import time

import redis
import structlog

from common import boot, health, metrics, redisio
from common.clock import SharedClock
from common.config import load_cameras_file
from common.framelog import CameraWriter, FrameLog, FrameLogError, LogLocked, Removed
from common.wire import keys
from common.wire.schemas import FIELD, SchemaError, frame_header, unpack_frame
from recorder.config import RecorderConfig
from recorder.index import Indexes

log = structlog.get_logger()

SOURCE = "recorder"  # the events' `source`
RETRY_MIN_S, RETRY_MAX_S = 0.5, 10.0  # backoff of writes after a failed commit
STATS_EVERY_S = 5.0  # how often the backlog and log-size gauges are refreshed
# Frames held for the next commit: past this, reading waits for it (catching up after an outage
# would otherwise hold as much as Redis hands out in framelog_sync_s). 128 MB is 500 frames of
# 250 KB: 4x what 64 cameras at 2 fps send a second.
MAX_UNCOMMITTED_BYTES = 128 << 20
READINESS_CHECK = "frames_log"  # the readiness check that fails while writes do


class Recorder:
    def __init__(self, cfg: RecorderConfig, r: redis.Redis, frames: redis.Redis | None = None) -> None:
        """``frames``: the Redis holding the frames streams (default ``r``, which gets the events)."""
        self.cfg, self.r = cfg, r
        self.frames = frames or r
        self.clock = SharedClock(self.frames)  # what ingest stamps frames with; this host's may be off
        self.names = list(cfg.streams) or [c.name for c in load_cameras_file(cfg.cameras_file).cameras]
        self.log = FrameLog(cfg.framelog_dir)
        self.writers: dict[str, CameraWriter] = {}
        self.indexes = Indexes(r, self.frames, self.log, self.names)
        self.reader = redisio.GroupReader(
            self.frames,
            [keys.frames(n) for n in self.names] + [keys.features(n) for n in self.names],
            keys.RECORDER_GROUP,
            cfg.consumer,
            count=cfg.read_count,
            block_ms=cfg.block_ms,
        )
        self.unacked: dict[str, list[str]] = {n: [] for n in self.names}  # durable at the next commit
        self.failing: dict[str, str] = {}  # camera -> why its last write failed
        self.retry_s = RETRY_MIN_S
        self.retry_at = 0.0
        self.last_commit = time.monotonic()
        self.last_collect = self.last_stats = float("-inf")
        self.last_save = time.monotonic()
        self.started = False

    def open_writers(self) -> None:
        """Every camera's writer now, so that a second recorder on the same log is refused at start
        (LogLocked); a log that cannot be opened yet (a full disk) is retried like a failed write."""
        for name in self.names:
            try:
                self._writer(name)
            except LogLocked:
                raise
            except FrameLogError as e:  # tried again with the camera's first frame
                log.error("frames log not writable yet", stream=name, reason=e.reason)

    def run(self, stop: threading.Event) -> None:
        log.info("recorder started", streams=self.names, dir=self.cfg.framelog_dir, consumer=self.cfg.consumer)
        both = [self.r] if self.frames is self.r else [self.r, self.frames]  # either may be the one away
        try:
            redisio.run_riding_out(both, self.step, stop, self.cfg.redis_grace_s, on_back=self.after_outage)
            with contextlib.suppress(*redisio.OUTAGE_ERRORS):  # what is left un-acked is read again
                self.commit()
                self.indexes.save_all()
        finally:
            for w in self.writers.values():
                w.close()

    def step(self) -> None:
        if not self.started:
            self._claim_orphans()
            self.started = True
        self.clock.refresh_if_due()
        now = time.monotonic()
        if self.failing and now < self.retry_at:  # the disk is the outage: nothing is read meanwhile
            time.sleep(min(self.retry_at - now, self.cfg.block_ms / 1000))
            return
        wait_ms = int((self.last_commit + self.cfg.framelog_sync_s - now) * 1000)
        if sum(w.pending_bytes for w in self.writers.values()) >= MAX_UNCOMMITTED_BYTES:
            # enough held for this commit: the rest waits in Redis, also when the commit is due now
            # (reading then, before committing, held a second read past the bound)
            time.sleep(max(0, wait_ms) / 1000)
            entries = []
        else:
            entries = self.reader.read(block_ms=max(1, min(self.cfg.block_ms, wait_ms)))
        broken: dict[str, str] = {}
        for stream, entry_id, fields in entries:
            cam = keys.stream_of(stream)
            if stream == keys.features(cam):
                self.indexes.add(cam, entry_id, fields)
            elif cam not in broken:
                try:
                    self._record(cam, entry_id, fields)
                except FrameLogError as e:
                    broken[cam] = e.reason
        if broken or self.failing or time.monotonic() - self.last_commit >= self.cfg.framelog_sync_s:
            self._settle(broken | self.commit())
        self._collect_if_due()
        if time.monotonic() - self.last_save >= self.cfg.features_save_s:
            self.last_save = time.monotonic()
            self.indexes.save_all()
        self._stats_if_due()

    def after_outage(self) -> None:
        """Redis is back: acks may have been lost on the way, so what is pending is read again (found
        in the log, it is acked without a second write)."""
        for ids in [*self.unacked.values(), *self.indexes.unacked.values()]:
            ids.clear()
        self.reader.reset()

    # -- writing ------------------------------------------------------------------------------

    def _writer(self, cam: str) -> CameraWriter:
        w = self.writers.get(cam)
        if w is None:
            w = self.writers[cam] = self.log.writer(cam, self.cfg.framelog_roll_s)
        return w

    def _record(self, cam: str, entry_id: str, fields: dict[bytes, bytes]) -> None:
        """Append one frames entry to its camera's log; acked with the next commit either way."""
        reason = None
        try:
            m = unpack_frame(fields)
            if m.get("eos", False):
                reason = "eos"
            else:
                seq, ts, epoch = frame_header(m)
                reason = self._ahead(cam, entry_id, ts)
        except SchemaError as e:  # the encoder dead-letters it; here it is only not logged
            log.warning("frames entry unreadable; not logged", stream=cam, entry_id=entry_id, error=str(e))
            reason = "bad"
        if reason is None and not self._writer(cam).append(seq, ts, fields[FIELD.encode()], epoch):
            reason = "duplicate"
        if reason is not None:
            metrics.RECORDER_SKIPPED.labels(cam, reason).inc()
        self.unacked[cam].append(entry_id)

    def _ahead(self, cam: str, entry_id: str, ts: float) -> str | None:
        """ "ahead" for a frame stamped further ahead of Redis's clock than `max_clock_skew_s`.
        Logged, it would be the camera's newest (its seq forged high too), and every real frame
        after it, no later in seq and stamp, taken for one already logged: for good, as a writer
        picks up its last seq and stamp from the log. A file's stamps are media seconds, far behind."""
        ahead_s = ts - self.clock.now()
        if ahead_s <= self.cfg.max_clock_skew_s:
            return None
        log.warning("frame stamped ahead of Redis's clock; not logged", stream=cam, entry_id=entry_id, ahead_s=ahead_s)
        return "ahead"

    def commit(self) -> dict[str, str]:
        """Make every camera's appended frames durable, then ack them; the cameras whose commit
        failed, and why (their entries stay pending: read again, written again)."""
        self.last_commit = time.monotonic()
        failed: dict[str, str] = {}
        acks = self.frames.pipeline(transaction=False)
        for cam in self.names:
            w = self.writers.get(cam)
            if w is not None:
                self._report_left(cam, w)
            try:
                if w is not None and w.pending:
                    frames, t0 = w.pending, time.perf_counter()
                    written = w.commit()
                    metrics.RECORDER_COMMIT_SECONDS.observe(time.perf_counter() - t0)
                    metrics.RECORDER_FRAMES.labels(cam).inc(frames)
                    metrics.RECORDER_BYTES.labels(cam).inc(written)
            except FrameLogError as e:
                failed[cam] = e.reason
                continue
            if self.unacked[cam]:
                acks.xack(keys.frames(cam), keys.RECORDER_GROUP, *self.unacked[cam])
        acks.execute()
        for cam in self.names:
            if cam not in failed:
                self.unacked[cam].clear()
        return failed

    def _report_left(self, cam: str, w: CameraWriter) -> None:
        """An event per newest file the writer could not resume (an I/O error) and left for a new
        one: its frames are not read back, and the operator should know of the disk."""
        for data, why in w.take_left():
            redisio.event(self.r, cam, SOURCE, "frames_log_file_left", file=data.name, reason=why)

    def _settle(self, failed: dict[str, str]) -> None:
        """After a commit: on failures, say so (once per camera and outage), drop what those cameras
        read (it stays pending in Redis) and back off; once every write succeeds again, say that."""
        if failed:
            for cam, reason in failed.items():
                if cam not in self.failing:
                    log.error("frames log write failed; not acked, retried", stream=cam, reason=reason)
                    redisio.event(self.r, cam, SOURCE, "frames_log_failing", reason=reason)
                self.unacked[cam].clear()
            self.failing |= failed
            reasons = "; ".join(f"{cam}: {why}" for cam, why in sorted(self.failing.items()))
            health.READINESS.failing[READINESS_CHECK] = reasons
            metrics.RECORDER_WRITE_FAILING.set(1)
            self.reader.reset()
            self.retry_at = time.monotonic() + self.retry_s
            self.retry_s = min(2 * self.retry_s, RETRY_MAX_S)
        elif self.failing:
            for cam in self.failing:
                log.info("frames log writes resumed", stream=cam)
                redisio.event(self.r, cam, SOURCE, "frames_log_resumed")
            self.failing.clear()
            health.READINESS.failing.pop(READINESS_CHECK, None)
            metrics.RECORDER_WRITE_FAILING.set(0)
            self.retry_s = RETRY_MIN_S

    def _claim_orphans(self) -> None:
        """Entries another consumer of the group left pending (the recorder ran under another
        name) become ours: one recorder writes a frames log, so nobody else is working on them."""
        self.reader.ensure_groups()
        for name in self.names:
            for key in (keys.frames(name), keys.features(name)):
                redisio.claim_stale(self.frames, key, keys.RECORDER_GROUP, self.cfg.consumer, 0, count=10_000)
        self.reader.reset()

    # -- retention and gauges ------------------------------------------------------------------

    def _collect_if_due(self) -> None:
        if time.monotonic() - self.last_collect < self.cfg.collect_every_s:
            return
        self.last_collect = time.monotonic()
        # cameras no longer recorded (removed from the cameras file, renamed) too: their frames
        # would otherwise stay on disk past retention for good
        for cam in sorted({*self.names, *self.log.cameras()}):
            unwritten = cam not in self.names
            try:
                removed = self.log.collect(
                    cam, self.cfg.retention_hours, self.cfg.retention_bytes(), unwritten=unwritten
                )
                if removed:
                    self.indexes.forget_collected(cam)
            except OSError as e:
                log.error("frames log retention failed", stream=cam, error=str(e))
                continue
            for reason in ("age", "space"):
                gone = [x for x in removed if x.reason == reason]
                if gone:
                    self._collected(cam, reason, gone)

    def _collected(self, cam: str, reason: str, gone: list[Removed]) -> None:
        nbytes = sum(x.bytes for x in gone)
        metrics.RECORDER_COLLECTED.labels(cam, reason).inc(nbytes)
        first = min((x.first_ts for x in gone if x.first_ts is not None), default="")
        last = max((x.last_ts for x in gone if x.last_ts is not None), default="")
        fields = {"files": len(gone), "bytes": nbytes, "frames": sum(x.frames for x in gone), "from": first, "to": last}
        if reason == "space":  # history shorter than retention_hours: the operator should know
            log.warning("frames log over retention_gb; oldest files deleted", stream=cam, **fields)
            if cam in self.names:  # an event of a camera no longer recorded would list it again (/api/streams)
                redisio.event(self.r, cam, SOURCE, "frames_log_collected", reason=reason, **fields)
        else:
            log.info("frames log files past retention_hours deleted", stream=cam, **fields)

    def _stats_if_due(self) -> None:
        if time.monotonic() - self.last_stats < STATS_EVERY_S:
            return
        self.last_stats = time.monotonic()
        for cam in self.names:
            metrics.RECORDER_LOG_BYTES.labels(cam).set(self.log.size(cam))
            groups = self.frames.xinfo_groups(keys.frames(cam))
            g = next((g for g in groups if redisio.text(g["name"]) == keys.RECORDER_GROUP), None)
            if g is not None:
                metrics.RECORDER_BACKLOG.labels(cam).set(int(g.get("lag") or 0) + int(g["pending"]))


def main(argv: list[str]) -> int:
    cfg, r = boot.start(RecorderConfig, argv, "streamvqa recorder")
    recorder = Recorder(cfg, r, boot.frames_redis(cfg, r))
    try:
        recorder.open_writers()
    except LogLocked as e:
        boot.fail(boot.EXIT_CONFIG, "frames log in use by another recorder", dir=cfg.framelog_dir, error=str(e))
    return redisio.exit_code(lambda: recorder.run(boot.stop_on_signals()))
