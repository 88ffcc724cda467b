"""`streamvqa status`: what a person looks at first when something seems wrong.

Per stream: its source and grid (from ingest's meta), the head version (tokens, capture-time
range, age), frames waiting for the encoder, the lease holder; then the question queue.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import redis

from common import boot
from common.logs import configure_logging, redact_url
from common.wire import keys
from common.wire.meta import StreamMeta
from common.wire.schemas import SchemaError, manifest_from_bytes


def streams(r: redis.Redis) -> list[str]:
    """Every stream Redis knows of: described by ingest, encoded, or only ever failing (events)."""
    found = set()
    for kind in ("meta", "head", "events"):
        found |= {keys.stream_of(k) for k in r.scan_iter(f"{keys.PREFIX}:{{*}}:{kind}")}
    return sorted(found)


def last_event(r: redis.Redis, name: str) -> dict | None:
    """The newest ingest/encoder event: why a camera that never connected is not delivering."""
    got = r.xrevrange(keys.events(name), count=1)
    if not got:
        return None
    fields = {k.decode(): v.decode(errors="replace") for k, v in got[0][1].items()}
    return {k: fields[k] for k in ("type", "at", "error", "reconnects", "attempt") if k in fields}


def group_info(r: redis.Redis, stream_key: str, group: str) -> dict:
    try:
        groups = r.xinfo_groups(stream_key)
    except redis.ResponseError:
        return {"length": 0}
    info = {"length": r.xlen(stream_key)}
    for g in groups:
        name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
        if name == group:
            info |= {"pending": int(g["pending"]), "lag": int(g.get("lag") or 0), "consumers": int(g["consumers"])}
    return info


def stream_status(r: redis.Redis, name: str, now: float) -> dict:
    try:
        meta = StreamMeta.from_hash(r.hgetall(keys.meta(name)))
    except SchemaError as e:
        meta = None
        out_error = f"bad meta: {e}"
    else:
        out_error = None
    out: dict = {
        "stream": name,
        "source": redact_url(meta.url) if meta else None,  # written redacted; older data may not be
        "fps": meta.fps if meta else None,
        "grid": f"{meta.grid.height}x{meta.grid.width}" if meta else None,
    }
    if out_error:
        out["error"] = out_error
    raw = r.get(keys.head(name))
    if raw:
        try:
            m = manifest_from_bytes(raw)
            live = meta is not None and meta.live  # live capture times are wall-clock: lag = now - newest frame
            out["head"] = {
                "version": m.version,
                "tokens": m.cache_tokens,
                "last_frame_seq": m.last_frame_seq,
                "time_range": [m.first_ts, m.last_ts],
                "age_s": round(now - m.created_at, 1),
                "lag_s": round(now - m.last_ts, 1) if live and m.last_ts else None,
                "evicted_tokens": m.evicted_tokens,
            }
        except SchemaError as e:
            out["head"] = {"error": str(e)}
    out["connected"] = meta is not None  # ingest describes a stream once its source opened
    out["last_event"] = last_event(r, name)
    out["frames"] = group_info(r, keys.frames(name), keys.ENCODER_GROUP)
    holder, ttl = r.get(keys.lease(name)), r.pttl(keys.lease(name))
    out["lease"] = {"holder": holder.decode(), "ttl_ms": ttl} if holder else None
    return out


def collect(r: redis.Redis) -> dict:
    now = time.time()
    return {
        "at": now,
        "streams": [stream_status(r, name, now) for name in streams(r)],
        "questions": group_info(r, keys.QUESTIONS, keys.QA_GROUP),
        "dead_letters": r.xlen(keys.DEAD_LETTER),
    }


def render(status: dict) -> str:
    lines = []
    for s in status["streams"]:
        head = s.get("head") or {}
        lease = s["lease"]["holder"] if s["lease"] else "-"
        frames = s["frames"]
        lines.append(
            f"{s['stream']:<16} v{head.get('version', '-'):<6} {head.get('tokens', 0):>8} tok  "
            f"seq {head.get('last_frame_seq', '-'):<6} age {head.get('age_s', '-')}s lag {head.get('lag_s') or '-'}s  "
            f"frames waiting {frames.get('lag', 0) + frames.get('pending', 0):<5} encoder {lease}  {s['source'] or ''}"
        )
        if not s["connected"]:
            ev = s["last_event"] or {}
            lines.append(f"{'':<16} never connected; last event: {ev.get('type', '-')} {ev.get('error', '')}".rstrip())
    q = status["questions"]
    lines.append(
        f"questions: {q.get('lag', 0)} queued, {q.get('pending', 0)} being answered, "
        f"{q.get('consumers', 0)} qa workers; dead letters: {status['dead_letters']}"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamvqa status", description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default=os.environ.get("SVQA_REDIS_URL", "redis://localhost:6379/0"))
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv[1:])
    configure_logging("WARNING")
    r = boot.connect_tool(ns.redis_url, "streamvqa status")
    status = collect(r)
    print(json.dumps(status, indent=1) if ns.json else render(status))
    return 0
