"""Answer streams multiplexed over a few Redis connections.

A streamed answer used to hold a pooled connection in XREAD BLOCK for its whole life, so 100
waiting clients emptied the pool and the 101st got "redis unreachable". Here each of a few reader
tasks owns one connection and reads every `svqa:answer:{qid}` given to it in one XREAD, handing
each entry to its question's queue: 1,000 answers in flight cost `answer_readers` connections.

A reader blocked in XREAD does not see an answer stream added meanwhile; the newcomer wakes it
with CLIENT UNBLOCK (its read returns at once, and the next one includes the new key). Where the
Redis user may not (an ACL without `client|unblock`), reads block at most JOIN_MS instead. On a
Redis Cluster one XREAD cannot span hash slots, so readers poll each slot's streams every POLL_S.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aredis
import structlog
from redis.exceptions import ResponseError

from common.redisio import OUTAGE_ERRORS, POLL_S, is_cluster, text
from common.wire import keys

log = structlog.get_logger()

JOIN_MS = 50  # longest a new answer stream waits to be read where readers cannot be woken
EXPIRY_MARGIN_S = 10.0  # a subscription nobody closed (its response never started) is dropped this late
Fields = dict[bytes, bytes]


class Busy(Exception):
    """This API process holds all it may: the request is refused before anything is queued (503, Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Subscription:
    """One question's answer stream: batches of entry fields (or the error that ended reading) in ``queue``."""

    def __init__(self, reader: _Reader, qid: str, expires: float):
        self.reader, self.qid, self.key, self.expires = reader, qid, keys.answer(qid), expires
        self.queue: asyncio.Queue[list[Fields] | Exception] = asyncio.Queue()
        self.last = "0"  # the newest entry id handed over

    def close(self) -> None:
        self.reader.remove(self)


class _Reader:
    """One connection, one task: XREAD over its subscriptions' streams, fanned out to their queues."""

    def __init__(self, r: aredis.Redis, waker: aredis.Redis | None, block_ms: int):
        self.r, self.waker, self.block_ms = r, waker, block_ms
        self.subs: dict[str, Subscription] = {}
        self.added = asyncio.Event()
        self.generation = 0  # bumped by every subscription added
        self.reading: int | None = None  # the generation the read under way covers; None: not reading
        self.client_id: int | None = None
        self.waking: asyncio.Task | None = None
        self.task: asyncio.Task | None = None

    def add(self, sub: Subscription) -> None:
        self.subs[sub.key] = sub
        self.generation += 1
        self.added.set()
        if self.reading is not None and self.waker is not None and (self.waking is None or self.waking.done()):
            self.waking = asyncio.create_task(self._wake())

    def remove(self, sub: Subscription) -> None:
        if self.subs.get(sub.key) is sub:
            del self.subs[sub.key]

    async def run(self) -> None:
        me = asyncio.current_task()
        # until cancelled, even by a cancellation a read swallowed (redis-py's cluster pipeline can
        # turn one into a connection error, which would otherwise count as an outage and loop on:
        # shutting the API down hung)
        while me is None or not me.cancelling():
            self._expire()
            if not self.subs:
                self.added.clear()
                await self.added.wait()
                continue
            streams = {key: sub.last for key, sub in self.subs.items()}
            self.reading = self.generation
            try:
                got = await self._read(streams)
            except (*OUTAGE_ERRORS, ResponseError) as e:  # every stream of this read ends with it
                self._fail(streams, e)
                continue
            except Exception as e:  # anything else ends these streams too, never the reader
                log.exception("answer read failed", streams=len(streams))
                self._fail(streams, e)
                continue
            finally:
                self.reading = None
            for key, entries in got:
                sub = self.subs.get(text(key))
                if sub is not None and entries:
                    sub.last = text(entries[-1][0])
                    sub.queue.put_nowait([fields for _, fields in entries])

    async def _read(self, streams: dict[str, str]) -> list:
        if is_cluster(self.r):
            return await self._poll(streams)
        if self.waker is not None:  # asked before each read: a reconnect gives the connection a new id
            self.client_id = await self.r.client_id()
        block = self.block_ms if self.waker is not None else min(self.block_ms, JOIN_MS)
        return await self.r.xread(streams, block=block) or []

    async def _poll(self, streams: dict[str, str]) -> list:
        """Non-blocking reads, one per stream, pipelined; POLL_S of sleep when none had news."""
        pipe = self.r.pipeline()
        for key, last in streams.items():
            pipe.xread({key: last})
        got = [found for reply in await pipe.execute() for found in reply or []]
        if not got:
            await asyncio.sleep(POLL_S)
        return got

    async def _wake(self) -> None:
        """CLIENT UNBLOCK the read under way until one that covers every subscription has begun.
        An UNBLOCK sent before Redis blocks the read does nothing (0), so it is sent again."""
        while self.reading is not None and self.reading < self.generation and self.waker is not None:
            try:
                if self.client_id is not None and await self.waker.client_unblock(self.client_id):
                    return
            except ResponseError as e:  # NOPERM: this Redis user may not; reads block JOIN_MS at most
                log.warning("answer readers cannot be woken: reads poll", error=str(e), every_ms=JOIN_MS)
                self.waker = None
                return
            except (*OUTAGE_ERRORS, Busy):
                pass
            await asyncio.sleep(0.002)

    def _fail(self, streams: dict[str, str], error: Exception) -> None:
        for key in streams:
            sub = self.subs.pop(key, None)
            if sub is not None:
                sub.queue.put_nowait(error)

    def _expire(self) -> None:
        now = time.monotonic()
        for sub in [s for s in self.subs.values() if s.expires < now]:
            self.remove(sub)


class AnswerHub:
    """The readers of one API process, started with its first subscription."""

    def __init__(
        self, connect: Callable[[], aredis.Redis], waker: aredis.Redis, readers: int, block_ms: int, max_answers: int
    ):
        self.connect, self.waker, self.count = connect, waker, readers
        self.block_ms, self.max_answers = block_ms, max_answers
        self.readers: list[_Reader] = []

    def open(self, qid: str, timeout_s: float) -> Subscription:
        """Start reading the question's answer stream (before it is asked: nothing is missed)."""
        if self.held() >= self.max_answers:
            raise Busy(f"busy: this API process holds {self.max_answers} answers in flight (max_answers)")
        if not self.readers:
            self._start()
        reader = min(self.readers, key=lambda rd: len(rd.subs))
        sub = Subscription(reader, qid, time.monotonic() + timeout_s + EXPIRY_MARGIN_S)
        reader.add(sub)
        return sub

    def held(self) -> int:
        return sum(len(rd.subs) for rd in self.readers)

    def _start(self) -> None:
        for _ in range(self.count):
            r = self.connect()
            reader = _Reader(r, None if is_cluster(r) else self.waker, self.block_ms)
            reader.task = asyncio.create_task(reader.run(), name="answer-reader")
            self.readers.append(reader)

    async def stop(self) -> None:
        for reader in self.readers:
            if reader.task is not None:
                reader.task.cancel()
            await reader.r.aclose()
        self.readers = []
