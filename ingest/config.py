"""Ingest settings: defaults < YAML (--config) < SVQA_* environment < flags.

Either one source (`url` + `stream`) or a cameras file with several.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.wire.schemas import check_stream_name


@dataclass(frozen=True)
class IngestConfig:
    redis_url: str = "redis://localhost:6379/0"
    frames_redis_url: str | None = None  # frames and frame pictures, best a Redis without AOF; None: redis_url
    url: str | None = None  # a file, rtsp://, http(s):// (HLS), /dev/videoN
    stream: str | None = None  # the stream (camera) name
    fps: float = 2.0
    realtime: bool | None = None  # pace a file at media speed like a camera; None = live sources only
    cameras_file: str | None = None
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 256 * 28 * 28
    frames_maxlen: int = 2000  # files: MAXLEN ~ of the frames stream (backpressure keeps them short)
    frames_max_age_s: float = 120.0  # live: frames older than this are trimmed (XADD MINID ~)
    frame_codec: Literal["webp", "jpeg", "png", "rgb24"] = "webp"  # webp/png lossless, jpeg q95 4:4:4
    max_backlog: int = 64  # files: wait while this many frames are not yet encoded
    open_timeout_s: float = 10.0
    read_timeout_s: float = 10.0
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    max_reconnects: int | None = None  # live sources: give up after this many; None = never
    redis_grace_s: float = 300.0  # ride out a Redis outage this long, then exit 3
    metrics_port: int | None = None
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.cameras_file is None and not (self.url and self.stream):
            raise ValueError("set url and stream (one source) or cameras_file")
        if self.stream is not None:
            check_stream_name("stream", self.stream)
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels} and {self.max_pixels}")
        if not self.frames_max_age_s > 0:
            raise ValueError(f"frames_max_age_s must be positive, got {self.frames_max_age_s}")
        if not self.fps > 0:
            raise ValueError(f"fps must be positive, got {self.fps}")
        if self.reconnect_min_s <= 0 or self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("need 0 < reconnect_min_s <= reconnect_max_s")
