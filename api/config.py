"""API settings: defaults < YAML (--config) < SVQA_API_<FIELD>, then SVQA_<FIELD>, environment < flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class ApiConfig:
    """`streamvqa api`: the HTTP API and web page over the Redis protocol."""

    ENV_PREFIX: ClassVar[str] = "SVQA_API_"  # SVQA_API_PORT; shared settings (SVQA_REDIS_URL) still apply

    redis_url: str = "redis://localhost:6379/0"
    frames_redis_url: str | None = None  # frames and frame pictures, best a Redis without AOF; None: redis_url
    host: str = "127.0.0.1"
    port: int = 8080
    # when set, every /api and /v1 request needs `Authorization: Bearer <token>`; never logged
    token: str | None = field(default=None, repr=False, metadata={"secret": True})
    max_body_bytes: int = 64 * 1024  # larger request bodies get 413
    answer_timeout_s: float = 120.0  # longest wait for a final answer
    block_ms: int = 1000  # longest blocking Redis read per call
    # a streamed answer sends an SSE comment after this long without an event: a question queued
    # behind others sends nothing until its first token, and proxies cut idle connections (nginx: 60 s)
    keep_alive_s: float = 15.0
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not 0 < self.answer_timeout_s <= 3600:
            raise ValueError(f"answer_timeout_s must be in (0, 3600], got {self.answer_timeout_s}")
        if not self.keep_alive_s > 0:
            raise ValueError(f"keep_alive_s must be > 0, got {self.keep_alive_s}")
        if self.token is not None and len(self.token) < 16:
            raise ValueError("token must be at least 16 characters")

    @property
    def exposed_without_token(self) -> bool:
        return self.token is None and self.host not in LOOPBACK
