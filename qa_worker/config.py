"""QA worker settings: defaults < YAML (--config) < SVQA_* environment < flags."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from common.config import GPUSettings
from common.engine.names import DEFAULT_MODEL
from common.wire.schemas import check_stream_name


@dataclass(frozen=True)
class QAConfig(GPUSettings):
    redis_url: str = "redis://localhost:6379/0"
    frames_redis_url: str | None = None  # frames and frame pictures, best a Redis without AOF; None: redis_url
    streams: tuple[str, ...] = ()  # streams whose versions this worker mirrors and answers on
    cameras_file: str | None = None  # alternatively every camera in this file (and its jobs)
    model: str = DEFAULT_MODEL
    device: str | None = None
    segment_store: str = "/var/lib/streamvqa/segments"
    reply_ttl_s: int = 3600
    answers_maxlen: int = 10_000
    claim_idle_ms: int = 60_000  # questions pending this long on a dead worker are taken over
    block_ms: int = 1000
    transcript_dir: str | None = None  # where subtitle jobs write .vtt/.srt files
    consumer: str = f"{socket.gethostname()}-{os.getpid()}"
    redis_grace_s: float = 300.0  # ride out a Redis outage this long, then exit 3
    max_deliveries: int = 3  # a question delivered more often gets an error reply unprocessed
    max_reply_ttl_s: int = 86_400  # cap on a question's own reply_ttl
    max_in_flight: int = 32  # questions answered at once (their decode steps share GPU batches)
    metrics_port: int | None = None
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        GPUSettings.__post_init__(self)
        for name in self.streams:
            check_stream_name("streams", name)
        if not self.streams and not self.cameras_file:
            raise ValueError("no streams: set streams (SVQA_STREAMS=cam1,cam2) or cameras_file")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {self.max_in_flight}")
        if self.claim_idle_ms < 5 * self.block_ms:
            raise ValueError("claim_idle_ms must be well above block_ms")
