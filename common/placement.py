"""Which worker holds which streams: heartbeats, and the rule that spreads streams over workers.

Every stream-owning worker (`streamvqa worker`, `streamvqa encoder`) writes a heartbeat at every
lease check (about once a second): `keys.worker(id)`, a hash with its capacity and the streams it
holds, with a TTL of one lease, so that it vanishes with the leases of a dead worker; and its id
in the set `keys.WORKERS`, which is how the others and `streamvqa status` find it (no key scan).

The rule, applied by each worker on its own from what the heartbeats say (no coordinator):
- take free streams up to the fair share: the ceiling of all streams held by workers with room,
  plus the free ones, over those workers (capped by capacity; a race for one stream is settled
  by the lease's SET NX);
- hand one stream off when some other live worker with room holds at least two fewer.
Together they leave every worker with the floor or the ceiling of streams / live workers (the
fair share), capped by its capacity.

A heartbeat names the process that wrote it (`life`, the lease's value): two live processes given
one consumer name overwrite each other's, so an idle one said "holds nothing" for the other. A
worker that finds its name's heartbeat written by another life after it wrote its own says so (an
error line, the `svqa_worker_namesakes_total` counter, `namesake_at` in its heartbeat, which
`streamvqa status` flags); which streams a worker holds, status reads from the leases.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis
import structlog

from common import metrics
from common.lease import lease_owner
from common.wire import keys

log = structlog.get_logger(__name__)

LIFE, NAMESAKE_AT = "life", "namesake_at"  # heartbeat fields beside WorkerLoad's
NAMESAKE_SAY_EVERY_S = 60.0  # the error line at most this often: both namesakes see it at every beat
NAMESAKE_RECENT_S = 30.0  # status flags a worker whose namesake was seen this recently


def _text(x: bytes | str) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else x


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's heartbeat: who it is, what it holds, how much it may hold (None: no bound)."""

    worker: str
    streams: tuple[str, ...]
    capacity: int | None

    @property
    def load(self) -> int:
        return len(self.streams)

    @property
    def has_room(self) -> bool:
        return self.capacity is None or self.load < self.capacity

    def to_hash(self) -> dict[str, str]:
        # Stream names never hold a comma (check_stream_name), so a comma-joined list is unambiguous.
        return {"capacity": "" if self.capacity is None else str(self.capacity), "streams": ",".join(self.streams)}

    @classmethod
    def from_hash(cls, worker: str, raw: dict[Any, Any]) -> WorkerLoad:
        fields = {_text(k): _text(v) for k, v in raw.items()}
        capacity = fields.get("capacity", "")
        streams = tuple(s for s in fields.get("streams", "").split(",") if s)
        return cls(worker, streams, int(capacity) if capacity.isdigit() else None)


def namesake_seen(raw: dict[Any, Any], now: float) -> bool:
    """Does a heartbeat say another live process used its name recently?"""
    at = _text(raw.get(NAMESAKE_AT.encode(), raw.get(NAMESAKE_AT, b"")))
    try:
        return now - float(at) < NAMESAKE_RECENT_S
    except ValueError:
        return False


def _wrong_type(reply: Any) -> bool:
    return isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE")


def worker_ids(members: Iterable[bytes | str]) -> list[str]:
    return sorted(_text(m) for m in members)


def queue_workers(pipe: Any, ids: list[str]) -> None:
    """Queue what ``workers_from`` reads (sync or asyncio pipeline alike)."""
    for worker in ids:
        pipe.hgetall(keys.worker(worker))


def workers_from(ids: list[str], replies: list[Any]) -> list[WorkerLoad]:
    """Live workers: those whose heartbeat key still exists."""
    return [WorkerLoad.from_hash(w, raw) for w, raw in zip(ids, replies, strict=True) if isinstance(raw, dict) and raw]


class Placement:
    """This worker's heartbeat and its side of the placement rule."""

    def __init__(self, r: redis.Redis, worker: str, capacity: int | None, ttl_ms: int, life: str | None = None):
        """``life``: this process's lease value (`common.lease.lease_owner`), or one of its own."""
        self.r, self.worker, self.capacity, self.ttl_ms = r, worker, capacity, ttl_ms
        self.life = life or lease_owner(worker)
        self.beaten = False  # our heartbeat written once: another life's after it is a live namesake's
        self.namesake_at: float | None = None  # when another live process's heartbeat was last found
        self._namesake_said = -NAMESAKE_SAY_EVERY_S

    def beat(self, owned: Iterable[str]) -> list[WorkerLoad]:
        """Say we are alive and hold ``owned``; returns the other live workers as they last said.

        Only workers write the heartbeat keys, as a hash and a set: a key of another type there is
        damage, and its WRONGTYPE would stop every worker at each heartbeat, restarted or not. It
        is replaced (one log line); another worker's heartbeat of a wrong type counts as dead."""
        me = WorkerLoad(self.worker, tuple(sorted(owned)), self.capacity)
        replies = self._say(me)
        if damaged := {k for k, reply in replies if _wrong_type(reply)}:
            log.error("heartbeat keys of the wrong type; replaced", keys=sorted(damaged))
            for key in damaged:  # one at a time: on a cluster they lie in different slots
                self.r.delete(key)
            replies = self._say(me)
        for _, reply in replies:
            if isinstance(reply, Exception):
                raise reply
        self._check_namesake(replies[0][1])
        ids = [w for w in worker_ids(replies[-1][1]) if w != self.worker]
        pipe = self.r.pipeline(transaction=False)
        queue_workers(pipe, ids)
        others = workers_from(ids, pipe.execute(raise_on_error=False))
        if gone := set(ids) - {o.worker for o in others}:  # heartbeats expired: dead workers
            self.r.srem(keys.WORKERS, *gone)
        return others

    def _say(self, me: WorkerLoad) -> list[tuple[str, Any]]:
        """The life that wrote our heartbeat last read, ours written, the set of workers read:
        (key, reply or the error it raised) each."""
        key = keys.worker(self.worker)
        fields = me.to_hash() | {LIFE: self.life}
        if self.namesake_at is not None:
            fields[NAMESAKE_AT] = f"{self.namesake_at:.3f}"
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(key, LIFE)
        pipe.hset(key, mapping=fields)
        pipe.pexpire(key, self.ttl_ms)
        pipe.sadd(keys.WORKERS, self.worker)
        pipe.smembers(keys.WORKERS)
        replies = pipe.execute(raise_on_error=False)
        return list(zip((key, key, key, keys.WORKERS, keys.WORKERS), replies, strict=True))

    def _check_namesake(self, last: bytes | None) -> None:
        """Another life's heartbeat found where we wrote ours a beat ago: a live process under our
        name (its key exists, so it beat within the TTL). On the first beat it may be our own
        predecessor's, dead and restarted: not counted."""
        seen = self.beaten and last is not None and _text(last) != self.life
        self.beaten = True
        if not seen:
            return
        self.namesake_at = time.time()
        metrics.WORKER_NAMESAKES.inc()
        if time.monotonic() - self._namesake_said >= NAMESAKE_SAY_EVERY_S:
            self._namesake_said = time.monotonic()
            log.error(
                f"another live process uses consumer name {self.worker}; give each worker its own name",
                worker=self.worker,
                other=_text(last),
                life=self.life,
            )

    def leave(self) -> None:
        """A clean exit: the others need not wait for the heartbeat to expire."""
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(keys.worker(self.worker))
        pipe.srem(keys.WORKERS, self.worker)
        pipe.execute()

    def has_room(self, load: int) -> bool:
        return self.capacity is None or load < self.capacity

    def share(self, load: int, free: int, others: list[WorkerLoad]) -> int:
        """How many streams this worker, holding ``load`` with ``free`` streams unowned, should hold:
        the ceiling of what it and the other workers with room hold or could take, over their
        number, capped by its capacity. Every worker computes the same figure, so a crowd of free
        streams (a start, a dead worker) is spread in one round instead of one stream a beat."""
        peers = [o for o in others if o.has_room]
        total = load + free + sum(o.load for o in peers)
        fair = -(-total // (len(peers) + 1))
        return fair if self.capacity is None else min(fair, self.capacity)

    @staticmethod
    def holding(others: list[WorkerLoad], free: Iterable[str]) -> list[WorkerLoad]:
        """The workers that still hold streams or have none yet: one that says it holds streams
        that are all free has died (its leases ran out; its heartbeat, renewed just after them, a
        few ms later). Counted, it would halve the share of a survivor taking its streams."""
        free = set(free)
        return [o for o in others if not o.streams or not set(o.streams) <= free]

    @staticmethod
    def should_hand_off(load: int, others: list[WorkerLoad]) -> bool:
        """Is this worker, holding ``load`` streams, two or more above a worker that has room?"""
        lighter = [o.load for o in others if o.has_room]
        return bool(lighter) and load >= min(lighter) + 2
