"""`streamvqa qa`: answer questions from `svqa:questions` against mirrored cache versions.

Two threads: the mirror tails cache versions; the main loop reads questions (consumer group
`qa`, own pending entries first after a restart), reclaims questions of dead workers, and runs
periodic jobs when they are due.
"""

from __future__ import annotations

import signal
import threading
import time

import redis
import structlog

from common import keys, metrics, redisio
from common.config import ConfigError, load_cameras_file, load_config
from common.engine import Runtime
from common.logs import configure_logging
from common.model import load_model
from common.segment_store import open_store
from qa_worker.answering import Answerer
from qa_worker.config import QAConfig
from qa_worker.mirror import Mirror

log = structlog.get_logger()


class QAService:
    def __init__(self, cfg: QAConfig, rt: Runtime, r: redis.Redis):
        self.cfg, self.rt, self.r = cfg, rt, r
        cameras = load_cameras_file(cfg.cameras_file) if cfg.cameras_file else None
        names = list(cfg.streams) or [c.name for c in cameras.cameras]
        self.mirror = Mirror(rt, r, open_store(cfg.segment_store, r), names, cfg.block_ms)
        self.answerer = Answerer(rt, r, self.mirror.get, self.mirror.serves, reply_ttl_s=cfg.reply_ttl_s,
                                 answers_maxlen=cfg.answers_maxlen)  # fmt: skip
        self.reader = redisio.GroupReader(r, [keys.QUESTIONS], keys.QA_GROUP, cfg.consumer, count=1,
                                          block_ms=cfg.block_ms)  # fmt: skip
        self._last_claim = 0.0

    def run(self, stop: threading.Event) -> None:
        log.info("qa started", streams=list(self.mirror.streams), consumer=self.cfg.consumer)
        mirror = threading.Thread(target=self.mirror.run, args=(stop,), name="mirror", daemon=True)
        mirror.start()
        while not stop.is_set():
            self.step()
        mirror.join(timeout=5)

    def step(self) -> None:
        if time.monotonic() - self._last_claim > self.cfg.claim_idle_ms / 2000:
            self._last_claim = time.monotonic()
            stale = redisio.claim_stale(self.r, keys.QUESTIONS, keys.QA_GROUP, self.cfg.consumer,
                                        self.cfg.claim_idle_ms)  # fmt: skip
            for _, entry_id, fields in stale:
                self.answerer.handle(entry_id, fields)
        for _, entry_id, fields in self.reader.read():
            self.answerer.handle(entry_id, fields)


def main(argv: list[str]) -> int:
    try:
        cfg = load_config(QAConfig, argv[1:], prog="streamvqa qa")
    except ConfigError as e:
        print(f"streamvqa qa: {e}")
        return 2
    configure_logging(cfg.log_level)
    metrics.serve(cfg.metrics_port)
    try:
        r = redisio.wait_for_redis(cfg.redis_url, timeout_s=30, block_ms=cfg.block_ms)
    except TimeoutError as e:
        log.error("redis unusable at start", error=str(e))
        return 3
    try:
        rt = Runtime(load_model(cfg.model, device=cfg.device))
    except (OSError, ValueError) as e:
        log.error("model unusable at start", model=cfg.model, error=str(e))
        return 4
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    QAService(cfg, rt, r).run(stop)
    return 0
