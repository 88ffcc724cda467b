"""Ingest settings: defaults < YAML (--config) < SVQA_* environment < flags.

Either one source (`url` + `stream`) or a cameras file with several.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.config import MAX_FPS, CamerasSettings, ServiceSettings, check_pixel_bounds, setting
from common.wire.schemas import check_stream_name


@dataclass(frozen=True)
class IngestConfig(CamerasSettings):
    """`streamvqa ingest`: reads cameras and files into Redis frame streams."""

    url: str | None = setting(
        None, "one source instead of a cameras file: a file, rtsp://, http(s):// (HLS), /dev/videoN"
    )
    stream: str | None = setting(None, "the one source's stream (camera) name")
    fps: float = setting(2.0, "the one source's frames a second, sampled by presentation time")
    realtime: bool | None = setting(
        None, "pace a file like a camera (live streams drop, files wait)", shown="by source: live sources only"
    )
    min_pixels: int = setting(
        128 * 28 * 28, "the fewest pixels a frame is resized to for the model grid (28×28 pixels a token)"
    )
    max_pixels: int = setting(
        256 * 28 * 28,
        "the most pixels a frame is resized to; the grid follows the picture as shown (a phone clip's "
        "rotation, anamorphic pixels)",
    )
    frames_maxlen: int = setting(2000, "files: the frames stream's cap (MAXLEN ~; backpressure keeps it short)")
    frames_max_age_s: float = setting(120.0, "live: frames older than this leave the frames stream (XADD MINID ~)")
    frame_codec: Literal["webp", "jpeg", "png", "rgb24"] = setting(
        "webp", "frames on the wire: `webp`/`png` lossless, `jpeg` (q95, 4:4:4), `rgb24` raw"
    )
    max_backlog: int = setting(64, "files: how many frames a file may run ahead of the encoder")
    open_timeout_s: float = setting(10.0, "source watchdog: seconds to open a source")
    read_timeout_s: float = setting(
        10.0, "source watchdog: a source stalls when nothing decodes for this long (or its clock stands still)"
    )
    reconnect_min_s: float = setting(0.5, "the first backoff between reconnects (with jitter, doubling)")
    reconnect_max_s: float = setting(
        30.0, "the longest backoff between reconnects; both start over once a session has delivered frames"
    )
    max_reconnects: int | None = setting(None, "live sources give up after this many reconnects; none: never")

    def __post_init__(self) -> None:
        ServiceSettings.__post_init__(self)
        self._check_sources()
        check_pixel_bounds(self.min_pixels, self.max_pixels)
        if not 0 < self.fps <= MAX_FPS:
            raise ValueError(f"fps must be in (0, {MAX_FPS:g}], got {self.fps}")
        # Each of these at 0 or below did something worse than refuse: a file that waits for ever
        # (max_backlog), XADD refused at the first frame (frames_maxlen), every source stalled at once.
        for name in ("max_backlog", "frames_maxlen"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("frames_max_age_s", "open_timeout_s", "read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.reconnect_min_s <= 0 or self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("need 0 < reconnect_min_s <= reconnect_max_s")
        if self.max_reconnects is not None and self.max_reconnects < 0:
            raise ValueError(f"max_reconnects must be 0 or more (none: never give up), got {self.max_reconnects}")

    def _check_sources(self) -> None:
        """One source or a cameras file, never both: the one source was dropped without a word."""
        if self.cameras_file is None and not (self.url and self.stream):
            raise ValueError("set url and stream (one source) or cameras_file")
        if self.cameras_file is not None and (self.url is not None or self.stream is not None):
            raise ValueError("url and stream (one source) cannot go with cameras_file: set one or the other")
        if self.stream is not None:
            check_stream_name("stream", self.stream)
