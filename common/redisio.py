"""Redis connection and stream helpers shared by every service.

Consumer-group discipline (docs/DESIGN.md, "Reliability rules"): read your own pending entries
first (id "0") and then new ones (">"), ack only after the work is durable, reclaim entries of
dead consumers with XAUTOCLAIM, and cap every stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis
import structlog
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from common.logs import redact_text, redact_url
from common.wire import keys

log = structlog.get_logger(__name__)

Entry = tuple[str, str, dict[bytes, bytes]]  # (stream key, entry id, fields)

SOCKET_MARGIN_S = 5.0  # socket timeout = longest blocking read + this
CONNECT_RETRIES = 10  # ~10 s of exponential backoff (50 ms doubling, capped at 2 s)
HEALTH_CHECK_INTERVAL_S = 30
# Dead letters are bounded: at most this many fields of an entry, names and values truncated,
# the stream capped (1,000 entries x ~70 KB at most).
DEAD_LETTER_MAXLEN = 1000
DEAD_LETTER_MAX_VALUE = 4 * 1024  # a frame is ~600 KB: keep its header, not its pixels
DEAD_LETTER_MAX_NAME = 64
DEAD_LETTER_MAX_FIELDS = 16
MAX_DELIVERIES = 3  # an entry handed out more often than this is dead-lettered unprocessed
DEAD_CONSUMER_IDLE_MS = 3_600_000  # group members silent this long, with nothing pending, are removed

# Redis is unreachable (not: Redis refused a command). BusyLoadingError (replaying AOF) is one.
OUTAGE_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)


class RedisGone(RuntimeError):
    """Redis stayed unreachable past the grace period: the service exits 3 and is restarted."""


def _str(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


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
            raise TimeoutError(f"Redis at {redact_url(url)} not reachable after {timeout_s:g} s: {last}")
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
) -> list[Entry]:
    """Move entries idle for ``min_idle_ms`` (their consumer died) to ``consumer`` and return them.

    Scans the whole pending list (XAUTOCLAIM pages) but returns at most ``count`` entries. Each
    claim counts as a delivery: hand the result to ``process``, which stops a message that keeps
    killing its consumers.
    """
    out: list[Entry] = []
    start = "0-0"
    while len(out) < count:
        resp = r.xautoclaim(stream, group, consumer, min_idle_ms, start_id=start, count=count - len(out))
        start, claimed = _str(resp[0]), resp[1]
        out.extend((stream, _str(eid), fields) for eid, fields in claimed if fields)  # trimmed: skipped
        if start == "0-0":
            break
    return out


def xadd_capped(r: redis.Redis, key: str, fields: Mapping[Any, Any], maxlen: int) -> str:
    """XADD with ``MAXLEN ~ maxlen`` (trims whole macro nodes: cheap, roughly maxlen kept)."""
    return _str(r.xadd(key, dict(fields), maxlen=maxlen, approximate=True))


EVENTS_MAXLEN = 10_000


def event(r: redis.Redis, stream: str, source: str, kind: str, **fields: object) -> None:
    """One status event on the stream's ``events`` stream (what operators and the UI read)."""
    payload = {"type": kind, "source": source, "at": f"{time.time():.3f}"}
    payload |= {k: redact_text(str(v)) for k, v in fields.items()}  # error texts may quote a camera URL
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

    Bounded whatever the entry holds: its first DEAD_LETTER_MAX_FIELDS fields, stored as
    ``f:<name>`` with names cut to DEAD_LETTER_MAX_NAME and values to DEAD_LETTER_MAX_VALUE bytes.
    """
    rec: dict[str, Any] = {"source": source_stream, "entry_id": entry_id, "reason": reason[:2000]}
    rec["at"] = repr(time.time())
    items = list((fields or {}).items())
    if len(items) > DEAD_LETTER_MAX_FIELDS:
        rec["fields_truncated_from"] = str(len(items))
    for k, v in items[:DEAD_LETTER_MAX_FIELDS]:
        k = k[: DEAD_LETTER_MAX_NAME * 4] if isinstance(k, bytes) else str(k)[:DEAD_LETTER_MAX_NAME].encode()
        name = "f:" + k.decode("ascii", "backslashreplace")[:DEAD_LETTER_MAX_NAME]  # ASCII: chars == bytes
        v = v if isinstance(v, bytes) else str(v).encode("utf-8", "backslashreplace")
        if len(v) > DEAD_LETTER_MAX_VALUE:
            rec[f"{name}:truncated_from"] = str(len(v))
        rec[name] = v[:DEAD_LETTER_MAX_VALUE]
    with r.pipeline(transaction=True) as p:
        p.xadd(keys.DEAD_LETTER, rec, maxlen=maxlen, approximate=True)
        if group is not None:
            p.xack(source_stream, group, entry_id)
        return _str(p.execute()[0])


# --------------------------------------------------------------------------- the processing boundary

Handler = Callable[[str, str, dict[bytes, bytes], int], None]  # (stream, entry id, fields, deliveries)
Rejecter = Callable[[str, str, dict[bytes, bytes], str], None]  # (stream, entry id, fields, reason); acks


def delivery_counts(r: redis.Redis, group: str, consumer: str, entries: list[Entry]) -> dict[str, int]:
    """How often each entry was handed out (XPENDING's counter: XREADGROUP and XAUTOCLAIM raise it)."""
    counts: dict[str, int] = {}
    for stream in dict.fromkeys(s for s, _, _ in entries):
        ids = [e for s, e, _ in entries if s == stream]
        pend = r.xpending_range(
            stream,
            group,
            min=min(ids, key=_id_key),
            max=max(ids, key=_id_key),
            count=len(ids) + 1000,
            consumername=consumer,
        )
        counts |= {_str(p["message_id"]): int(p["times_delivered"]) for p in pend}
    return counts


def process(
    r: redis.Redis,
    group: str,
    consumer: str,
    entries: list[Entry],
    handle: Handler,
    reject: Rejecter,
    *,
    max_deliveries: int = MAX_DELIVERIES,
) -> None:
    """Handle each entry inside a boundary: nothing an entry holds can stop the caller.

    An entry delivered more than ``max_deliveries`` times is rejected without being handled (it
    may be what killed the process before: a segfault, the OOM killer); any exception from
    ``handle`` rejects the entry. ``reject`` replies or dead-letters, and acks. Outage errors
    propagate: Redis being away says nothing about the entry (see ``ride_out``).
    """
    if not entries:
        return
    counts = delivery_counts(r, group, consumer, entries)
    for stream, entry_id, fields in entries:
        n = counts.get(entry_id, 1)
        if n > max_deliveries:
            log.error("entry delivered too often; rejected unprocessed", stream=stream, entry_id=entry_id, deliveries=n)
            _reject(reject, r, group, stream, entry_id, fields, f"delivered {n} times (limit {max_deliveries})")
            continue
        try:
            handle(stream, entry_id, fields, n)
        except OUTAGE_ERRORS:
            raise
        except Exception as e:  # RecursionError, TypeError from a library, MemoryError...: the entry's fault
            log.exception("entry failed; rejected", stream=stream, entry_id=entry_id)
            _reject(reject, r, group, stream, entry_id, fields, f"{type(e).__name__}: {e}"[:500])


def _reject(
    reject: Rejecter, r: redis.Redis, group: str, stream: str, entry_id: str, fields: dict, reason: str
) -> None:
    try:
        reject(stream, entry_id, fields, reason)
    except OUTAGE_ERRORS:
        raise
    except Exception as e:  # the rejecter choked on the entry too: the dead-letter stream takes anything
        log.exception("reject failed; dead-lettering", stream=stream, entry_id=entry_id)
        dead_letter(r, stream, entry_id, fields, f"{reason}; reject failed: {type(e).__name__}", group=group)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


# --------------------------------------------------------------------------- bounds


def trim_consumed(r: redis.Redis, stream: str, group: str) -> None:
    """Trim ``stream`` below the oldest entry ``group`` still needs (pending, or not yet delivered)."""
    info = next((g for g in r.xinfo_groups(stream) if _str(g["name"]) == group), None)
    if info is None:
        return
    keep = _str(info["last-delivered-id"])
    oldest = r.xpending(stream, group).get("min")
    if oldest is not None and _id_key(_str(oldest)) < _id_key(keep):
        keep = _str(oldest)
    r.xtrim(stream, minid=keep, approximate=True)


def prune_consumers(r: redis.Redis, stream: str, group: str, keep: str, idle_ms: int = DEAD_CONSUMER_IDLE_MS) -> int:
    """Remove members of ``group`` silent for ``idle_ms`` with nothing pending (dead processes)."""
    gone = 0
    for c in r.xinfo_consumers(stream, group):
        name = _str(c["name"])
        if name != keep and int(c["pending"]) == 0 and int(c["idle"]) > idle_ms:
            r.xgroup_delconsumer(stream, group, name)
            gone += 1
    return gone


# --------------------------------------------------------------------------- outages


def ride_out(r: redis.Redis, error: Exception, grace_s: float, stop: threading.Event | None = None) -> None:
    """Wait, with backoff, until Redis answers again; RedisGone once ``grace_s`` has passed.

    Called when a command failed with an outage error (after redis-py's own retries). Logs one
    line when the wait starts and one when Redis is back.
    """
    log.error("redis unreachable; waiting for it", error=str(error), grace_s=grace_s)
    t0 = time.monotonic()
    delay = 0.1
    while time.monotonic() - t0 < grace_s:
        if _answers(r):
            log.info("redis back; resuming", outage_s=round(time.monotonic() - t0, 1))
            return
        if stop is not None and stop.is_set():
            return
        time.sleep(min(delay, max(0.0, grace_s - (time.monotonic() - t0))))
        delay = min(delay * 2, 5.0)
    raise RedisGone(f"Redis unreachable for more than {grace_s:g} s: {error}")


def _answers(r: redis.Redis) -> bool:
    """One PING without retries, on a fresh connection with the client's settings (URL, TLS, ACL user)."""
    pool = r.connection_pool
    kwargs = {**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0), "socket_timeout": 2.0}
    kwargs["socket_connect_timeout"] = 2.0
    conn = pool.connection_class(**kwargs)
    try:
        conn.connect()
        conn.send_command("PING")
        return conn.read_response() in (b"PONG", "PONG", True)
    except (*OUTAGE_ERRORS, OSError):
        return False
    finally:
        conn.disconnect()


def run_riding_out(
    r: redis.Redis,
    step: Callable[[], None],
    stop: threading.Event,
    grace_s: float,
    on_back: Callable[[], None] | None = None,
) -> None:
    """Call ``step`` until ``stop``; an outage is waited out (``ride_out``), then ``on_back`` runs."""
    while not stop.is_set():
        try:
            step()
        except OUTAGE_ERRORS as e:
            ride_out(r, e, grace_s, stop)
            if on_back is not None:  # before the next step: it may depend on what on_back restores
                call_riding_out(r, on_back, stop, grace_s)


def call_riding_out(r: redis.Redis, fn: Callable[[], None], stop: threading.Event, grace_s: float) -> bool:
    """Call ``fn`` until it completes without an outage, waiting each one out (RedisGone past
    ``grace_s``); True if there was none, False if it had to be repeated (or ``stop`` was set)."""
    clean = True
    while not stop.is_set():
        try:
            fn()
            return clean
        except OUTAGE_ERRORS as e:
            clean = False
            ride_out(r, e, grace_s, stop)
    return False


def exit_code(run: Callable[[], None]) -> int:
    """Run a service to its end: 0, or 3 (one log line) when Redis stayed away past the grace period."""
    try:
        run()
    except RedisGone as e:
        log.error("redis gone past the grace period; exiting", error=str(e))
        return 3
    return 0
