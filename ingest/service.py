"""`streamvqa ingest`: publish frames of one source, or of every camera in a cameras file."""

from __future__ import annotations

import os
import sys
import threading

import redis
import structlog

from common import boot, metrics, redisio
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
    """``frames``: where frames and the latest-frame pictures go (default ``r``).

    0 when every camera ended well, or when stopped (SIGTERM, Ctrl-C: cameras that had failed are
    still named); 3 when Redis stayed away past the grace period; else 1 once every camera has
    ended, naming those that failed (README "Start-up")."""
    results: dict[str, int] = {}

    def one(spec: SourceSpec) -> None:
        results[spec.stream] = run_source(spec, cfg, r, stop, frames)

    threads = [threading.Thread(target=one, args=(s,), name=f"ingest:{s.stream}") for s in source_specs(cfg)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if 3 in results.values():
        return 3
    failed = [name for name, rc in results.items() if rc]
    if failed:
        log.error("cameras failed", streams=failed)
    # a stop asked for is a clean end (systemd marks a unit whose stop exits 1 failed): a failed
    # camera fails the exit only when ingest ended by itself, for restart: on-failure
    return 1 if failed and not stop.is_set() else 0


def run_source(
    spec: SourceSpec, cfg: IngestConfig, r: redis.Redis, stop: threading.Event, frames: redis.Redis | None
) -> int:
    """One camera from its resume point to its end, in its own thread: its exit status. The Source
    is built here, not by the caller, since building it reads Redis: whatever fails, from a
    command Redis refuses (NOPERM: a camera added to the file before its keys to the ACL) to a
    bug, fails this camera alone, named, with an error event, and the others go on."""
    try:
        return Source(r, spec, cfg, stop, frames).run()
    except redisio.RedisGone as e:  # past the grace period: exit 3, get restarted
        log.error("redis gone past the grace period; source stopped", stream=spec.stream, error=str(e))
        stop.set()
        return 3
    except Exception as e:
        log.error("camera failed; its source stopped", stream=spec.stream, exc_info=True)
        camera_failed(r, spec.stream, e)
        return 1


def camera_failed(r: redis.Redis, stream: str, error: Exception) -> None:
    """Down in the metrics, and an error event when Redis takes it (a refused camera may not write one)."""
    metrics.INGEST_UP.labels(stream).set(0)
    try:
        redisio.event(r, stream, "ingest", "error", error=f"{type(error).__name__}: {error}")
    except redis.RedisError as e:
        log.warning("error event not written", stream=stream, error=str(e))


def main(argv: list[str]) -> int:
    cfg, r = boot.start(IngestConfig, argv, "streamvqa ingest")
    code = run(cfg, r, boot.stop_on_signals(), boot.frames_redis(cfg, r))
    _exit_past_lingering_cameras(code)
    return code


def _exit_past_lingering_cameras(code: int) -> None:
    """Exit now, without the interpreter's finalization, while a camera's thread is still inside
    FFmpeg (a stalled camera's read, an open that never answered): finalizing under it crashed
    the process at SIGTERM now and then (SIGSEGV, exit -11, in CI). Everything is written by now."""
    if any(t.is_alive() for t in threading.enumerate() if t is not threading.current_thread()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
