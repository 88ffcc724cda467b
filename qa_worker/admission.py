"""The questions a QA process has taken and the GPU has not started yet, in the order taken, and
how fast the process answers: what a waiting question is told (its position and estimated wait,
in its reply stream) and what the API reads before it accepts a question (common/wire/admission.py).

The GPU scheduler decides when a question starts (scheduler.py: cameras first, then up to
`gpu_max_batch` at once); this only keeps count. The estimated wait is the position over the
answer rate: answers finished in the last RATE_WINDOW_S of time this process had questions to
answer (idle time does not count, so a quiet hour does not read as a slow GPU); unknown until it
has answered one.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis

from common import metrics
from common.wire import keys
from common.wire.admission import KEY_TTL_S, AdmissionEntry

RATE_WINDOW_S = 30.0
PUBLISH_EVERY_S = 1.0
# The hash's TTL never lapses while one process writes it, so entries of processes gone (a name
# each: host-pid) would pile up with every restart and hand-off; the living remove them this often.
FORGET_EVERY_S = 60.0
GONE_S = 60.0  # an entry not written for this long is a process gone (live ones write every second)


@dataclass
class Ticket:
    """One question taken, from `Admission.take` to its start on the GPU (`Admission.start`)."""

    seq: int
    taken_at: float
    started_at: float | None = None
    told: int | None = None  # the position it was last told


class Admission:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._waiting: dict[int, Ticket] = {}  # in the order taken
        self._open = 0  # taken, not yet done
        self._busy_s = 0.0  # time with questions open, since start
        self._since = clock()  # when _busy_s was last brought up to date
        self._answered: deque[float] = deque()  # _busy_s when each recent answer finished
        self._forget_at = 0.0  # time.monotonic() when publish next removes entries of processes gone

    def take(self) -> Ticket:
        with self._lock:
            self._tick()
            ticket = Ticket(next(self._seq), self.clock())
            self._waiting[ticket.seq] = ticket
            self._open += 1
        metrics.QUESTIONS_QUEUED.inc()
        return ticket

    def start(self, ticket: Ticket) -> None:
        """It left the queue: its first step on the GPU is under way."""
        with self._lock:
            if self._waiting.pop(ticket.seq, None) is None:
                return
            ticket.started_at = self.clock()
        metrics.QUESTIONS_QUEUED.dec()

    def done(self, ticket: Ticket) -> None:
        """Its answer is final, or it failed (perhaps before it started): an answer more for the
        rate if it started."""
        with self._lock:
            never_started = self._waiting.pop(ticket.seq, None) is not None
            self._tick()
            self._open -= 1
            if ticket.started_at is not None:
                self._answered.append(self._busy_s)
        if never_started:
            metrics.QUESTIONS_QUEUED.dec()

    def position(self, ticket: Ticket) -> int | None:
        """1 + the questions taken before it that have not started; None once it has started."""
        with self._lock:
            if ticket.seq not in self._waiting:
                return None
            return 1 + sum(1 for seq in self._waiting if seq < ticket.seq)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def rate(self) -> float | None:
        """Answers a second while busy, over the last RATE_WINDOW_S of busy time; None before any."""
        with self._lock:
            self._tick()
            while self._answered and self._answered[0] < self._busy_s - RATE_WINDOW_S:
                self._answered.popleft()
            span = min(RATE_WINDOW_S, self._busy_s)
            return len(self._answered) / span if self._answered and span > 0 else None

    def wait_s(self, position: int) -> float | None:
        """The estimated wait of the question at `position`: None until the rate is known."""
        rate = self.rate()
        return None if rate is None else position / rate

    def _tick(self) -> None:
        now = self.clock()
        if self._open:
            self._busy_s += now - self._since
        self._since = now

    def publish(self, r: redis.Redis, consumer: str, streams: Iterable[str], history: Admission | None = None) -> None:
        """For the API's admission check: this process's queue and rate, on each stream it answers,
        and those of `history`, its questions about the past waiting for a turn at a history cache."""
        turns = (history.queued, history.rate()) if history is not None else (0, None)
        entry = AdmissionEntry(self.queued, self.rate(), time.time(), *turns).to_json()
        streams = list(streams)
        pipe = r.pipeline(transaction=False)
        for stream in streams:
            pipe.hset(keys.admission(stream), consumer, entry)
            pipe.expire(keys.admission(stream), KEY_TTL_S)
        pipe.execute()
        if time.monotonic() >= self._forget_at:
            self._forget_at = time.monotonic() + FORGET_EVERY_S
            forget_gone(r, streams, time.time())


def forget_gone(r: redis.Redis, streams: list[str], now: float) -> None:
    """Remove from these streams' admission hashes the entries not written for GONE_S, or that do
    not parse (the API does not read them either: common/wire/admission.py)."""
    pipe = r.pipeline(transaction=False)
    for stream, entries in zip(streams, _read_all(r, streams), strict=True):
        gone = [f for f, raw in entries.items() if (e := AdmissionEntry.from_json(raw)) is None or now - e.at > GONE_S]
        if gone:
            pipe.hdel(keys.admission(stream), *gone)
    pipe.execute()


def _read_all(r: redis.Redis, streams: list[str]) -> list[dict]:
    pipe = r.pipeline(transaction=False)
    for stream in streams:
        pipe.hgetall(keys.admission(stream))
    return pipe.execute()
