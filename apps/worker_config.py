"""`streamvqa worker` settings, apart from apps/worker.py so that they load without torch."""

from __future__ import annotations

from dataclasses import dataclass

from encoder_worker.config import EncoderConfig
from qa_worker.config import QAConfig


@dataclass(frozen=True)
class WorkerConfig(QAConfig, EncoderConfig):
    """`streamvqa worker`: encoder and qa in one process, one copy of the weights (settings of both)."""

    def __post_init__(self) -> None:
        EncoderConfig.__post_init__(self)
        QAConfig.__post_init__(self)
