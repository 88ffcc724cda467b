"""Recorder settings: defaults < YAML (--config) < SVQA_* environment < flags."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import ClockSettings, ReaderSettings, StreamSettings, setting


@dataclass(frozen=True)
class RecorderConfig(ClockSettings, ReaderSettings, StreamSettings):
    """`streamvqa recorder`: keeps every camera's frames on disk (the frames log), with retention."""

    framelog_dir: str = setting(
        "/var/lib/streamvqa/frames", 'the frames log: `<dir>/<cam>/<start_ms>.log` and `.idx` (README "Frames log")'
    )
    framelog_sync_s: float = setting(
        1.0, "group commit: frames are written, fdatasynced and acked at most this often, never one by one"
    )
    framelog_roll_s: float = setting(600.0, "a new log file every this many seconds; retention deletes whole files")
    retention_hours: float | None = setting(
        24.0, "a camera's log files last written longer ago than this are deleted; none: no age limit"
    )
    retention_gb: float | None = setting(
        16.0,
        "a camera's log is kept under this many GB, its oldest files deleted first, with an event (16 x 64 "
        'cameras = 1 TB: README "Frames log"); none: no limit',
    )
    collect_every_s: float = setting(60.0, "how often retention runs")
    features_save_s: float = setting(
        30.0,
        "each camera's search index (its chunks' retrieval vectors, beside its frames log) is saved this often, "
        "at retention and at shutdown; a search sees the chunks saved",
    )
    read_count: int = setting(16, "frames entries read per camera and step")
    consumer: str = setting(
        "recorder", "the recorder's name in the frames' consumer group `rec`: one recorder per frames log"
    )

    def __post_init__(self) -> None:
        StreamSettings.__post_init__(self)
        for name in ("framelog_sync_s", "framelog_roll_s", "collect_every_s", "features_save_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("retention_hours", "retention_gb"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive or none, got {getattr(self, name)}")
        self.check_clock()
        if self.read_count < 1:
            raise ValueError(f"read_count must be 1 or more, got {self.read_count}")

    def retention_bytes(self) -> int | None:
        return None if self.retention_gb is None else int(self.retention_gb * 1e9)
