"""`streamvqa encoder`: take leases on streams, read their frames, publish cache versions.

One loop: keep leases, read frames of owned streams (consumer group `enc`, own pending entries
first after a restart), hand each to its OwnedStream. A bad entry is dead-lettered; nothing a
message contains can stop the loop.
"""

from __future__ import annotations

import threading
import time

import redis
import structlog

from common import boot, metrics, redisio
from common.config import load_cameras_file
from common.engine.kvcache import Version
from common.engine.runtime import Runtime
from common.lease import Lease
from common.segment_store import SegmentStore, open_store
from common.wire import keys
from common.wire.schemas import SchemaError, decode_frame
from encoder_worker.config import EncoderConfig
from encoder_worker.stream import LeaseLost, OwnedStream, StreamNotReady, event, open_stream

log = structlog.get_logger()


class EncoderService:
    def __init__(self, cfg: EncoderConfig, rt: Runtime, r: redis.Redis, store: SegmentStore):
        self.cfg, self.rt, self.r, self.store = cfg, rt, r, store
        self.names = list(cfg.streams) or [c.name for c in load_cameras_file(cfg.cameras_file).cameras]
        self.leases = {n: Lease(r, n, cfg.consumer, cfg.lease_ms) for n in self.names}
        self.owned: dict[str, OwnedStream] = {}
        self.reader = redisio.GroupReader(r, [], keys.ENCODER_GROUP, cfg.consumer, count=32, block_ms=cfg.block_ms)
        self._last_lease_check = 0.0

    # -- a version source for QA in the same process (qa_worker.service.VersionSource) -----------
    def get(self, stream: str, at: int | None = None) -> Version | None:
        """The head of an owned stream (`at` answers only when it names the head)."""
        owned = self.owned.get(stream)
        if owned is None:
            return None
        head = owned.engine.head
        return head if at in (None, head.id) else None

    def serves(self, stream: str) -> bool:
        return stream in self.names

    def run(self, stop: threading.Event) -> None:
        log.info("encoder started", streams=self.names, consumer=self.cfg.consumer)
        while not stop.is_set():
            self.step()
        for name in list(self.owned):
            self._release(name)

    def step(self) -> None:
        """One blocking read of frames; leases are kept between entries, since encoding a batch of
        chunks can outlast a lease on a slow device."""
        self._keep_leases_if_due()
        for frames_key, entry_id, fields in self.reader.read():
            self._keep_leases_if_due()
            self._handle(frames_key, entry_id, fields)

    def _keep_leases_if_due(self) -> None:
        if time.monotonic() - self._last_lease_check > self.cfg.lease_ms / 3000:
            self._keep_leases()

    def _keep_leases(self) -> None:
        self._last_lease_check = time.monotonic()
        for name, lease in self.leases.items():
            if name in self.owned:
                if not lease.renew():
                    log.warning("lease lost; another encoder owns the stream now", stream=name)
                    self._drop(name)
            elif lease.acquire():
                try:
                    self.owned[name] = open_stream(self.rt, self.r, self.store, self.cfg, name)
                except StreamNotReady:
                    lease.release()  # ingest has not described the stream yet; try again later
                    continue
                # Frames another consumer read but never acked belong to a dead owner: take them over
                # before reading on, so nothing is skipped and the file source is not held back.
                redisio.ensure_group(self.r, keys.frames(name), keys.ENCODER_GROUP)
                redisio.claim_stale(self.r, keys.frames(name), keys.ENCODER_GROUP, self.cfg.consumer, 0, count=10_000)
                self.reader.add(keys.frames(name))
                event(self.r, name, "encoder_attached", consumer=self.cfg.consumer)

    def _handle(self, frames_key: str, entry_id: str, fields: dict) -> None:
        owned = self.owned.get(keys.stream_of(frames_key))
        if owned is None:
            return  # lease lost between read and handle: the new owner gets it redelivered
        bound = log.bind(stream=owned.name, entry=entry_id)
        try:
            msg = decode_frame(fields)
        except SchemaError as e:
            bound.warning("bad frame dead-lettered", error=str(e))
            metrics.FRAMES_DROPPED.labels(owned.name, "bad").inc()
            redisio.dead_letter(self.r, frames_key, entry_id, fields, str(e), group=keys.ENCODER_GROUP)
            return
        try:
            owned.add(entry_id, msg)
        except LeaseLost:
            bound.warning("lease lost while publishing; the stream's new owner continues from its head")
            self._drop(owned.name)
        except (ValueError, RuntimeError) as e:  # engine refused the chunk: keep the worker alive
            bound.error("chunk failed; frames dead-lettered", error=str(e))
            for eid, _ in owned.pending:
                redisio.dead_letter(self.r, frames_key, eid, {}, f"chunk failed: {e}", group=keys.ENCODER_GROUP)
            owned.pending = []

    def _drop(self, name: str) -> None:
        self.owned.pop(name, None)
        self.reader.remove(keys.frames(name))

    def _release(self, name: str) -> None:
        self._drop(name)
        self.leases[name].release()


def main(argv: list[str]) -> int:
    cfg, r = boot.start(EncoderConfig, argv, "streamvqa encoder")
    rt = boot.load_runtime(cfg.model, cfg.device)
    EncoderService(cfg, rt, r, open_store(cfg.segment_store, r)).run(boot.stop_on_signals())
    return 0
