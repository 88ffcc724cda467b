"""API settings: defaults < YAML (--config) < SVQA_API_<FIELD>, then SVQA_<FIELD>, environment < flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.config import QueueSettings, ReaderSettings, ServiceSettings, setting

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class ApiConfig(QueueSettings, ReaderSettings, ServiceSettings):
    """`streamvqa api`: the HTTP API and web page over the Redis protocol."""

    ENV_PREFIX: ClassVar[str] = "SVQA_API_"  # SVQA_API_PORT; shared settings (SVQA_REDIS_URL) still apply

    host: str = setting("127.0.0.1", "the address the HTTP API listens on (not loopback: set a `token`)")
    port: int = setting(8080, "the port the HTTP API listens on")
    token: str | None = setting(
        None,
        "when set (at least 16 characters), every /api and /v1 request needs `Authorization: Bearer <token>` "
        "(`SVQA_API_TOKEN`); never logged",
        secret=True,
    )
    max_body_bytes: int = setting(64 * 1024, "larger request bodies get 413")
    answer_timeout_s: float = setting(120.0, "longest wait for a final answer")
    keep_alive_s: float = setting(
        15.0,
        "a streamed answer sends an SSE comment after this long without an event: a question queued behind "
        "others sends nothing until its first token, and proxies cut idle connections (nginx: 60 s)",
    )
    redis_max_connections: int = setting(
        32, "Redis connections one API process's requests share; a request that waits 2 s for one gets 503 busy"
    )
    answer_readers: int = setting(
        2,
        "Redis connections that read every answer being waited for (api/answers.py): answers hold no pooled connection",
    )
    max_answers: int = setting(10_000, "answers one API process waits for at once; past it a question gets 503 busy")
    max_clips: int = setting(
        2,
        "clips one API process encodes at once (ten minutes of busy video: a core or two for tens of seconds, "
        "a few hundred MB); past it a clip gets 503 busy",
    )
    framelog_dir: str | None = setting(
        None,
        "the recorder's frames log, read-only: clips, snapshots and answers' evidence URLs (README \"Evidence\"); "
        "none: none of them",
    )

    def __post_init__(self) -> None:
        ServiceSettings.__post_init__(self)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not 0 < self.answer_timeout_s <= 3600:
            raise ValueError(f"answer_timeout_s must be in (0, 3600], got {self.answer_timeout_s}")
        QueueSettings.__post_init__(self)
        if not self.keep_alive_s > 0:
            raise ValueError(f"keep_alive_s must be > 0, got {self.keep_alive_s}")
        for name in ("redis_max_connections", "answer_readers", "max_answers", "max_clips"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.token is not None and len(self.token) < 16:
            raise ValueError("token must be at least 16 characters")

    @property
    def exposed_without_token(self) -> bool:
        return self.token is None and self.host not in LOOPBACK
