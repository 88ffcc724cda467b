"""Redis connection and stream helpers shared by every service.

Consumer-group discipline (docs/DESIGN.md, "Reliability rules"): read your own pending entries
first (id "0") and then new ones (">"), ack only after the work is durable, reclaim entries of
dead consumers with XAUTOCLAIM, and cap every stream.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
import structlog
from redis._parsers.base import BaseParser
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from common.logs import redact_text, redact_url
from common.wire import keys

log = structlog.get_logger(__name__)

Entry = tuple[str, str, dict[bytes, bytes]]  # (stream key, entry id, fields)

SOCKET_MARGIN_S = 5.0  # socket timeout = longest blocking read + this
CONNECT_RETRIES = 10  # ~10 s of exponential backoff (50 ms doubling, capped at 2 s)
HEALTH_CHECK_INTERVAL_S = 30
# A client's connection pool bound. redis-py 8 caps a pool at 100 by default, but the services hold
# one blocking connection per camera thread (ingest one per camera, an encoder one per owned stream):
# at 128 cameras ingest failed with "Too many connections". The server's own maxclients default.
MAX_CONNECTIONS = 10_000
# Dead letters are bounded: at most this many fields of an entry, names and values truncated,
# the stream capped (1,000 entries x ~70 KB at most).
DEAD_LETTER_MAXLEN = 1000
DEAD_LETTER_MAX_VALUE = 4 * 1024  # a frame is ~600 KB: keep its header, not its pixels
DEAD_LETTER_MAX_NAME = 64
DEAD_LETTER_MAX_FIELDS = 16
MAX_DELIVERIES = 3  # an entry handed out more often than this is dead-lettered unprocessed
DEAD_CONSUMER_IDLE_MS = 3_600_000  # group members silent this long, with nothing pending, are removed

POLL_S = 0.05  # a cluster read of streams on several hash slots polls at this pace (see read_streams)
DEAD_LETTER_ONCE_TTL_S = 86_400  # how long a dead letter's marker stops a redelivered entry's second one


class GroupLost(RedisConnectionError):
    """A consumer group gone under entries read from it: Redis lost it (restarted empty). An outage
    to the services, waited out and recovered from (groups made again, leases and heads checked),
    never the entries' fault: an encoder's stream task raised NOGROUP out of the worker (CI,
    2026-11-29, a Redis restarted empty under a live camera)."""


class WritesRefused(ResponseError):
    """MISCONF: Redis refuses writes because it cannot persist them (its disk full or gone)."""


# redis-py gives OOM and READONLY replies exceptions of their own, MISCONF only a ResponseError,
# which every handler would take for the command's (the entry's) fault.
BaseParser.EXCEPTION_CLASSES.setdefault("MISCONF", WritesRefused)

# Redis answers, but refuses writes for a reason of its own, whatever the command: full (maxmemory
# with noeviction), a replica (read-only), persistence failing. Like an outage it says nothing
# about the entry being handled (a worker that took it for the entry's fault dead-lettered frames
# and aborted, 2026-11-29); unlike one, PING cannot tell when it ends (see `ride_out`).
REFUSALS: tuple[type[Exception], ...] = (OutOfMemoryError, ReadOnlyError, WritesRefused)
# Redis cannot serve now, whatever the command (not: Redis refused a command). BusyLoadingError
# (replaying AOF) is one; on a cluster, so is a node that is down (its slots uncovered, the cluster
# state failed: ClusterDownError is a ClusterError) or a slot whose keys are half moved for longer
# than redis-py's redirections last (TryAgainError; ClusterError "TTL exhausted"); and REFUSALS.
OUTAGE_ERRORS: tuple[type[Exception], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterError,
    TryAgainError,
    SlotNotCoveredError,
    *REFUSALS,
)
# What a probe of a Redis that is not (yet) there may raise: a cluster client also fails to build
# while no startup node answers or while the cluster has not covered every slot yet.
PROBE_ERRORS = (*OUTAGE_ERRORS, RedisClusterException, OSError)
# redis+cluster:// (rediss+cluster://) names a Redis Cluster by one or more of its nodes.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


class RedisGone(RuntimeError):
    """Redis stayed unreachable past the grace period: the service exits 3 and is restarted."""


def text(x: bytes | str) -> str:
    """Bytes that are no UTF-8 are replaced, not raised: what a reader shows of an entry somebody
    else wrote must not depend on that entry being well formed."""
    return x.decode(errors="replace") if isinstance(x, bytes) else x


def text_fields(fields: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """A stream entry's fields as text."""
    return {text(k): text(v) for k, v in fields.items()}


def cluster_nodes(url: str) -> tuple[str, list[tuple[str, int]]] | None:
    """For ``redis+cluster://[user:password@]host:port[,host:port...][/0][?options]``: redis-py's URL
    of the first node (credentials, options: they apply to every node) and each node's (host, port).
    None for a single-node URL; ValueError for a bad host list."""
    scheme, sep, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower())
    if plain is None or not sep:
        return None
    netloc, tail = re.match(r"([^/?#]*)(.*)", rest, re.S).groups()
    userinfo, at, hosts = netloc.rpartition("@")
    nodes = []
    for hostport in hosts.split(","):
        parts = urlsplit(f"//{hostport}")
        if not parts.hostname or parts.port == 0:
            raise ValueError(f"bad cluster node {hostport!r} (host:port)")
        nodes.append((parts.hostname, parts.port or 6379))
    return f"{plain}://{userinfo}{at}{hosts.split(',')[0]}{tail}", nodes


def is_cluster(r: Any) -> bool:
    return isinstance(r, RedisCluster)


def _client(url: str, **options: Any) -> redis.Redis:
    """redis-py's client for ``url``: a RedisCluster (typed as Redis: same commands) for the cluster
    schemes, else redis.Redis."""
    cluster = cluster_nodes(url)
    if cluster is None:
        return redis.Redis.from_url(url, **options)
    first, nodes = cluster
    return RedisCluster.from_url(first, startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]], **options)  # type: ignore[return-value]


def connect(url: str, *, block_ms: int = 5000, retries: int = CONNECT_RETRIES) -> redis.Redis:
    """A client for ``url`` whose commands survive a Redis restart of up to ~10 s.

    ``block_ms`` is the longest blocking read this client will issue; the socket timeout sits
    above it, because redis-py 8's default 5 s would turn a longer XREADGROUP BLOCK into a
    TimeoutError. A cluster URL gives a cluster client; it retries (without backoff) on a fresh
    view of the cluster, and outages beyond that are ridden out by the services (``ride_out``).
    """
    return _client(
        url,
        socket_timeout=block_ms / 1000 + SOCKET_MARGIN_S,
        socket_connect_timeout=5.0,
        socket_keepalive=True,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        decode_responses=False,
        max_connections=MAX_CONNECTIONS,
    )


def ping_problem(url: str, timeout_s: float) -> str | None:
    """Why one PING without retries fails (None: it answered). On a cluster every node must answer,
    and the client is only built once every slot is covered."""
    try:
        probe = _client(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    except (*PROBE_ERRORS, redis.RedisError) as e:
        return str(e) or type(e).__name__
    try:
        probe.ping(target_nodes=RedisCluster.ALL_NODES) if is_cluster(probe) else probe.ping()
        return None
    except (*PROBE_ERRORS, redis.RedisError) as e:
        return str(e) or type(e).__name__
    finally:
        probe.close()


class NotACluster(ValueError):
    """A single-node URL names a node of a Redis Cluster: every other slot's key would fail (MOVED)."""


def wait_for_redis(url: str, timeout_s: float, *, block_ms: int = 5000) -> redis.Redis:
    """Wait until Redis answers PING, then return ``connect(url)``; TimeoutError after timeout_s,
    NotACluster at once when a single-node URL names a cluster node."""
    deadline = time.monotonic() + timeout_s
    while True:
        # A probe without retries: connect()'s own backoff would overshoot the deadline.
        problem = ping_problem(url, max(0.1, min(2.0, deadline - time.monotonic())))
        if problem is None:
            try:
                r = connect(url, block_ms=block_ms)
                _check_not_cluster_node(r, url)
                return r
            except PROBE_ERRORS as e:  # went away again (a cluster client connects as it is built)
                problem = str(e)
        if time.monotonic() + 0.1 > deadline:
            raise TimeoutError(f"Redis at {redact_url(url)} not reachable after {timeout_s:g} s: {problem}")
        time.sleep(0.1)


def _check_not_cluster_node(r: redis.Redis, url: str) -> None:
    if is_cluster(r):
        return
    try:
        enabled = r.info("cluster").get("cluster_enabled")
    except ResponseError:  # an ACL user without INFO: nothing to tell by
        return
    if enabled:
        raise NotACluster(f"Redis at {redact_url(url)} is a cluster node: use redis+cluster://host:port[,host:port...]")


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
        out.extend((text(stream), text(eid), fields) for eid, fields in messages)
    return out


def _drop_trimmed(r: redis.Redis, group: str, entries: list[Entry]) -> list[Entry]:
    """Ack pending entries whose data was trimmed away (MAXLEN): they cannot be processed."""
    gone = [(s, e) for s, e, f in entries if not f]  # redis-py reports a trimmed entry as {}
    for stream, eid in gone:
        log.warning("pending entry trimmed before processing; acking", stream=stream, entry_id=eid)
        r.xack(stream, group, eid)
    return [x for x in entries if x[2]] if gone else entries


def _check_block(r: redis.Redis, block_ms: int) -> None:
    timeout = r.get_connection_kwargs().get("socket_timeout")
    if timeout is not None and block_ms / 1000 >= timeout:
        raise ValueError(f"block_ms={block_ms} >= socket timeout {timeout} s: use connect(block_ms=...)")


def _by_slot(r: redis.Redis, streams: Mapping[str, str]) -> list[dict[str, str]]:
    """``streams`` split into groups that one command may read: all of them on single-node Redis,
    one group per hash slot on a cluster."""
    if not is_cluster(r):
        return [dict(streams)]
    parts: dict[int, dict[str, str]] = {}
    for key, cursor in streams.items():
        parts.setdefault(r.keyslot(key), {})[key] = cursor
    return list(parts.values())


def _xread(r: Any, streams: dict[str, str], count: int, block_ms: int | None, group: str | None, consumer: str | None):
    if group is None:
        return r.xread(streams, count=count, block=block_ms)
    return r.xreadgroup(group, consumer, streams, count, block=block_ms)


def _xread_args(streams: dict[str, str], count: int, group: str | None, consumer: str | None) -> list[Any]:
    """A non-blocking XREAD (XREADGROUP with ``group``) of ``streams``, as a command line."""
    head = ["XREAD"] if group is None else ["XREADGROUP", "GROUP", group, consumer]
    return [*head, "COUNT", count, "STREAMS", *streams, *streams.values()]


def read_streams(
    r: redis.Redis,
    streams: Mapping[str, str],
    count: int,
    *,
    block_ms: int | None = None,
    group: str | None = None,
    consumer: str | None = None,
) -> list[Entry]:
    """XREADGROUP (with ``group``) or XREAD of several streams, waiting up to ``block_ms`` if given.

    One command, blocking, where every stream is in one hash slot (always so on single-node Redis).
    A cluster has no command that reads several slots, so there each slot gets one non-blocking
    command, all pipelined (one round trip per node), repeated every POLL_S until something comes
    or ``block_ms`` has passed. Cursors must be ids, ">" or "0": "$" means nothing to a poll.
    """
    parts = _by_slot(r, streams)
    if len(parts) == 1:
        try:
            return _entries(_xread(r, parts[0], count, block_ms, group, consumer))
        except ResponseError as e:
            if not str(e).startswith("UNBLOCKED"):
                raise
            # The key went away under a blocked XREADGROUP: its slot moved to another node (MIGRATE
            # deletes it here), or it was deleted. The next read follows the slot or recreates the group.
            log.info("blocked read ended: stream key gone", error=str(e))
            return []
    deadline = time.monotonic() + (block_ms or 0) / 1000
    while True:
        pipe = r.pipeline(transaction=False)
        for part in parts:
            # Routed to the slot's node here: redis-py would ask the server for the keys of each
            # XREAD(GROUP) (COMMAND GETKEYS), twice a poll. A redirection is still followed.
            node = r.get_node_from_key(next(iter(part)))  # type: ignore[attr-defined]
            pipe.execute_command(*_xread_args(part, count, group, consumer), target_nodes=node)
        got = [e for reply in pipe.execute() for e in _entries(reply)]
        if got or time.monotonic() + POLL_S > deadline:
            return got
        time.sleep(POLL_S)


class GroupReader:
    """Reads a consumer group the restart-safe way, keeping a cursor per stream.

    Starts on each stream with this consumer's pending history (id "0", paged by cursor), and
    switches that stream to new entries (">") once its history is drained, so entries the caller
    keeps un-acked are not returned again. Recreates the group if it vanished (Redis restarted
    without persistence). ``reset()`` goes back to the history, e.g. after claim_stale. On a
    cluster, streams of several hash slots are read without cross-slot commands (``read_streams``).
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
        self.quiet: set[str] = set()  # streams whose history is re-read without counting deliveries
        self.groupless: set[str] = set()  # streams added whose group is made at the next read
        for s in streams:
            self.add(s)

    def add(self, stream: str, *, claimed: bool = False) -> None:
        """Follow ``stream`` from the next read on. Its group is made there, not here: a read runs
        where the caller rides out Redis outages, a constructor does not. ``claimed``: this life
        took the stream's pending entries with ``claim_stale``, which counted its delivery of them;
        its history is then re-read without counting another."""
        self.groupless.add(stream)
        self.cursors[stream] = "0"
        if claimed:
            self.quiet.add(stream)

    def remove(self, stream: str) -> None:
        self.cursors.pop(stream, None)
        self.quiet.discard(stream)
        self.groupless.discard(stream)

    def ensure_groups(self) -> None:
        """Make the groups of the streams added since (done by ``read``; call it first when other
        group commands, such as ``claim_stale``, come before the first read)."""
        for s in sorted(self.groupless):
            ensure_group(self.r, s, self.group, self.start_id)
            self.groupless.discard(s)

    def reset(self) -> None:
        """Back to this consumer's pending history (after an outage: replies lost on the way).

        Re-read with XPENDING + XRANGE, not XREADGROUP: a re-read in the same life is no new
        delivery, and counting it would dead-letter entries this process is still working on
        after an outage or two. The first history read of a life (``add``) does count: that is
        how a message that kills its consumer is stopped.
        """
        self.cursors = dict.fromkeys(self.cursors, "0")
        self.quiet = set(self.cursors)

    def read(self, streams: Collection[str] | None = None, block_ms: int | None = None) -> list[Entry]:
        """Entries of the streams followed (of ``streams`` only, if given), waiting up to
        ``block_ms`` (default: the reader's) for new ones."""
        block_ms = self.block_ms if block_ms is None else block_ms
        cursors = self.cursors if streams is None else {s: c for s, c in self.cursors.items() if s in streams}
        if not cursors:
            time.sleep(block_ms / 1000)  # nothing to read; behave like an empty blocking read
            return []
        self.ensure_groups()
        try:
            return self._read(cursors.keys(), block_ms)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            log.warning("consumer group missing; recreating", group=self.group, error=str(e))
            for s in self.cursors:
                ensure_group(self.r, s, self.group, self.start_id)
            self.reset()
            return self._read(cursors.keys(), block_ms)

    def _read(self, streams: Collection[str], block_ms: int) -> list[Entry]:
        who = {"group": self.group, "consumer": self.consumer}
        history = {s: c for s, c in self.cursors.items() if c != ">" and s in streams}
        if history:
            counted = {s: c for s, c in history.items() if s not in self.quiet}
            got = read_streams(self.r, counted, self.count, **who) if counted else []
            for s in history.keys() & self.quiet:
                got += self._pending(s, history[s])
            for s in history:
                mine = [eid for st, eid, _ in got if st == s]
                self.cursors[s] = mine[-1] if mine else ">"
                if not mine:
                    self.quiet.discard(s)
            got = _drop_trimmed(self.r, self.group, got)
            if got:
                return got
        return read_streams(self.r, dict.fromkeys(streams, ">"), self.count, block_ms=block_ms, **who)

    def _pending(self, stream: str, cursor: str) -> list[Entry]:
        """This consumer's pending entries after ``cursor``, delivery counts untouched."""
        start = "-" if cursor == "0" else f"({cursor}"
        pending = self.r.xpending_range(
            stream, self.group, min=start, max="+", count=self.count, consumername=self.consumer
        )
        ids = [text(p["message_id"]) for p in pending]
        pipe = self.r.pipeline(transaction=False)
        for eid in ids:
            pipe.xrange(stream, eid, eid)
        return [(stream, eid, rows[0][1] if rows else {}) for eid, rows in zip(ids, pipe.execute(), strict=True)]


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
        start, claimed = text(resp[0]), resp[1]
        out.extend((stream, text(eid), fields) for eid, fields in claimed if fields)  # trimmed: skipped
        if start == "0-0":
            break
    return out


# KEYS[1] a stream. ARGV[1] group, ARGV[2] consumer, ARGV[3..] entry ids. Resets the idle time of
# those entries still pending on this consumer (JUSTID: no delivery counted), never taking another's.
_KEEP_ALIVE = """
for i = 3, #ARGV do
  if #redis.call('xpending', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) > 0 then
    redis.call('xclaim', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  end
end
return 0
"""


def keep_alive(r: redis.Redis, stream: str, group: str, consumer: str, ids: Iterable[str]) -> None:
    """Entries still being worked on look fresh to ``claim_stale``: a slow answer is not taken
    over by a live peer (or by ourselves), which would count a delivery each time."""
    if ids := list(ids):
        r.eval(_KEEP_ALIVE, 1, stream, group, consumer, *ids)


def xadd_capped(r: redis.Redis, key: str, fields: Mapping[Any, Any], maxlen: int) -> str:
    """XADD with ``MAXLEN ~ maxlen`` (trims whole macro nodes: cheap, roughly maxlen kept)."""
    return text(r.xadd(key, dict(fields), maxlen=maxlen, approximate=True))


# XADD guarded by a marker key in the stream's slot: the entry is added only by whoever sets it.
_XADD_ONCE = """
if redis.call('set', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
  return redis.call('xadd', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 3))
end
return false
"""


def xadd_once(
    r: redis.Redis, key: str, once_key: str, fields: Mapping[Any, Any], maxlen: int, ttl_s: int
) -> str | None:
    """XADD ``fields`` to ``key`` (capped) unless ``once_key`` (``keys.once``, same slot) says it was
    already done in the last ``ttl_s``; the new entry's id, or None. Makes a step that a crash may
    repeat (the audit copy of an answer, a dead letter) happen once."""
    flat = [x for kv in fields.items() for x in kv]
    added = r.eval(_XADD_ONCE, 2, key, once_key, ttl_s, maxlen, *flat)
    return text(added) if added else None


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
) -> str | None:
    """Record an unprocessable entry on ``keys.DEAD_LETTER`` once (None: it already was); with
    ``group``, ack it after that.

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
    # Two steps (the dead-letter stream and the source are in different slots on a cluster): a
    # crash between them redelivers the entry, and its marker keeps it to one dead letter.
    once = keys.once(keys.DEAD_LETTER, f"{source_stream}:{entry_id}")
    added = xadd_once(r, keys.DEAD_LETTER, once, rec, maxlen, DEAD_LETTER_ONCE_TTL_S)
    if group is not None:
        r.xack(source_stream, group, entry_id)
    return added


# --------------------------------------------------------------------------- the processing boundary

Handler = Callable[[str, str, dict[bytes, bytes], int], None]  # (stream, entry id, fields, deliveries)
Rejecter = Callable[[str, str, dict[bytes, bytes], str], None]  # (stream, entry id, fields, reason); acks


def delivery_counts(r: redis.Redis, group: str, consumer: str, entries: list[Entry]) -> dict[str, int]:
    """How often each entry was handed out (XPENDING's counter: XREADGROUP and XAUTOCLAIM raise it).
    GroupLost when the group is gone: Redis lost it (restarted empty) since the entries were read."""
    counts: dict[str, int] = {}
    for stream in dict.fromkeys(s for s, _, _ in entries):
        ids = [e for s, e, _ in entries if s == stream]
        try:
            pend = r.xpending_range(
                stream,
                group,
                min=min(ids, key=_id_key),
                max=max(ids, key=_id_key),
                count=len(ids) + 1000,
                consumername=consumer,
            )
        except ResponseError as e:
            if "NOGROUP" in str(e):
                raise GroupLost(str(e)) from e
            raise
        counts |= {text(p["message_id"]): int(p["times_delivered"]) for p in pend}
    return counts


# KEYS[1] an entry's attempts hash (keys.attempts): field <life> counts that life's attempts, field
# <life>:alone marks one it made with nothing else under way. ARGV[1] this life, ARGV[2] TTL s,
# ARGV[3] '1' if this attempt is alone. Returns {other lives that made an alone attempt, attempts}.
_BEGIN = """
redis.call('hincrby', KEYS[1], ARGV[1], 1)
if ARGV[3] == '1' then redis.call('hincrby', KEYS[1], ARGV[1] .. ':alone', 0) end
redis.call('expire', KEYS[1], ARGV[2])
local all = redis.call('hgetall', KEYS[1])
local alone, total = 0, 0
for i = 1, #all, 2 do
  if string.sub(all[i], -6) ~= ':alone' then
    total = total + tonumber(all[i + 1])
  elseif all[i] ~= ARGV[1] .. ':alone' then
    alone = alone + 1
  end
end
return {alone, total}
"""


class Attempts:
    """Which lives of consumers (a process each time it starts) began handling which entries.

    XPENDING's delivery count rises for every entry a consumer had read, so one crash charged a
    delivery to every question its worker had taken (up to ``max_in_flight``), and innocent
    questions were refused after a few crashes. Here an entry is charged only for a life that
    died (it began the entry and never finished: the entry is still pending) while handling that
    entry *alone*, with nothing else under way that could have been the cause. An entry another
    life began is a suspect: its next attempt is made alone. The record lives until the entry
    is done (``end``), at most ``ttl_s``.
    """

    def __init__(self, r: redis.Redis, consumer: str, ttl_s: int):
        self.r, self.ttl_s = r, ttl_s
        self.life = f"{consumer}:{uuid.uuid4().hex[:12]}"  # a restart under the same name is a new life

    def suspect(self, stream: str, entry_id: str) -> bool:
        """Another life began handling the entry and did not finish it: it died (or lost the entry)
        with the entry under way, which may have been the cause."""
        lives = {text(f).removesuffix(":alone") for f in self.r.hgetall(keys.attempts(stream, entry_id))}
        return bool(lives - {self.life})

    def begin(self, stream: str, entry_id: str, alone: bool) -> tuple[int, int]:
        """This life begins handling the entry (``alone``: with nothing else under way until it is
        done). Returns the lives that died handling it alone, and this attempt's number, which
        grows with every attempt (in one life too, after an outage)."""
        lost, attempt = self.r.eval(_BEGIN, 1, keys.attempts(stream, entry_id), self.life, self.ttl_s, int(alone))
        return int(lost), int(attempt)

    def end(self, stream: str, entry_id: str) -> None:
        self.r.delete(keys.attempts(stream, entry_id))


def process(
    r: redis.Redis,
    group: str,
    consumer: str,
    entries: list[Entry],
    handle: Handler,
    reject: Rejecter,
    *,
    max_deliveries: int = MAX_DELIVERIES,
    attempts: Attempts | None = None,
    alone: bool = False,
) -> None:
    """Handle each entry inside a boundary: nothing an entry holds can stop the caller.

    An entry is rejected without being handled once it has cost ``max_deliveries`` lives: it may
    be what killed them (a segfault, the OOM killer). With ``attempts``, only lives that died
    handling it alone count (``alone``: nothing else is under way now); without, every delivery
    before this one (XPENDING). Any exception from ``handle`` rejects the entry. ``reject``
    replies or dead-letters, and acks. Outage errors propagate: Redis being away says nothing
    about the entry (see ``ride_out``).
    """
    if not entries:
        return
    counts = delivery_counts(r, group, consumer, entries) if attempts is None else {}
    for stream, entry_id, fields in entries:
        if attempts is None:
            n = counts.get(entry_id, 1)
            lost, why = n - 1, f"delivered {n} times (limit {max_deliveries})"
        else:  # begun right before it is handled: the entries after it in the batch are not under way
            lost, n = attempts.begin(stream, entry_id, alone)
            why = f"under way alone in {lost} worker(s) that died (limit {max_deliveries})"
        if lost >= max_deliveries:
            log.error("entry cost too many lives; rejected unprocessed", stream=stream, entry_id=entry_id, lives=lost)
            _reject(reject, r, group, stream, entry_id, fields, why)
        else:
            try:
                handle(stream, entry_id, fields, n)
            except OUTAGE_ERRORS:
                raise
            except Exception as e:  # RecursionError, TypeError from a library, MemoryError...: the entry's fault
                log.exception("entry failed; rejected", stream=stream, entry_id=entry_id)
                _reject(reject, r, group, stream, entry_id, fields, f"{type(e).__name__}: {e}"[:500])
        if attempts is not None:
            attempts.end(stream, entry_id)


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
    info = next((g for g in r.xinfo_groups(stream) if text(g["name"]) == group), None)
    if info is None:
        return
    keep = text(info["last-delivered-id"])
    oldest = r.xpending(stream, group).get("min")
    if oldest is not None and _id_key(text(oldest)) < _id_key(keep):
        keep = text(oldest)
    r.xtrim(stream, minid=keep, approximate=True)


def prune_consumers(r: redis.Redis, stream: str, group: str, keep: str, idle_ms: int = DEAD_CONSUMER_IDLE_MS) -> int:
    """Remove members of ``group`` silent for ``idle_ms`` with nothing pending (dead processes)."""
    gone = 0
    for c in r.xinfo_consumers(stream, group):
        name = text(c["name"])
        if name != keep and int(c["pending"]) == 0 and int(c["idle"]) > idle_ms:
            r.xgroup_delconsumer(stream, group, name)
            gone += 1
    return gone


FUTURE_ID_MS = 86_400_000  # an entry id a day past this host's clock is forged: writers let Redis pick (*)

# Ids compared as zero-padded text: Lua's numbers are doubles, an id's halves are 64-bit.
_REOPEN = """
local function padded(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return string.rep('0', 20 - #ms) .. ms .. string.rep('0', 20 - #seq) .. seq
end
local function field(flat, name)
  for i = 1, #flat, 2 do if flat[i] == name then return flat[i + 1] end end
end
local last = field(redis.call('XINFO', 'STREAM', KEYS[1]), 'last-generated-id')
if padded(last) < padded(ARGV[1]) then return -1 end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return -1 end
for _, g in ipairs(groups) do
  if field(g, 'last-delivered-id') ~= last then return -1 end
  if #redis.call('XPENDING', KEYS[1], field(g, 'name'), ARGV[1], '+', 1) > 0 then return -1 end
end
local gone = redis.call('XRANGE', KEYS[1], ARGV[1], '+')
for _, e in ipairs(gone) do redis.call('XDEL', KEYS[1], e[1]) end
local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local top = '0-0'
if #newest > 0 then top = newest[1][1] end
redis.call('XSETID', KEYS[1], top)
for _, g in ipairs(groups) do redis.call('XGROUP', 'SETID', KEYS[1], field(g, 'name'), top) end
return #gone
"""


def reopen_after_future_ids(r: redis.Redis, stream: str) -> int | None:
    """A shared queue whose last id lies in the future is closed to its writers: the largest id
    (2^64-1-2^64-1), which any Redis user allowed XADD may give, makes every later XADD fail
    ("exhausted the last possible ID"), and ACLs cannot refuse an id. Once every group has read
    the entries that far ahead and none of them is pending (each was answered or refused like any
    other entry), they are deleted and the stream's and groups' last ids set back to the newest
    other entry: nothing is skipped or delivered twice. The entries removed, or None when the
    stream was left as it was."""
    future = f"{int(time.time() * 1000) + FUTURE_ID_MS}-0"
    gone = int(r.eval(_REOPEN, 1, stream, future))
    if gone < 0:
        return None
    log.warning("queue reopened: entries with ids in the future removed", stream=stream, entries=gone)
    return gone


# --------------------------------------------------------------------------- outages


Clients = redis.Redis | Sequence[redis.Redis]  # what a service depends on: one Redis, or several


def ride_out(r: Clients, error: Exception, grace_s: float, stop: threading.Event | None = None) -> None:
    """Wait, with backoff, until Redis (every one of ``r``) answers again; RedisGone once
    ``grace_s`` has passed.

    Called when a command failed with an outage error (after redis-py's own retries). Logs one
    line when the wait starts and one when Redis is back. A refusal (REFUSALS) is waited out by
    `REFUSING` instead, never past a grace period: Redis is there, and a restarted service would
    find it as full.
    """
    if isinstance(error, REFUSALS):
        REFUSING.wait(error, stop)
        return
    log.error("redis unreachable; waiting for it", error=str(error), grace_s=grace_s)
    t0 = time.monotonic()
    delay = 0.1
    while time.monotonic() - t0 < grace_s:
        if all(_answers(c) for c in (r if isinstance(r, Sequence) else [r])):
            log.info("redis back; resuming", outage_s=round(time.monotonic() - t0, 1))
            return
        if stop is not None and stop.is_set():
            return
        time.sleep(min(delay, max(0.0, grace_s - (time.monotonic() - t0))))
        delay = min(delay * 2, 5.0)
    raise RedisGone(f"Redis unreachable for more than {grace_s:g} s: {error}")


def _answers(r: redis.Redis) -> bool:
    """Every node of ``r`` (one, or each primary of a cluster) answers a PING on a fresh connection."""
    if is_cluster(r):
        nodes = r.get_primaries()  # type: ignore[attr-defined]
        return bool(nodes) and all(_pool_answers(n.redis_connection.connection_pool) for n in nodes)
    return _pool_answers(r.connection_pool)


def _pool_answers(pool: redis.ConnectionPool) -> bool:
    """One PING without retries, on a fresh connection with the pool's settings (URL, TLS, ACL user)."""
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
    r: Clients,
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
        else:
            REFUSING.over()


def call_riding_out(r: Clients, fn: Callable[[], None], stop: threading.Event, grace_s: float) -> bool:
    """Call ``fn`` until it completes without an outage, waiting each one out (RedisGone past
    ``grace_s``); True if there was none, False if it had to be repeated (or ``stop`` was set)."""
    clean = True
    while not stop.is_set():
        try:
            fn()
            REFUSING.over()
            return clean
        except OUTAGE_ERRORS as e:
            clean = False
            ride_out(r, e, grace_s, stop)
    return False


class Refusing:
    """Redis refusing writes (REFUSALS), as this process meets it. PING answers all along, so only
    the next tries tell when it ends: each refused command waits a step of backoff (0.5 s growing
    to 5 s with the refusal's age) and is tried again; `over()`, after a step that went through
    with no refusal for `QUIET_S` (a step that only read says little), ends it. One log line when
    it starts, one a minute while it lasts, one when it ends; meanwhile /health/ready fails naming
    it (`why`)."""

    LOG_EVERY_S = 60.0
    QUIET_S = 10.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None
        self._last = self._logged = 0.0
        self._error = ""

    def wait(self, error: Exception, stop: threading.Event | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            if self._since is None:
                self._since = now
            self._last = now
            self._error = f"{type(error).__name__}: {redact_text(str(error))}"[:200]
            if now - self._logged >= self.LOG_EVERY_S:
                self._logged = now
                log.error("redis refuses writes; waiting", error=self._error, for_s=round(now - self._since, 1))
            delay = min(5.0, max(0.5, (now - self._since) / 4))
        if stop is None:
            time.sleep(delay)
        else:
            stop.wait(delay)

    def over(self) -> None:
        if self._since is None:  # the common case, without the lock
            return
        now = time.monotonic()
        with self._lock:
            if self._since is not None and now - self._last >= self.QUIET_S:
                log.info("redis takes writes again; resuming", refused_s=round(self._last - self._since, 1))
                self._since, self._logged = None, 0.0

    def why(self) -> str | None:
        """What Redis refuses with, while it does (None otherwise)."""
        return self._error if self._since is not None else None


REFUSING = Refusing()  # one per process: every thread meets the same Redis


T = TypeVar("T")
_REFUSED: set[str] = set()  # what `unless_refused` has said it goes on without


def unless_refused(fn: Callable[[], T], default: T, what: str) -> T:
    """``fn()``, or ``default`` when this role's Redis user may not run it (NOPERM): a users.acl made
    by an older release, before the role used those keys, should cost the feature, not the service.
    Said once per ``what``; `scripts/redis-users.sh` run again grants them."""
    try:
        return fn()
    except redis.exceptions.NoPermissionError as e:
        if what not in _REFUSED:
            _REFUSED.add(what)
            log.warning(
                "redis user refused; going on without it (run scripts/redis-users.sh again)",
                what=what,
                error=str(e)[:200],
            )
        return default


def exit_code(run: Callable[[], None]) -> int:
    """Run a service to its end: 0, or 3 (one log line) when Redis stayed away past the grace period."""
    try:
        run()
    except RedisGone as e:
        log.error("redis gone past the grace period; exiting", error=str(e))
        return 3
    return 0
