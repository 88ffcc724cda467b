"""What Redis holds about each stream, read in one pipeline round trip.

Shared by `streamvqa status` (sync redis) and the HTTP API (redis.asyncio): both queue the same
commands on a pipeline (``queue_*``), execute it their own way with ``raise_on_error=False``, and
interpret the replies here (``*_from``), so the two can never disagree about what a field means.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from common import placement
from common.lease import holder_name
from common.logs import redact_url
from common.wire import keys
from common.wire.meta import StreamMeta
from common.wire.schemas import SchemaError, manifest_from_bytes

# Key patterns whose presence means "a stream of that name exists": described by ingest, encoded,
# or only ever failing (events).
STREAM_PATTERNS = tuple(f"{keys.PREFIX}:{{*}}:{kind}" for kind in ("meta", "head", "events"))
RECENT_EVENTS = 200  # how far back status looks for the source's state and the drop counter
# The source's last word on its connection: ingest events that mean it is up, and those that mean down.
_UP = {"connected"}
_DOWN = {"error", "stalled", "reconnecting", "gave_up", "eof"}
_LAST_EVENT_FIELDS = ("type", "at", "error", "reconnects", "attempt")  # why a camera is not delivering


def presence_keys(name: str, *, failing: bool = False) -> tuple[str, ...]:
    """Keys of which any one means the stream exists (one EXISTS, one hash slot): ingest described
    it or an encoder published a version; with ``failing``, its events alone will do (a camera that
    never connected, whose events say why)."""
    return (keys.meta(name), keys.head(name), *((keys.events(name),) if failing else ()))


def stream_names(found_keys: Iterable[bytes | str]) -> list[str]:
    """Stream names from keys matched by ``STREAM_PATTERNS``."""
    return sorted({keys.stream_of(k) for k in found_keys})


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def queue_group(pipe: Any, stream_key: str) -> None:
    pipe.xlen(stream_key)
    pipe.xinfo_groups(stream_key)


def group_from(replies: list[Any], group: str) -> dict:
    """(XLEN, XINFO GROUPS) replies -> length, pending, lag, consumers of ``group``."""
    length, groups = replies
    info: dict = {"length": length if isinstance(length, int) else 0}
    if isinstance(groups, Exception):  # no such stream yet
        return info
    for g in groups:
        if _text(g["name"]) == group:
            info |= {"pending": int(g["pending"]), "lag": int(g.get("lag") or 0), "consumers": int(g["consumers"])}
    return info


_PER_STREAM = 10  # replies queue_stream adds


def queue_stream(pipe: Any, name: str) -> None:
    """Queue what ``stream_from`` reads."""
    pipe.hgetall(keys.meta(name))
    pipe.get(keys.head(name))
    queue_group(pipe, keys.frames(name))
    pipe.get(keys.lease(name))
    pipe.pttl(keys.lease(name))
    pipe.xrevrange(keys.events(name), count=RECENT_EVENTS)
    queue_group(pipe, keys.questions(name))
    pipe.hgetall(keys.drops(name))


def stream_from(name: str, replies: list[Any], now: float) -> dict:
    meta_raw, head_raw, xlen, groups, holder, ttl, events, q_len, q_groups, drops = replies
    out: dict = {"stream": name}
    try:
        meta = StreamMeta.from_hash(meta_raw if isinstance(meta_raw, dict) else {})
    except SchemaError as e:
        meta, out["error"] = None, f"bad meta: {e}"
    out |= {
        "source": redact_url(meta.url) if meta else None,  # written redacted; older data may not be
        "fps": meta.fps if meta else None,
        "grid": f"{meta.grid.height}x{meta.grid.width}" if meta else None,
        "live": meta is not None and meta.live,
    }
    if head_raw:
        out["head"] = _head(head_raw, out["live"], now)
    out["frames"] = group_from([xlen, groups], keys.ENCODER_GROUP)
    out["lease"] = {"holder": holder_name(holder), "ttl_ms": ttl} if holder else None
    out["questions"] = group_from([q_len, q_groups], keys.QA_GROUP)  # routed here, for its owner
    out |= _from_events(events if isinstance(events, list) else [])
    out["dropped"] = sum(int(n) for n in drops.values()) if isinstance(drops, dict) else None
    return out


def _head(raw: bytes, live: bool, now: float) -> dict:
    try:
        m = manifest_from_bytes(raw)
    except SchemaError as e:
        return {"error": str(e)}
    return {
        "version": m.version,
        "epoch": m.epoch,  # changes when the stream started over (its version ids with it)
        "tokens": m.cache_tokens,
        "last_frame_seq": m.last_frame_seq,
        "time_range": [m.first_ts, m.last_ts],
        "ranges": [list(r) for r in m.ranges()],  # several once salient chunks are kept
        "age_s": round(now - m.created_at, 1),
        "lag_s": round(now - m.last_ts, 1) if live and m.last_ts else None,  # live capture times are wall-clock
        "evicted_tokens": m.evicted_tokens,
    }


def _from_events(events: list[tuple[Any, dict]]) -> dict:
    """`state`: the newest ingest event about the source (connected, reconnecting, eof...; None if it
    said nothing recently) and `connected` from it; `last_event`: the newest event of any kind."""
    state, last = None, None
    for _, raw in events:  # newest first
        fields = {_text(k): _text(v) for k, v in raw.items()}
        last = last or {k: fields[k] for k in _LAST_EVENT_FIELDS if k in fields}
        kind = fields.get("type", "")
        if state is None and kind in _UP | _DOWN:
            state = kind
    connected = None if state is None else state in _UP
    return {"state": state, "connected": connected, "last_event": last}


def queue_frames(pipe: Any, names: list[str]) -> None:
    """Queue each stream's frames queue, for a frames Redis apart from the one ``queue_all`` reads."""
    for name in names:
        queue_group(pipe, keys.frames(name))


def frames_from(found: dict, replies: list[Any]) -> dict:
    """``found`` (from ``all_from``) with each stream's frames queue taken from ``queue_frames``'s replies."""
    for i, stream in enumerate(found["streams"]):
        stream["frames"] = group_from(replies[2 * i : 2 * i + 2], keys.ENCODER_GROUP)
    return found


def queue_all(pipe: Any, names: list[str]) -> None:
    """Queue every stream's status and the question queue's."""
    for name in names:
        queue_stream(pipe, name)
    queue_group(pipe, keys.QUESTIONS)
    pipe.xlen(keys.DEAD_LETTER)


def all_from(names: list[str], replies: list[Any], now: float) -> dict:
    """The replies of ``queue_all`` -> what `streamvqa status --json` prints."""
    per = [replies[i * _PER_STREAM : (i + 1) * _PER_STREAM] for i in range(len(names))]
    rest = replies[len(names) * _PER_STREAM :]
    return {
        "at": now,
        "streams": [stream_from(name, r, now) for name, r in zip(names, per, strict=True)],
        "questions": group_from(rest[:2], keys.QA_GROUP),
        "dead_letters": rest[2],
    }


# --------------------------------------------------------------------------- workers (placement)
# Two steps: the ids from `keys.WORKERS` (SMEMBERS), then ``placement.queue_workers(pipe, ids)`` and
# ``workers_from`` on its replies.


def workers_from(ids: list[str], replies: list[Any], streams: list[dict], now: float) -> list[dict]:
    """Live stream-owning workers: the streams each holds, its load and capacity (None: no bound),
    and whether another live process uses its name (`namesake`). What a worker holds is read from
    ``streams``' leases (``all_from``'s): two processes under one name write one heartbeat, and
    the idle one's said the other held nothing."""
    raw = {i: r for i, r in zip(ids, replies, strict=True) if isinstance(r, dict)}
    held: dict[str, list[str]] = {}
    for s in streams:
        if s["lease"]:
            held.setdefault(s["lease"]["holder"], []).append(s["stream"])
    return [
        {
            "worker": w.worker,
            "streams": held.get(w.worker, []),
            "load": len(held.get(w.worker, [])),
            "capacity": w.capacity,
            "namesake": placement.namesake_seen(raw[w.worker], now),
        }
        for w in placement.workers_from(ids, replies)
    ]
