"""`streamvqa status`: what a person looks at first when something seems wrong.

Per stream: its source and grid (from ingest's meta), the head version (tokens, the capture-time
ranges it holds, age), frames and questions waiting, the worker that holds it; then each worker's
load (streams held / capacity) and the shared question queue.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import redis

from common import boot, placement, stream_status
from common.config import DEFAULT_REDIS_URL, RedisSettings, add_tool_flags, env_name
from common.logs import configure_logging, redact_url
from common.wire import keys


def streams(r: redis.Redis) -> list[str]:
    return stream_status.stream_names(k for pattern in stream_status.STREAM_PATTERNS for k in r.scan_iter(pattern))


def collect(r: redis.Redis, frames: redis.Redis | None = None) -> dict:
    """``frames``: the Redis holding the frames streams, when it is not ``r``."""
    names, pipe = streams(r), r.pipeline(transaction=False)
    stream_status.queue_all(pipe, names)
    found = stream_status.all_from(names, pipe.execute(raise_on_error=False), time.time())
    found["workers"] = workers(r, found)
    if frames is None or frames is r:
        return found
    pipe = frames.pipeline(transaction=False)
    stream_status.queue_frames(pipe, names)
    return stream_status.frames_from(found, pipe.execute(raise_on_error=False))


def workers(r: redis.Redis, found: dict) -> list[dict]:
    """Live workers, each with the streams ``found``'s leases name it the holder of."""
    ids, pipe = placement.worker_ids(r.smembers(keys.WORKERS)), r.pipeline(transaction=False)
    placement.queue_workers(pipe, ids)
    return stream_status.workers_from(ids, pipe.execute(raise_on_error=False), found["streams"], found["at"])


def _clock(t: float, now: float) -> str:
    """A wall-clock capture time in local time; with its date when that is not today's."""
    local = time.localtime(t)
    same_day = local[:3] == time.localtime(now)[:3]
    return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M:%S", local)


def _ranges(ranges: list[list[float]], live: bool, now: float) -> str:
    """Capture-time ranges: local time for a live stream (its capture times are epoch seconds), else
    seconds into the file."""
    if live:
        return ",".join(f"{_clock(s, now)}-{_clock(e, now)}" for s, e in ranges) or "-"
    return ",".join(f"{s:.1f}-{e:.1f}s" for s, e in ranges) or "-"


def _newest(head: dict) -> str:
    """How old the newest frame a live stream's head holds is; a file's has no age."""
    return f" (newest {head['lag_s']}s ago)" if head.get("lag_s") is not None else ""


def render(found: dict) -> str:
    lines = []
    if "redis" in found:  # which Redis was asked (main's); collect() alone does not know its URL
        frames = f", frames on {found['frames_redis']}" if "frames_redis" in found else ""
        default = " (the default: SVQA_REDIS_URL is not set)" if found.get("redis_is_default") else ""
        lines.append(f"redis {found['redis']}{default}{frames}")
    for s in found["streams"]:
        head = s.get("head") or {}
        lease = s["lease"]["holder"] if s["lease"] else "-"
        frames, questions = s["frames"], s["questions"]
        video = _ranges(head.get("ranges") or [], s["live"], found["at"]) + _newest(head)
        age = f"{head['age_s']}s" if head.get("age_s") is not None else "-"
        lines.append(
            f"{s['stream']:<16} v{head.get('version', '-'):<6} {head.get('tokens', 0):>8} tok  "
            f"seq {head.get('last_frame_seq', '-'):<6} video {video}  version age {age}  "
            f"frames waiting {frames.get('lag', 0) + frames.get('pending', 0):<5} "
            f"questions {questions.get('lag', 0) + questions.get('pending', 0):<4} worker {lease}  {s['source'] or ''}"
        )
        if s["grid"] is None:  # ingest describes a stream once its source opened
            ev = s["last_event"] or {}
            lines.append(f"{'':<16} never connected; last event: {ev.get('type', '-')} {ev.get('error', '')}".rstrip())
    for w in found["workers"]:
        capacity = "unbounded" if w["capacity"] is None else w["capacity"]
        namesake = "  ANOTHER LIVE PROCESS USES THIS NAME: give each worker its own" if w.get("namesake") else ""
        line = f"worker {w['worker']:<24} {w['load']}/{capacity} streams: {','.join(w['streams']) or '-'}"
        lines.append(line + namesake)
    q = found["questions"]
    lines.append(
        f"questions: {q.get('lag', 0)} to route, {q.get('pending', 0)} being routed, "
        # a consumer of the group is a QA process that read the queue within the last hour (then pruned),
        # not necessarily a live one: the live stream owners are the `worker` lines above
        f"{q.get('consumers', 0)} qa consumers seen in the last hour; dead letters: {found['dead_letters']}"
    )
    return "\n".join(lines)


def _default_redis(url: str) -> bool:
    """Whether no one chose this Redis: it may well be an unrelated local one."""
    return url == DEFAULT_REDIS_URL and env_name("redis_url") not in os.environ


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamvqa status", description=__doc__.splitlines()[0])
    add_tool_flags(p, RedisSettings, ["redis_url", "frames_redis_url"])
    p.add_argument("--json", action="store_true", help="everything, as JSON")
    ns = p.parse_args(argv[1:])
    configure_logging("WARNING")
    r = boot.connect_tool(ns.redis_url, "streamvqa status")
    frames = boot.connect_tool(ns.frames_redis_url, "streamvqa status") if ns.frames_redis_url else None
    # which Redis was asked comes first: a wrong one (a default) reads as "no streams"
    asked = {"redis": redact_url(ns.redis_url), "redis_is_default": _default_redis(ns.redis_url)}
    asked |= {"frames_redis": redact_url(ns.frames_redis_url)} if frames else {}
    try:
        found = asked | collect(r, frames)
    except redis.exceptions.NoPermissionError as e:  # a role that may not look around (client, qa)
        boot.fail(
            boot.EXIT_REDIS,
            "redis refused",
            service="streamvqa status",
            error=str(e),
            hint="status reads every stream's keys: run it as the `api` Redis user (README, Redis users)",
        )
    print(json.dumps(found, indent=1) if ns.json else render(found))
    return 0
