"""QA worker settings: defaults < YAML (--config) < SVQA_* environment < flags."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import ModelSettings, setting


@dataclass(frozen=True)
class QAConfig(ModelSettings):
    """`streamvqa qa`: answers questions and runs the cameras file's jobs on the streams' cache versions."""

    reply_ttl_s: int = setting(3600, "seconds an answer stream is kept, unless the question sets its own `reply_ttl`")
    answers_maxlen: int = setting(10_000, "final answers kept in the audit stream `svqa:answers`")
    claim_idle_ms: int = setting(60_000, "questions pending this long on a dead worker are taken over")
    transcript_dir: str | None = setting(None, "where subtitle jobs write `<stream>.vtt` / `.srt`")
    max_reply_ttl_s: int = setting(86_400, "cap on a question's own `reply_ttl`")
    max_in_flight: int = setting(32, "questions answered at once; their decode steps share the GPU scheduler's batches")

    def __post_init__(self) -> None:
        ModelSettings.__post_init__(self)
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {self.max_in_flight}")
        if self.claim_idle_ms < 5 * self.block_ms:
            raise ValueError("claim_idle_ms must be well above block_ms")
