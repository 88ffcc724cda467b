"""API settings: defaults < YAML (--config) < SVQA_API_<FIELD>, then SVQA_<FIELD>, environment < flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.config import ReaderSettings, RedisSettings, setting

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class ApiConfig(ReaderSettings, RedisSettings):
    """`streamvqa api`: the HTTP API and web page over the Redis protocol."""

    ENV_PREFIX: ClassVar[str] = "SVQA_API_"  # SVQA_API_PORT; shared settings (SVQA_REDIS_URL) still apply

    host: str = setting("127.0.0.1", "the address the HTTP API listens on (not loopback: set a `token`)")
    port: int = setting(8080, "the port the HTTP API listens on")
    token: str | None = setting(
        None,
        "when set, every /api and /v1 request needs `Authorization: Bearer <token>` (`SVQA_API_TOKEN`); never logged",
        secret=True,
    )
    max_body_bytes: int = setting(64 * 1024, "larger request bodies get 413")
    answer_timeout_s: float = setting(120.0, "longest wait for a final answer")
    keep_alive_s: float = setting(
        15.0,
        "a streamed answer sends an SSE comment after this long without an event: a question queued behind "
        "others sends nothing until its first token, and proxies cut idle connections (nginx: 60 s)",
    )

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
