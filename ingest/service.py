"""`streamvqa ingest`: publish frames of one source, or of every camera in a cameras file."""

from __future__ import annotations

import threading

import redis
import structlog

from common import boot, redisio
from common.config import load_cameras_file
from ingest.config import IngestConfig
from ingest.source import Source, SourceSpec
from ingest.video import is_live

log = structlog.get_logger()


def source_specs(cfg: IngestConfig) -> list[SourceSpec]:
    if cfg.cameras_file is None:
        assert cfg.url and cfg.stream
        realtime = cfg.realtime if cfg.realtime is not None else is_live(cfg.url)
        return [SourceSpec(cfg.stream, cfg.url, cfg.fps, realtime, cfg.min_pixels, cfg.max_pixels)]
    return [
        SourceSpec(
            c.name,
            c.url,
            c.fps,
            c.realtime if c.realtime is not None else is_live(c.url),
            c.min_pixels or cfg.min_pixels,
            c.max_pixels or cfg.max_pixels,
        )
        for c in load_cameras_file(cfg.cameras_file).cameras
    ]


def run(cfg: IngestConfig, r: redis.Redis, stop: threading.Event, frames: redis.Redis | None = None) -> int:
    """``frames``: where frames and the latest-frame pictures go (default ``r``)."""
    sources = [Source(r, spec, cfg, stop, frames) for spec in source_specs(cfg)]
    results: dict[str, int] = {}

    def one(source: Source) -> None:
        try:
            results[source.spec.stream] = source.run()
        except redisio.RedisGone as e:  # past the grace period: exit 3, get restarted
            log.error("redis gone past the grace period; source stopped", stream=source.spec.stream, error=str(e))
            results[source.spec.stream] = 3
            stop.set()
        except redis.RedisError as e:  # Redis refused a command: exit non-zero, get restarted
            log.error("redis failed; source stopped", stream=source.spec.stream, error=str(e))
            results[source.spec.stream] = 1
            stop.set()

    threads = [threading.Thread(target=one, args=(s,), name=f"ingest:{s.spec.stream}") for s in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if 3 in results.values():
        return 3
    failed = [name for name, rc in results.items() if rc]
    if failed:
        log.error("no usable frames", streams=failed)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    cfg, r = boot.start(IngestConfig, argv, "streamvqa ingest")
    return run(cfg, r, boot.stop_on_signals(), boot.frames_redis(cfg, r))
