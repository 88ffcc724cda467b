"""`streamvqa worker`: encoder and QA in one process, for one GPU that owns its streams.

One copy of the weights and one copy of each cache: questions read the encoder's versions
directly (zero-copy snapshots), nothing goes through the segment store on the way. The store
still receives every segment, so a restart continues where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

from common import boot
from common.segment_store import open_store
from encoder_worker.config import EncoderConfig
from encoder_worker.service import EncoderService
from qa_worker.config import QAConfig
from qa_worker.service import QAService


@dataclass(frozen=True)
class WorkerConfig(QAConfig, EncoderConfig):
    """Every setting of both roles (SVQA_* names are shared where they mean the same)."""

    def __post_init__(self) -> None:
        EncoderConfig.__post_init__(self)
        QAConfig.__post_init__(self)


def main(argv: list[str]) -> int:
    cfg, r = boot.start(WorkerConfig, argv, "streamvqa worker")
    rt = boot.load_runtime(cfg.model, cfg.device)
    encoder = EncoderService(cfg, rt, r, open_store(cfg.segment_store, r))
    QAService(cfg, rt, r, encoder).run(boot.stop_on_signals())  # the encoder is QA's version source
    return 0
