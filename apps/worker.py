"""`streamvqa worker`: encoder and QA in one process, for one GPU that owns its streams.

One copy of the weights and one copy of each cache: questions read the encoder's versions
directly (zero-copy snapshots), nothing goes through the segment store on the way. The store
still receives every segment, so a restart continues where it stopped.
"""

from __future__ import annotations

import threading

from apps.worker_config import WorkerConfig
from common import boot
from common.engine.kvcache import Version
from common.segment_store import open_store
from encoder_worker.service import EncoderService
from qa_worker.service import QAService


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


def main(argv: list[str]) -> int:
    cfg, r = boot.start(WorkerConfig, argv, "streamvqa worker")
    rt = boot.load_runtime(cfg.model, cfg.device)
    encoder = EncoderService(cfg, rt, r, open_store(cfg.segment_store, r))
    QAService(cfg, rt, r, LocalVersions(encoder)).run(boot.stop_on_signals())
    return 0
