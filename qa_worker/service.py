"""`streamvqa qa`: answer questions from `svqa:questions` against mirrored cache versions.

Two threads: the mirror tails cache versions; the main loop reads questions (consumer group
`qa`, own pending entries first after a restart), reclaims questions of dead workers, and runs
periodic jobs when they are due.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
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

PRUNE_EVERY_S = 600.0  # how often dead consumers are removed from the questions group


class VersionSource(Protocol):
    """Where versions come from: a Mirror (separate encoder) or the encoder in this process."""

    def get(self, stream: str, at: int | None = None) -> Version | None: ...
    def serves(self, stream: str) -> bool: ...
    def run(self, stop: threading.Event) -> None: ...
    def wait_ready(self, stop: threading.Event) -> None: ...


def served_streams(cfg: QAConfig) -> list[str]:
    return list(cfg.streams) or [c.name for c in load_cameras_file(cfg.cameras_file).cameras]


class QAService:
    def __init__(
        self, cfg: QAConfig, rt: Runtime, r: redis.Redis, versions: VersionSource, frames: redis.Redis | None = None
    ):
        """``frames``: the Redis holding frame pictures, for alerts (default ``r``)."""
        self.cfg, self.rt, self.r = cfg, rt, r
        self.versions = versions
        self.answerer = Answerer(
            rt,
            r,
            versions.get,
            versions.serves,
            consumer=cfg.consumer,
            reply_ttl_s=cfg.reply_ttl_s,
            max_reply_ttl_s=cfg.max_reply_ttl_s,
            answers_maxlen=cfg.answers_maxlen,
            max_deliveries=cfg.max_deliveries,
        )
        jobs = list(load_cameras_file(cfg.cameras_file).jobs) if cfg.cameras_file else []
        self.jobs = JobRunner(
            r, versions.get, jobs, served_streams(cfg), model_answer(rt), cfg.transcript_dir, frames=frames
        )
        self.reader = redisio.GroupReader(
            r, [keys.QUESTIONS], keys.QA_GROUP, cfg.consumer, count=cfg.max_in_flight, block_ms=cfg.block_ms
        )
        # Questions are answered side by side, so the GPU scheduler batches their decode steps; a
        # free slot is taken before an entry is read, so at most max_in_flight are taken at once.
        self.questions_pool = ThreadPoolExecutor(max_workers=cfg.max_in_flight, thread_name_prefix="question")
        self.slots = threading.BoundedSemaphore(cfg.max_in_flight)
        self.in_flight: set[str] = set()  # entry ids being answered: a reclaim must not start them twice
        self._in_flight_lock = threading.Lock()
        self._last_claim = 0.0
        self._last_prune = time.monotonic()
        self.versions_failed: BaseException | None = None

    def run(self, stop: threading.Event) -> None:
        log.info("qa started", consumer=self.cfg.consumer)
        versions = threading.Thread(target=self._run_versions, args=(stop,), name="versions", daemon=True)
        versions.start()
        # Questions wait until the streams this worker serves are restored: after a restart, a
        # stream with a head must not answer "no frames yet".
        self.versions.wait_ready(stop)
        redisio.run_riding_out(self.r, self.step, stop, self.cfg.redis_grace_s, on_back=self.reader.reset)
        self.questions_pool.shutdown(wait=True)  # questions in flight get their final answers
        self.jobs.flush()
        versions.join(timeout=30)
        if self.versions_failed is not None:
            raise self.versions_failed

    def _run_versions(self, stop: threading.Event) -> None:
        """The versions thread; if it dies the whole worker stops (no half-alive worker)."""
        try:
            self.versions.run(stop)
        except BaseException as e:
            log.exception("versions thread failed; stopping")
            self.versions_failed = e
            stop.set()

    def step(self) -> None:
        if time.monotonic() - self._last_claim > self.cfg.claim_idle_ms / 2000:
            self._last_claim = time.monotonic()
            stale = redisio.claim_stale(
                self.r, keys.QUESTIONS, keys.QA_GROUP, self.cfg.consumer, self.cfg.claim_idle_ms
            )
            self._dispatch(stale)
            redisio.trim_consumed(self.r, keys.QUESTIONS, keys.QA_GROUP)
        self._dispatch(self.reader.read())
        if time.monotonic() - self._last_prune > PRUNE_EVERY_S:
            self._last_prune = time.monotonic()
            redisio.prune_consumers(self.r, keys.QUESTIONS, keys.QA_GROUP, self.cfg.consumer)
        self.jobs.run_due()  # questions first: a person is waiting on those

    def _dispatch(self, entries: list[redisio.Entry]) -> None:
        for entry in entries:
            with self._in_flight_lock:
                if entry[1] in self.in_flight:
                    continue  # our own, still being answered (idle only because it is slow)
                self.in_flight.add(entry[1])
            self.slots.acquire()
            self.questions_pool.submit(self._answer_one, entry)

    def _answer_one(self, entry: redisio.Entry) -> None:
        try:
            self.answerer.handle_entries([entry])
        except redisio.OUTAGE_ERRORS as e:  # left pending: answered once Redis is back (claim_stale)
            log.warning("question left pending: Redis unreachable", entry=entry[1], error=str(e))
        except Exception:
            log.exception("question handling failed", entry=entry[1])
        finally:
            with self._in_flight_lock:
                self.in_flight.discard(entry[1])
            self.slots.release()


def main(argv: list[str]) -> int:
    cfg, r = boot.start(QAConfig, argv, "streamvqa qa")
    rt = boot.load_runtime(cfg.model, cfg.device)
    mirror = Mirror(rt, r, open_store(cfg.segment_store, r), served_streams(cfg), cfg.block_ms)
    service = QAService(cfg, rt, r, mirror, boot.frames_redis(cfg, r))
    return redisio.exit_code(lambda: service.run(boot.stop_on_signals()))
