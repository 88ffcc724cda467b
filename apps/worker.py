"""`streamvqa worker`: encoder and QA in one process, for one GPU that owns its streams.

One copy of the weights and one copy of each cache: questions read the encoder's versions
directly (zero-copy snapshots), nothing goes through the segment store on the way. The store
still receives every segment, so a restart continues where it stopped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import structlog

from common import boot, redisio
from common.engine.kvcache import Version
from common.segment_store import open_store
from common.wire import keys
from encoder_worker.config import EncoderConfig
from encoder_worker.service import EncoderService
from qa_worker.config import QAConfig
from qa_worker.service import QAService

log = structlog.get_logger()


@dataclass(frozen=True)
class WorkerConfig(QAConfig, EncoderConfig):
    """Every setting of both roles (SVQA_* names are shared where they mean the same)."""

    def __post_init__(self) -> None:
        EncoderConfig.__post_init__(self)
        QAConfig.__post_init__(self)


class LocalVersions:
    """Versions straight from the encoder in this process; its loop runs in the versions thread."""

    def __init__(self, encoder: EncoderService):
        self.encoder = encoder

    def get(self, stream: str, at: int | None = None) -> Version | None:
        owned = self.encoder.owned.get(stream)
        if owned is None:
            return None
        head = owned.engine.head
        return head if at in (None, head.id) else None

    def serves(self, stream: str) -> bool:
        return stream in self.encoder.names

    def run(self, stop: threading.Event) -> None:
        self.encoder.run(stop)

    def wait_ready(self, stop: threading.Event) -> None:
        """Until the encoder has restored every served stream that has a head (a predecessor's
        lease expires within lease_ms), so a question never meets a stream not yet reopened."""
        enc = self.encoder
        deadline = time.monotonic() + 2 * enc.cfg.lease_ms / 1000 + 5
        while waiting := [n for n in enc.names if n not in enc.owned and enc.r.exists(keys.head(n))]:
            if stop.wait(0.1) or time.monotonic() > deadline:
                log.warning("streams not restored in time; answering anyway", streams=waiting)
                return


def main(argv: list[str]) -> int:
    cfg, r = boot.start(WorkerConfig, argv, "streamvqa worker")
    rt = boot.load_runtime(cfg.model, cfg.device)
    encoder = EncoderService(cfg, rt, r, open_store(cfg.segment_store, r))
    service = QAService(cfg, rt, r, LocalVersions(encoder))
    return redisio.exit_code(lambda: service.run(boot.stop_on_signals()))
