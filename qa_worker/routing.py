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

Searches need no stream's owner, only the frames log and its indexes (qa_worker/searching.py): a
process with the log answers a search it reads from `svqa:questions` itself; one without forwards
it, exactly once the same way, to `svqa:searches`, which only processes with the log read, if one
of them is alive (`searcher_alive`: Redis's own record of that group's consumers, no registry);
else it replies with the error at once rather than leave the search waiting for nobody.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import redis
import structlog

from common import redisio
from common.wire import keys
from common.wire.schemas import SchemaError, parse_question, question_id_of
from common.wire.search_request import is_search

log = structlog.get_logger()

QUEUE_MAXLEN = 10_000  # per stream: questions waiting for an owner, or answered and not yet trimmed
# A consumer of `svqa:searches` idle less than this is a live process with the frames log: its
# reader blocks there block_ms (1 s by default) at a time and touches the consumer at every read;
# the rest of its step (claims, a periodic job's turn) may delay the next read by a few seconds.
# Longer would send searches to a process that died that long ago (left until another claims them).
SEARCHER_IDLE_MS = 10_000
ID_IN_USE = "question id already in use by another question: ask with a new random id"

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
    return _forward_to(r, keys.questions(stream), qid, fields, ttl_s, asked)


def forward_search(r: redis.Redis, qid: str, fields: Mapping[Any, Any], ttl_s: int, asked: str | None = None) -> bool:
    """Add the search to `svqa:searches` unless it was forwarded before; True if added now."""
    return _forward_to(r, keys.SEARCHES, qid, fields, ttl_s, asked)


def _forward_to(r: redis.Redis, queue: str, qid: str, fields: Mapping[Any, Any], ttl_s: int, asked: str | None) -> bool:
    entry = {k: v for k, v in fields.items() if k not in (b"id", "id", b"asked", "asked")}
    entry |= {b"id": qid.encode()} | ({b"asked": asked.encode()} if asked else {})
    return redisio.xadd_once(r, queue, keys.once(queue, qid), entry, QUEUE_MAXLEN, ttl_s) is not None


def searcher_alive(r: redis.Redis) -> bool:
    """Whether a process with the frames log reads `svqa:searches` now (a consumer of its group
    touched lately); False when nobody ever read it (no queue or no group)."""
    try:
        consumers = r.xinfo_consumers(keys.SEARCHES, keys.QA_GROUP)
    except redis.ResponseError as e:
        if "NOGROUP" in str(e) or "no such key" in str(e):
            return False
        raise
    return any(int(c["idle"]) < SEARCHER_IDLE_MS for c in consumers)


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
    """Handles `svqa:questions` entries: forward the valid ones, reply to the others. Searches
    reach it only in a process without the frames log (one with it answers them)."""

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
        qid = question_id_of(fields, entry_id)
        if qid is not None and not self._owns(qid, redisio.text(entry_id)):
            # Its reply would go into the other question's answer stream, whose asker would read it
            # (or its asker that one's answer): it is refused where operators look, and its asker,
            # reading the other's final, finds another entry id there (`asked`; qa_worker/client.py).
            log.warning("question id already in use; not answered", qid=qid, entry=redisio.text(entry_id))
            redisio.dead_letter(self.r, queue, entry_id, fields, ID_IN_USE, group=keys.QA_GROUP)
            return
        if is_search(fields):
            self._search(queue, entry_id, fields, attempt)
            return
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

    def _owns(self, qid: str, entry_id: str) -> bool:
        """Whether the question asked as ``entry_id`` holds the id ``qid``: the first to claim it
        does, for `marker_ttl_s`, redelivered or not (every one, unchecked, under a users.acl older
        than the claim)."""
        key = keys.answer_owner(qid)

        def claimed() -> bool:
            return (
                bool(self.r.set(key, entry_id, nx=True, ex=self.marker_ttl_s))
                or redisio.text(self.r.get(key)) == entry_id
            )

        return redisio.unless_refused(claimed, True, "the claim of question ids")

    def _search(self, queue: str, entry_id: str, fields: dict, attempt: int) -> None:
        """To a process with the frames log if one is alive; else its error reply now."""
        qid = question_id_of(fields, entry_id)
        if qid is None or not searcher_alive(self.r):
            self.reply(queue, entry_id, fields, attempt)  # no id: a dead letter; no searcher: the error
            return
        forward_search(self.r, qid, fields, self.marker_ttl_s, redisio.text(entry_id))
        self.r.xack(queue, keys.QA_GROUP, entry_id)
