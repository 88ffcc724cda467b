"""`streamvqa qa`: answer questions from `svqa:questions` against mirrored cache versions.

Two threads: the mirror tails cache versions; the main loop reads questions (consumer group
`qa`, own pending entries first after a restart), reclaims questions of dead workers, and runs
periodic jobs when they are due.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import redis
import structlog

from common import boot, redisio
from common.config import load_cameras_file
from common.engine.kvcache import Version
from common.engine.runtime import Runtime
from common.segment_store import open_store
from common.wire import keys
from qa_worker.answering import Answerer
from qa_worker.config import QAConfig
from qa_worker.jobs import JobRunner, model_answer
from qa_worker.mirror import Mirror

log = structlog.get_logger()


class VersionSource(Protocol):
    """Where versions come from: a Mirror (separate encoder) or the encoder in this process."""

    def get(self, stream: str, at: int | None = None) -> Version | None: ...
    def serves(self, stream: str) -> bool: ...
    def run(self, stop: threading.Event) -> None: ...


def served_streams(cfg: QAConfig) -> list[str]:
    return list(cfg.streams) or [c.name for c in load_cameras_file(cfg.cameras_file).cameras]


class QAService:
    def __init__(self, cfg: QAConfig, rt: Runtime, r: redis.Redis, versions: VersionSource):
        self.cfg, self.rt, self.r = cfg, rt, r
        self.versions = versions
        self.answerer = Answerer(
            rt, r, versions.get, versions.serves, reply_ttl_s=cfg.reply_ttl_s, answers_maxlen=cfg.answers_maxlen
        )
        jobs = list(load_cameras_file(cfg.cameras_file).jobs) if cfg.cameras_file else []
        self.jobs = JobRunner(r, versions.get, jobs, served_streams(cfg), model_answer(rt), cfg.transcript_dir)
        self.reader = redisio.GroupReader(
            r, [keys.QUESTIONS], keys.QA_GROUP, cfg.consumer, count=1, block_ms=cfg.block_ms
        )
        self._last_claim = 0.0

    def run(self, stop: threading.Event) -> None:
        log.info("qa started", consumer=self.cfg.consumer)
        versions = threading.Thread(target=self.versions.run, args=(stop,), name="versions", daemon=True)
        versions.start()
        while not stop.is_set():
            self.step()
        self.jobs.flush()
        versions.join(timeout=30)

    def step(self) -> None:
        if time.monotonic() - self._last_claim > self.cfg.claim_idle_ms / 2000:
            self._last_claim = time.monotonic()
            stale = redisio.claim_stale(
                self.r, keys.QUESTIONS, keys.QA_GROUP, self.cfg.consumer, self.cfg.claim_idle_ms
            )
            for _, entry_id, fields in stale:
                self.answerer.handle(entry_id, fields)
        for _, entry_id, fields in self.reader.read():
            self.answerer.handle(entry_id, fields)
        self.jobs.run_due()  # questions first: a person is waiting on those


def main(argv: list[str]) -> int:
    cfg, r = boot.start(QAConfig, argv, "streamvqa qa")
    rt = boot.load_runtime(cfg.model, cfg.device)
    mirror = Mirror(rt, r, open_store(cfg.segment_store, r), served_streams(cfg), cfg.block_ms)
    QAService(cfg, rt, r, mirror).run(boot.stop_on_signals())
    return 0
