"""Questions reach the process that holds their stream.

`svqa:questions` is the public entry point; any QA process reads it (group `qa`) and forwards each
valid question to its stream's own queue, `svqa:{cam}:questions`, which only the processes that
answer that stream read: the lease owner in `streamvqa worker`, the mirrors in split mode. An
invalid question (unparsable, unknown stream) gets its error reply right there, and so does one
for a stream that was never started (no head: "no frames yet"), rather than wait for it.

Exactly once by question id: forwarding is `redisio.xadd_once` on the stream's hash slot (a Lua script that sets
the question's marker `keys.once(queue, qid)`, NX with a TTL, and adds the entry only if it was new); the
shared entry is acked after it. A forwarder that dies between the two leaves the shared entry
pending, another one reclaims it, and the marker stops the second copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import redis

from common import redisio
from common.wire import keys
from common.wire.schemas import SchemaError, parse_question

QUEUE_MAXLEN = 10_000  # per stream: questions waiting for an owner, or answered and not yet trimmed

# KEYS[1] a stream's queue. ARGV[1] group, ARGV[2] entry id, ARGV[3] consumer, ARGV[4] MAXLEN,
# ARGV[5..] the entry's fields. Moves the entry to the end of the queue, undelivered, only if it is
# still pending on this consumer (a new owner that claimed it meanwhile answers it instead).
_REQUEUE = """
if #redis.call('xpending', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3]) == 0 then return false end
redis.call('xack', KEYS[1], ARGV[1], ARGV[2])
redis.call('xdel', KEYS[1], ARGV[2])
return redis.call('xadd', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 5))
"""


def _flat(fields: Mapping[Any, Any]) -> list[Any]:
    return [x for kv in fields.items() for x in kv]


def forward(
    r: redis.Redis, stream: str, qid: str, fields: Mapping[Any, Any], ttl_s: int, asked: str | None = None
) -> bool:
    """Add the question to ``stream``'s queue unless it was forwarded before; True if added now.

    The forwarded entry carries the question's id explicitly, and when it was asked (``asked``:
    its entry id in `svqa:questions`): its own entry id is a new one, of the forwarding.
    """
    entry = {k: v for k, v in fields.items() if k not in (b"id", "id", b"asked", "asked")}
    entry |= {b"id": qid.encode()} | ({b"asked": asked.encode()} if asked else {})
    queue = keys.questions(stream)
    return redisio.xadd_once(r, queue, keys.once(queue, qid), entry, QUEUE_MAXLEN, ttl_s) is not None


def requeue(r: redis.Redis, entry: redisio.Entry, consumer: str) -> bool:
    """Give back a question of a stream this process no longer answers; True if it was ours to give."""
    queue, entry_id, fields = entry
    added = r.eval(_REQUEUE, 1, queue, keys.QA_GROUP, entry_id, consumer, QUEUE_MAXLEN, *_flat(fields))
    return added is not None


def take_over(r: redis.Redis, queue: str, consumer: str) -> None:
    """Claim every pending question of ``queue`` (its previous owner's) for ``consumer``.

    JUSTID: the claim does not count as a delivery; the consumer's next history read does.
    """
    redisio.ensure_group(r, queue, keys.QA_GROUP)  # a queue nobody read yet has nothing pending
    start = "-"
    while pending := r.xpending_range(queue, keys.QA_GROUP, min=start, max="+", count=1000):
        ids = [p["message_id"] for p in pending]
        r.xclaim(queue, keys.QA_GROUP, consumer, 0, ids, justid=True)
        last = ids[-1]
        start = "(" + (last.decode() if isinstance(last, bytes) else last)


class Router:
    """Handles `svqa:questions` entries: forward the valid ones, reply to the others."""

    def __init__(
        self,
        r: redis.Redis,
        serves: Callable[[str], bool],
        reply: redisio.Handler,
        reject: redisio.Rejecter,
        *,
        consumer: str,
        marker_ttl_s: int,
        max_deliveries: int,
    ):
        self.r, self.serves, self.reply, self.reject = r, serves, reply, reject
        self.consumer, self.marker_ttl_s, self.max_deliveries = consumer, marker_ttl_s, max_deliveries
        self.attempts = redisio.Attempts(r, consumer, marker_ttl_s)

    def route(self, entries: list[redisio.Entry], alone: bool = False) -> None:
        """Inside the processing boundary: nothing an entry holds stops the caller. ``alone``:
        nothing else is under way in this process meanwhile (``redisio.Attempts``)."""
        redisio.process(
            self.r,
            keys.QA_GROUP,
            self.consumer,
            entries,
            self._one,
            self.reject,
            max_deliveries=self.max_deliveries,
            attempts=self.attempts,
            alone=alone,
        )

    def _one(self, queue: str, entry_id: str, fields: dict, attempt: int) -> None:
        try:
            q = parse_question(fields)
        except SchemaError:
            q = None
        # A stream with no head has never been started: nothing to wait for, "no frames yet" now.
        if q is None or not self.serves(q.stream) or not self.r.exists(keys.head(q.stream)):
            self.reply(queue, entry_id, fields, attempt)  # its error reply, acked
            return
        forward(self.r, q.stream, q.id, fields, self.marker_ttl_s, redisio.text(entry_id))
        self.r.xack(queue, keys.QA_GROUP, entry_id)
