"""Redis connection and stream helpers shared by every service.

Consumer-group discipline (docs/DESIGN.md, "Reliability rules"): read your own pending entries
first (id "0") and then new ones (">"), ack only after the work is durable, reclaim entries of
dead consumers with XAUTOCLAIM, and cap every stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import structlog
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from common.wire import keys

log = structlog.get_logger(__name__)

Entry = tuple[str, str, dict[bytes, bytes]]  # (stream key, entry id, fields)

SOCKET_MARGIN_S = 5.0  # socket timeout = longest blocking read + this
CONNECT_RETRIES = 10  # ~10 s of exponential backoff (50 ms doubling, capped at 2 s)
HEALTH_CHECK_INTERVAL_S = 30
DEAD_LETTER_MAXLEN = 10_000
DEAD_LETTER_MAX_VALUE = 8 * 1024  # keep the dead-letter stream small: a frame is ~600 KB


def _str(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def redact(url: str) -> str:
    """The URL without its password, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def connect(url: str, *, block_ms: int = 5000, retries: int = CONNECT_RETRIES) -> redis.Redis:
    """A client for ``url`` whose commands survive a Redis restart of up to ~10 s.

    ``block_ms`` is the longest blocking read this client will issue; the socket timeout sits
    above it, because redis-py 8's default 5 s would turn a longer XREADGROUP BLOCK into a
    TimeoutError.
    """
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries)
    return redis.Redis.from_url(
        url,
        socket_timeout=block_ms / 1000 + SOCKET_MARGIN_S,
        socket_connect_timeout=5.0,
        socket_keepalive=True,
        retry=retry,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        decode_responses=False,
    )


def wait_for_redis(url: str, timeout_s: float, *, block_ms: int = 5000) -> redis.Redis:
    """Wait until Redis answers PING, then return ``connect(url)``; TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        # A probe without retries: connect()'s own backoff would overshoot the deadline.
        probe = redis.Redis.from_url(
            url,
            socket_timeout=max(0.1, min(2.0, left)),
            socket_connect_timeout=max(0.1, min(2.0, left)),
            retry=Retry(NoBackoff(), 0),
        )
        try:
            probe.ping()
            return connect(url, block_ms=block_ms)
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            last = e
        finally:
            probe.close()
        if time.monotonic() + 0.1 > deadline:
            raise TimeoutError(f"Redis at {redact(url)} not reachable after {timeout_s:g} s: {last}")
        time.sleep(0.1)


def ensure_group(r: redis.Redis, stream: str, group: str, start_id: str = "0") -> bool:
    """Create ``group`` on ``stream`` (and the stream) if missing; True if it was created."""
    try:
        r.xgroup_create(stream, group, id=start_id, mkstream=True)
        return True
    except ResponseError as e:
        if "BUSYGROUP" in str(e):
            return False
        raise


def _entries(resp: Any) -> list[Entry]:
    """Flatten an XREADGROUP reply (RESP2 list or RESP3 dict) into (stream, id, fields)."""
    items = resp.items() if isinstance(resp, dict) else (resp or [])
    out = []
    for stream, messages in items:
        if isinstance(messages, list) and messages and isinstance(messages[0], list):
            messages = messages[0]  # RESP3 wraps each stream's messages once more
        out.extend((_str(stream), _str(eid), fields) for eid, fields in messages)
    return out


def _drop_trimmed(r: redis.Redis, group: str, entries: list[Entry]) -> list[Entry]:
    """Ack pending entries whose data was trimmed away (MAXLEN): they cannot be processed."""
    gone = [(s, e) for s, e, f in entries if not f]  # redis-py reports a trimmed entry as {}
    for stream, eid in gone:
        log.warning("pending entry trimmed before processing; acking", stream=stream, entry_id=eid)
        r.xack(stream, group, eid)
    return [x for x in entries if x[2]] if gone else entries


def _check_block(r: redis.Redis, block_ms: int) -> None:
    timeout = r.connection_pool.connection_kwargs.get("socket_timeout")
    if timeout is not None and block_ms / 1000 >= timeout:
        raise ValueError(f"block_ms={block_ms} >= socket timeout {timeout} s: use connect(block_ms=...)")


def read_group(
    r: redis.Redis,
    stream_keys: Iterable[str],
    group: str,
    consumer: str,
    *,
    count: int = 10,
    block_ms: int = 5000,
) -> list[Entry]:
    """This consumer's pending entries if it has any (after a crash), else new ones (blocking).

    Stateless: entries left un-acked come back on every call. A consumer that keeps entries
    pending across reads on purpose (the encoder, until a chunk is complete) uses GroupReader.
    """
    streams = list(stream_keys)
    pending = _drop_trimmed(r, group, _entries(r.xreadgroup(group, consumer, dict.fromkeys(streams, "0"), count)))
    if pending:
        return pending
    _check_block(r, block_ms)
    return _entries(r.xreadgroup(group, consumer, dict.fromkeys(streams, ">"), count, block=block_ms))


class GroupReader:
    """Reads a consumer group the restart-safe way, keeping a cursor per stream.

    Starts on each stream with this consumer's pending history (id "0", paged by cursor), and
    switches that stream to new entries (">") once its history is drained, so entries the caller
    keeps un-acked are not returned again. Recreates the group if it vanished (Redis restarted
    without persistence). ``reset()`` goes back to the history, e.g. after claim_stale.
    """

    def __init__(
        self,
        r: redis.Redis,
        streams: Iterable[str],
        group: str,
        consumer: str,
        *,
        count: int = 10,
        block_ms: int = 5000,
        start_id: str = "0",
    ) -> None:
        _check_block(r, block_ms)
        self.r, self.group, self.consumer = r, group, consumer
        self.count, self.block_ms, self.start_id = count, block_ms, start_id
        self.cursors: dict[str, str] = {}
        for s in streams:
            self.add(s)

    def add(self, stream: str) -> None:
        ensure_group(self.r, stream, self.group, self.start_id)
        self.cursors[stream] = "0"

    def remove(self, stream: str) -> None:
        self.cursors.pop(stream, None)

    def reset(self) -> None:
        self.cursors = dict.fromkeys(self.cursors, "0")

    def read(self) -> list[Entry]:
        if not self.cursors:
            time.sleep(self.block_ms / 1000)  # nothing to read; behave like an empty blocking read
            return []
        try:
            return self._read()
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            log.warning("consumer group missing; recreating", group=self.group, error=str(e))
            for s in self.cursors:
                ensure_group(self.r, s, self.group, self.start_id)
            self.reset()
            return self._read()

    def _read(self) -> list[Entry]:
        history = {s: c for s, c in self.cursors.items() if c != ">"}
        if history:
            got = _entries(self.r.xreadgroup(self.group, self.consumer, history, self.count))
            for s in history:
                mine = [eid for st, eid, _ in got if st == s]
                self.cursors[s] = mine[-1] if mine else ">"
            got = _drop_trimmed(self.r, self.group, got)
            if got:
                return got
        streams = dict.fromkeys(self.cursors, ">")
        return _entries(self.r.xreadgroup(self.group, self.consumer, streams, self.count, block=self.block_ms))


def claim_stale(
    r: redis.Redis,
    stream: str,
    group: str,
    consumer: str,
    min_idle_ms: int,
    *,
    count: int = 100,
    max_deliveries: int | None = None,
) -> list[Entry]:
    """Move entries idle for ``min_idle_ms`` (their consumer died) to ``consumer`` and return them.

    Scans the whole pending list (XAUTOCLAIM pages) but returns at most ``count`` entries. With
    ``max_deliveries``, entries delivered more often than that (a message that keeps killing its
    consumer) go to the dead-letter stream instead of being returned.
    """
    out: list[Entry] = []
    start = "0-0"
    while len(out) < count:
        resp = r.xautoclaim(stream, group, consumer, min_idle_ms, start_id=start, count=count - len(out))
        start, claimed = _str(resp[0]), resp[1]
        out.extend((stream, _str(eid), fields) for eid, fields in claimed if fields)  # trimmed: skipped
        if start == "0-0":
            break
    if max_deliveries is not None and out:
        out = _dead_letter_redelivered(r, group, consumer, out, max_deliveries)
    return out


def _dead_letter_redelivered(
    r: redis.Redis, group: str, consumer: str, entries: list[Entry], max_deliveries: int
) -> list[Entry]:
    stream = entries[0][0]
    first, last = entries[0][1], entries[-1][1]  # XAUTOCLAIM returns entries in id order
    pend = r.xpending_range(stream, group, min=first, max=last, count=len(entries) + 1000, consumername=consumer)
    counts = {_str(p["message_id"]): p["times_delivered"] for p in pend}
    keep = []
    for e in entries:
        n = counts.get(e[1], 0)
        if n > max_deliveries:
            dead_letter(r, stream, e[1], e[2], f"delivered {n} times", group=group)
        else:
            keep.append(e)
    return keep


def xadd_capped(r: redis.Redis, key: str, fields: Mapping[Any, Any], maxlen: int) -> str:
    """XADD with ``MAXLEN ~ maxlen`` (trims whole macro nodes: cheap, roughly maxlen kept)."""
    return _str(r.xadd(key, dict(fields), maxlen=maxlen, approximate=True))


EVENTS_MAXLEN = 10_000


def event(r: redis.Redis, stream: str, source: str, kind: str, **fields: object) -> None:
    """One status event on the stream's ``events`` stream (what operators and the UI read)."""
    payload = {"type": kind, "source": source, "at": f"{time.time():.3f}"}
    payload |= {k: str(v) for k, v in fields.items()}
    xadd_capped(r, keys.events(stream), payload, maxlen=EVENTS_MAXLEN)


def dead_letter(
    r: redis.Redis,
    source_stream: str,
    entry_id: str,
    fields: Mapping[Any, Any] | None,
    reason: str,
    *,
    group: str | None = None,
    maxlen: int = DEAD_LETTER_MAXLEN,
) -> str:
    """Record an unprocessable entry on ``keys.DEAD_LETTER``; with ``group``, ack it atomically.

    Original field values are truncated to DEAD_LETTER_MAX_VALUE bytes (stored as ``f:<name>``).
    """
    rec: dict[str, Any] = {"source": source_stream, "entry_id": entry_id, "reason": reason[:2000]}
    rec["at"] = repr(time.time())
    for k, v in (fields or {}).items():
        name = "f:" + (k.decode("utf-8", "backslashreplace") if isinstance(k, bytes) else str(k))
        v = v if isinstance(v, bytes) else str(v).encode()
        if len(v) > DEAD_LETTER_MAX_VALUE:
            rec[f"{name}:truncated_from"] = str(len(v))
        rec[name] = v[:DEAD_LETTER_MAX_VALUE]
    with r.pipeline(transaction=True) as p:
        p.xadd(keys.DEAD_LETTER, rec, maxlen=maxlen, approximate=True)
        if group is not None:
            p.xack(source_stream, group, entry_id)
        return _str(p.execute()[0])
