"""QA worker settings: defaults < YAML (--config) < SVQA_* environment < flags."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from common.config import ModelSettings, QueueSettings, setting


@dataclass(frozen=True)
class QAConfig(ModelSettings, QueueSettings):
    """`streamvqa qa`: answers questions and runs the cameras file's jobs on the streams' cache versions."""

    reply_ttl_s: int = setting(3600, "seconds an answer stream is kept, unless the question sets its own `reply_ttl`")
    answers_maxlen: int = setting(10_000, "final answers kept in the audit stream `svqa:answers`")
    claim_idle_ms: int = setting(60_000, "questions pending this long on a dead worker are taken over")
    transcript_dir: str | None = setting(None, "where subtitle jobs write `<stream>.vtt` / `.srt`")
    max_reply_ttl_s: int = setting(86_400, "cap on a question's own `reply_ttl`")
    max_in_flight: int = setting(
        128,
        "questions taken at once: being answered (`gpu_max_batch` at most, their decode steps batched) or waiting, "
        "in order and told their place, for the GPU; further ones wait in their stream's queue",
    )
    alerts_maxlen: int = setting(10_000, "alerts kept per stream (`svqa:{cam}:alerts`), the oldest trimmed")
    alert_frame_ttl_s: int = setting(7 * 24 * 3600, "seconds the frame an alert fired on is kept (7 days)")
    alert_base_url: str | None = setting(
        None,
        "the HTTP API as alert receivers reach it (`http://nvr.lan:8080`): an alert's `frame` is a URL under it;"
        " none: a path on the API",
    )
    mqtt_discovery_prefix: str | None = setting(
        "homeassistant", "Home Assistant MQTT discovery of alert jobs (binary sensors) under this prefix; none: off"
    )
    history_max_tokens: int = setting(
        8192,
        "a question about a past span (`since`) is answered from at most this many tokens of it, chunks chosen "
        "evenly over the span from the frames log and encoded again for it: more sees the span more densely, "
        "and costs its first token more encoding and the GPU's KV pool more memory while it is answered "
        '(README "Asking about the past")',
    )
    history_max_concurrent: int = setting(
        2,
        "questions about the past (`since`, `scope: history`) answered at once, each holding a temporary cache "
        "of up to `history_max_tokens` in the GPU's KV pool; later ones wait in order, told their place, for "
        "`max_queue_wait_s` at most. Two: one is answered while the next is encoded, and since history caches "
        "are encoded in the GPU time questions have beside the cameras' guaranteed share, more at once finish no "
        "sooner, they only hold more of the pool (2 x 8192 tokens: 0.6 GB at 3B, kept out of the live streams' room)",
    )

    def __post_init__(self) -> None:
        ModelSettings.__post_init__(self)
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {self.max_in_flight}")
        if self.claim_idle_ms < 5 * self.block_ms:
            raise ValueError("claim_idle_ms must be well above block_ms")
        QueueSettings.__post_init__(self)
        if self.history_max_concurrent < 1:
            raise ValueError(f"history_max_concurrent must be at least 1, got {self.history_max_concurrent}")
        if self.history_max_tokens < 1:
            raise ValueError(f"history_max_tokens must be at least 1, got {self.history_max_tokens}")
        if self.alerts_maxlen < 1 or self.alert_frame_ttl_s < 1:
            raise ValueError("alerts_maxlen and alert_frame_ttl_s must be at least 1")
        if self.alert_base_url and urlsplit(self.alert_base_url).scheme not in ("http", "https"):
            raise ValueError(f"alert_base_url must be an http(s) URL, got {self.alert_base_url!r}")
