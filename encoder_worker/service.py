"""`streamvqa encoder`: take leases on streams, read their frames, publish cache versions.

Placement (`common.placement`): at every lease check (at least once a second) the worker renews
its leases, writes its heartbeat, takes free streams up to its fair share (capped by
`max_streams`), and hands one stream off, at most every HAND_OFF_EVERY_S, when another worker
holds two fewer; a stream that became free (a lease ran out) is looked for every FREE_CHECK_S.
Leases and the heartbeat are also renewed by a thread of their own, so a main loop held up by a
slow chunk does not lose them. A dead worker's streams are therefore all taken within
FREE_CHECK_S of their leases running out (at most lease_ms after its death), then restored from
the segment store by RESTORE_AT_ONCE tasks sharing the restorer's readers (encoder_worker/restore.py).

One loop: keep leases, read frames of owned streams (consumer group `enc`, own pending entries
first after a restart), hand each stream's entries to a task of its own, which gives them to its
OwnedStream inside the processing boundary (`redisio.process`): a bad entry, or one delivered too
often, is dead-lettered with an event; nothing a message contains can stop the loop. A stream is
read again once its task is done, not once every stream's is: a chunk waiting for the GPU holds
back only its own stream. A Redis outage is waited out for `redis_grace_s`;
after it the worker renews its leases and checks that each head is still the version it wrote
before it goes on (exit 3 past the grace period).
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from concurrent import futures

import redis
import structlog

from common import boot, health, redisio
from common.clock import SharedClock
from common.config import load_cameras_file
from common.decoding import FrameDecoder
from common.engine.kvcache import Version
from common.engine.runtime import Runtime
from common.lease import Lease, lease_owner
from common.placement import Placement, WorkerLoad
from common.segment_store import SegmentStore, open_store
from common.segment_writer import SegmentWriter, WriterClosed
from common.wire import keys
from common.wire.schemas import SchemaError, capture_time, check_frame_entry, unpack_frame
from encoder_worker.config import EncoderConfig
from encoder_worker.owned_stream import (
    BadDescription,
    LeaseLost,
    OwnedStream,
    StreamNotReady,
    WriteFailed,
    dead_letter_frame,
    event,
    open_stream,
)
from encoder_worker.restore import Restorer

log = structlog.get_logger()

READ_PER_STREAM = 16  # frames entries read per owned stream and step (XREADGROUP's COUNT is per stream)
BUSY_BLOCK_MS = 20  # a read's wait while some streams' tasks run: those are read again soon after they end
PRUNE_EVERY_S = 600.0  # how often dead consumers are removed from the frames groups
LEASE_CHECK_MAX_S = 1.0  # leases renewed and free streams tried at least this often
FREE_CHECK_S = 0.2  # and free streams looked for this often (one pipelined EXISTS): a dead worker's are taken at once
HAND_OFF_EVERY_S = 3.0  # at most one stream handed off per this long: rebalancing is gradual
HAND_OFF_WAIT_S = 10.0  # a stream handed off waits this long at most for its partial chunk
STOP_WAIT_S = 10.0  # at a clean stop, questions being answered here get this long to finish
# A stream whose open fails is tried again every lease period; the same cause is said (event, log
# line) at most this often per stream: it was an event and a traceback every 5 s
OPEN_FAILED_EVERY_S = 60.0
BAD_DATA = (BadDescription, SchemaError)  # open failures said in one line: the message says it all
# Streams restored at once: each has a slot of the restorer's page-locked arena (encoder_worker/
# restore.py), which its segments are read into by the restorer's threads (`restore_threads`) and
# copied out of by the GPU loop. Enough to keep the readers busy while heads wait for the loop (up
# to an encode step, 0.2 s; 16 readers read 1.2 GB in about 0.08 s on a 2xH200 host); each costs
# its slot of host memory for good (1.4 GB at 32K with random-3b, `_head_bytes`).
RESTORE_AT_ONCE = 4
UNBOUNDED_HEAD_TOKENS = 32768  # a slot's head without an eviction budget
HEAD_SLACK = 1.15  # a slot holds a head of `max_cache_tokens` and this much more (a chunk over, embeddings)


class EncoderService:
    def __init__(
        self, cfg: EncoderConfig, rt: Runtime, r: redis.Redis, store: SegmentStore, frames: redis.Redis | None = None
    ):
        """``frames``: the Redis holding the frames streams (default ``r``, which keeps the rest)."""
        self.cfg, self.rt, self.r, self.store = cfg, rt, r, store
        self.writer = SegmentWriter(store, cfg.store_writers)  # segments written off the stream threads
        self.frames = frames or r
        # frames' ages and stamps are judged on Redis's clock, which ingest stamps them with: not this
        # host's, which may be off (refreshed with the lease checks)
        self.clock = SharedClock(self.frames)
        self.names = list(cfg.streams) or [c.name for c in load_cameras_file(cfg.cameras_file).cameras]
        self.owner = lease_owner(cfg.consumer)  # this process's, fencing off any other of the same name
        self.leases = {n: Lease(r, n, self.owner, cfg.lease_ms) for n in self.names}
        self.owned: dict[str, OwnedStream] = {}
        self.opening: set[str] = set()  # leases taken, caches being restored by their tasks
        self._restoring = threading.BoundedSemaphore(RESTORE_AT_ONCE)
        # its page-locked arena: now, once (not while a GPU loop serves)
        self.restorer = Restorer(rt.loaded.device, cfg.restore_threads, RESTORE_AT_ONCE, _head_bytes(cfg, rt))
        self.placement = Placement(r, cfg.consumer, cfg.max_streams, cfg.lease_ms, life=self.owner)
        self.leaving: str | None = None  # the stream being handed off to a less loaded worker
        self._leaving_since = 0.0
        self._last_hand_off = -HAND_OFF_EVERY_S
        self._free_since: dict[str, float] = {}  # streams seen without a lease, and since when
        self.reader = redisio.GroupReader(
            self.frames,
            [],
            keys.ENCODER_GROUP,
            cfg.consumer,
            count=READ_PER_STREAM,  # not x streams: that took 64 cameras' whole backlogs in one reply
            block_ms=cfg.block_ms,
        )
        # Streams are handled side by side, so their chunks reach the GPU scheduler together and
        # share its batches; entries of one stream stay in order, in one task at a time.
        self.streams_pool = futures.ThreadPoolExecutor(max(1, len(self.names)), thread_name_prefix="stream")
        self.tasks: dict[str, futures.Future] = {}  # stream -> the task handling its last read, or opening it
        self.decoder = FrameDecoder(cfg.decode_processes)  # pixels decoded out of this process's GIL
        self._last_lease_check = self._last_free_check = 0.0
        self._free: set[str] = set()  # streams nobody held at the last look (`_free_streams`)
        self._open_failed: dict[str, tuple[str, float]] = {}  # stream -> the open failure last said, and when
        self._lease_check_s = min(cfg.lease_ms / 3000, LEASE_CHECK_MAX_S)
        self._free_wait_ms = min(cfg.block_ms, int(FREE_CHECK_S * 1000))  # a read's longest wait
        self._last_prune = time.monotonic()

    # -- a version source for QA in the same process (qa_worker.service.VersionSource) -----------
    exclusive = True  # the lease owner alone answers a stream's questions

    def get(self, stream: str, at: int | None = None) -> Version | None:
        """The head of an owned stream (`at` answers only when it names the head)."""
        owned = self.owned.get(stream)
        if owned is None:
            return None
        head = owned.engine.head
        return head if at in (None, head.id) else None

    def serves(self, stream: str) -> bool:
        return stream in self.names

    def answering(self) -> list[str]:
        """Owned streams, restored; not the one being handed off (its questions wait for the next owner)."""
        return [n for n in list(self.owned) if n != self.leaving]

    def run(self, stop: threading.Event) -> None:
        log.info("encoder started", streams=self.names, consumer=self.cfg.consumer, max_streams=self.cfg.max_streams)
        done = threading.Event()
        keeper = threading.Thread(target=self._renew_until, args=(done,), name="leases", daemon=True)
        keeper.start()
        try:
            try:
                both = [self.r] if self.frames is self.r else [self.r, self.frames]  # either may be the one away
                redisio.run_riding_out(both, self.step, stop, self.cfg.redis_grace_s, on_back=self.after_outage)
            finally:
                self._settle(STOP_WAIT_S)
                self.writer.close()
                self.restorer.close()
                done.set()
                keeper.join()
            # Streams are released only once the questions taken here are answered: the next owner
            # would otherwise take them over while they are still being answered.
            deadline = time.monotonic() + STOP_WAIT_S
            for name in list(self.owned):
                while self._questions_taken(name) and time.monotonic() < deadline:
                    time.sleep(0.05)
                self._release(name)
            self.placement.leave()
        finally:  # after those questions: in a worker, QA decodes logged frames in these processes too
            self.decoder.close()

    def step(self) -> None:
        """Read the streams whose tasks are done and start a task for each stream that got entries.

        Streams are not read in rounds: a round waited for its slowest stream (a chunk that had to
        wait for several GPU steps), then every stream decoded its first frames before any had a
        chunk for the GPU, which encoded one-chunk steps for half a second a round (64 cameras,
        H200, 2026-11-27: 12-22 s of 150 in steps of fewer than 8 chunks)."""
        self._keep_leases_if_due()
        self._collect()
        if self.leaving is not None:  # before its stream is read again: between its tasks
            self._finish_hand_off(self.leaving)
        idle = {keys.frames(n) for n in self.owned if n not in self.tasks}
        if idle or not self.tasks:
            by_stream: dict[str, list[redisio.Entry]] = {}
            # never longer than FREE_CHECK_S: a worker whose streams are quiet (or that has none)
            # still looks for a dead worker's streams that often
            for entry in self.reader.read(idle, BUSY_BLOCK_MS if self.tasks else self._free_wait_ms):
                by_stream.setdefault(keys.stream_of(entry[0]), []).append(entry)
            for name, entries in by_stream.items():
                self.tasks[name] = self.streams_pool.submit(self._process, entries)
        else:
            futures.wait(self.tasks.values(), self._free_wait_ms / 1000, futures.FIRST_COMPLETED)
        self._keep_leases_if_due()
        if time.monotonic() - self._last_prune > PRUNE_EVERY_S:
            self._last_prune = time.monotonic()
            for name in self.owned:
                redisio.prune_consumers(self.frames, keys.frames(name), keys.ENCODER_GROUP, self.cfg.consumer)

    def after_outage(self) -> None:
        """Redis is back: keep only streams whose lease and head are still ours, finish their chunks,
        and read our pending history again (entries whose delivery reply was lost on the way)."""
        self._settle()
        for name in list(self.owned):
            if not self.leases[name].acquire() or not self.owned[name].resume():
                log.warning("stream not ours after the outage; reopening from its head", stream=name)
                self._drop(name)
        self._last_lease_check = 0.0
        self.reader.reset()

    def _collect(self) -> None:
        """Forget the streams' finished tasks; an outage raised in one is raised here (run() rides it out)."""
        for name in [n for n, task in self.tasks.items() if task.done()]:
            self._end_task(name).result()

    def _settle(self, timeout_s: float | None = None) -> None:
        """Wait for every stream's task (outage errors in them are the outage being ridden out)."""
        futures.wait(self.tasks.values(), timeout_s)
        for name in [n for n, task in self.tasks.items() if task.done()]:
            with contextlib.suppress(*redisio.OUTAGE_ERRORS):  # un-acked: read again from our pending history
                self._end_task(name).result()

    def _end_task(self, name: str) -> futures.Future:
        """A finished task's stream may be read again, or is dropped if the task found its lease
        lost, or is attached if the task opened it (only this thread changes what is owned and read)."""
        task = self.tasks.pop(name)
        if name in self.opening:
            self.opening.discard(name)
            if task.exception() is None and task.result() is not None:
                self._attach(name, task.result())
            return task
        owned = self.owned.get(name)
        if owned is not None and owned.lost:
            self._drop(name)
        return task

    def _keep_leases_if_due(self) -> None:
        now = time.monotonic()
        if now - self._last_lease_check > self._lease_check_s:
            self._keep_leases()
        elif now - self._last_free_check > FREE_CHECK_S:
            was_free = self._free
            if set(self._free_streams()) - was_free:  # a lease ran out (a dead worker's): taken now
                self._place()

    def _keep_leases(self) -> None:
        """Renew what we hold, say so (heartbeat), take free streams, maybe start one hand-off."""
        self._renew_owned()
        self.clock.refresh_if_due()
        self._free_streams()
        self._place()
        health.READINESS.leases_checked(list(self.owned), self.cfg.lease_ms / 1000)

    def _place(self) -> None:
        """Say what we hold (heartbeat), take free streams (`_free`, just looked up), maybe start one hand-off."""
        held = self.held()
        others = self.placement.beat(held)
        self._take_free(others)
        self._start_hand_off_if_due(others)
        if self.held() != held:
            self.placement.beat(self.held())  # the others decide on what we hold now

    def held(self) -> list[str]:
        """Streams whose leases we hold: owned, and those whose caches are being restored."""
        return [*self.owned, *self.opening]

    def _renew_until(self, done: threading.Event) -> None:
        """Leases and the heartbeat renewed from their own thread: a chunk waiting its turn on a busy GPU (or a first
        model call compiling) can take longer than a lease, and says nothing about this worker
        being dead. Whether a lease was lost (taken by another worker, or expired in an outage and
        taken back) is for the main loop to find out: its own renewal or `after_outage`."""
        while not done.wait(self._lease_check_s):
            try:
                held = self.held()
                for name in held:
                    self._renew_one(name)
                self.placement.beat(held)  # and the heartbeat, for the same reason
                health.READINESS.leases_checked(held, self.cfg.lease_ms / 1000)
            except redisio.OUTAGE_ERRORS:
                continue  # the main loop rides the outage out and checks every lease after it
            except Exception as e:  # the thread must live: dead, every lease lapsed and streams moved, unexplained
                log.exception("lease renewal round failed; tried again at the next check", error=str(e)[:200])

    def _renew_one(self, name: str) -> None:
        """One lease renewed by the keeper; anything but an outage failing it is logged and this
        stream's alone: the other streams' leases are still renewed."""
        try:
            self.leases[name].renew()
        except redisio.OUTAGE_ERRORS:
            raise
        except Exception as e:
            log.bind(stream=name).exception("lease renewal failed; tried again at the next check", error=str(e)[:200])

    def _renew_owned(self) -> None:
        self._last_lease_check = time.monotonic()
        for name in list(self.owned):
            if not self.leases[name].renew():
                log.warning("lease lost; another encoder owns the stream now", stream=name)
                self._drop(name)

    def _take_free(self, others: list[WorkerLoad]) -> None:
        free = [n for n in self.names if n in self._free]  # in order: where each worker starts is its own
        share = self.placement.share(len(self.held()), len(free), self.placement.holding(others, free))
        # Each worker starts at its own place in the list, so workers taking at once rarely collide.
        start = zlib.crc32(self.cfg.consumer.encode()) % len(free) if free else 0
        for name in free[start:] + free[:start]:
            if not self.placement.has_room(len(self.held())):
                return
            if (len(self.held()) < share or self._free_too_long(name)) and self.leases[name].acquire():
                self._free_since.pop(name, None)
                self.opening.add(name)  # restored by a task of its own: many at once, none on this loop
                self.tasks[name] = self.streams_pool.submit(self._open, name)

    def _free_streams(self) -> list[str]:
        """Served streams nobody holds a lease on (one pipelined GET each). A lease key of a wrong
        type (damage) is removed, by the owner-checked release: free, where it stalled the stream."""
        names = [n for n in self.names if n not in self.owned and n not in self.tasks]  # a dropped one's may run on
        pipe = self.r.pipeline(transaction=False)
        for name in names:
            pipe.get(keys.lease(name))
        free = []
        for name, holder in zip(names, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(holder, redis.ResponseError):
                self.leases[name].release()  # WRONGTYPE: removed; anything else is raised here
            if holder is None or isinstance(holder, redis.ResponseError):
                free.append(name)
        self._free, self._last_free_check = set(free), time.monotonic()
        for name in set(self._free_since) - set(free):
            del self._free_since[name]
        return free

    def _free_too_long(self, name: str) -> bool:
        """A free stream nobody took for a whole lease (the workers with a share to fill do not
        list it, say): whoever has room takes it."""
        since = self._free_since.setdefault(name, time.monotonic())
        return time.monotonic() - since > self.cfg.lease_ms / 1000

    def _open(self, name: str) -> OwnedStream | None:
        """A stream's task after its lease was taken: restore its cache from the head (nothing
        re-encoded; the segments are read in this thread) and take over its unacked frames.
        None when it cannot be opened now; the lease is then given back or already gone."""
        taken, taken_at = time.perf_counter(), self.clock.now()
        try:
            with self._restoring:
                waited = time.perf_counter() - taken
                owned = open_stream(
                    self.rt, self.r, self.writer, self.cfg, name, self.frames, self.restorer, owner=self.owner
                )
        except StreamNotReady:
            self.leases[name].release()  # ingest has not described the stream yet; try again later
            return None
        except LeaseLost:  # opening outlasted the lease and another worker took the stream
            log.warning("lease lost while opening the stream; another worker holds it", stream=name)
            return None
        except redisio.OUTAGE_ERRORS:
            raise  # ridden out by the main loop, which checks every lease after it
        except Exception as e:  # that stream's alone (docs/DESIGN.md "Damage stays with its stream")
            # re-raised by _collect, it ended the worker and all its streams, then every worker
            # that took the stream next. Its lease, no longer renewed, runs out: tried again then.
            self._say_open_failed(name, e)
            return None
        # Frames another consumer read but never acked belong to a dead or departed owner: take
        # them over before reading on, so nothing is skipped and the file source is not held back.
        claim = time.perf_counter()
        redisio.ensure_group(self.frames, keys.frames(name), keys.ENCODER_GROUP)
        redisio.claim_stale(self.frames, keys.frames(name), keys.ENCODER_GROUP, self.cfg.consumer, 0, count=10_000)
        owned.clock = self.clock
        owned.taken_at = taken_at  # frames captured before it waited for us only since (OwnedStream.skip_late)
        owned.opened = {
            "waited_s": round(waited, 3),  # for one of the RESTORE_AT_ONCE slots
            **owned.opened,
            "claim_s": round(time.perf_counter() - claim, 3),
            "open_s": round(time.perf_counter() - taken, 3),  # from the lease taken to here
        }
        return owned

    def _say_open_failed(self, name: str, e: Exception) -> None:
        """An `open_failed` event and one log line, with a traceback only when the failure is
        unexpected; the same cause again within OPEN_FAILED_EVERY_S is not said again (the status
        still shows it: the stream's last event, and its meta's error for a bad description)."""
        error, now = f"{type(e).__name__}: {e}"[:200], time.monotonic()
        said = self._open_failed.get(name)
        if said is not None and said[0] == error and now - said[1] < OPEN_FAILED_EVERY_S:
            return
        self._open_failed[name] = (error, now)
        why = "stream not opened; tried again once its lease runs out"
        log.error(why, stream=name, error=error, exc_info=not isinstance(e, BAD_DATA))
        event(self.r, name, "open_failed", error=error)

    def _attach(self, name: str, owned: OwnedStream) -> None:
        """An opened stream joins the owned ones and is read from now on (this thread only)."""
        self._open_failed.pop(name, None)  # a failure after this one is news: said at once
        self.owned[name] = owned
        owned.keep_lease = lambda: self._renew_if_due(owned)  # while a chunk waits for KV room
        self.reader.add(keys.frames(name), claimed=True)  # `_open` claimed them: one delivery this life
        event(self.r, name, "encoder_attached", consumer=self.cfg.consumer, **owned.opened)
        log.info("stream attached", stream=name, **owned.opened)

    def _start_hand_off_if_due(self, others: list[WorkerLoad]) -> None:
        """Above the fair share: stop answering one stream's questions, release it soon after."""
        if self.leaving is not None or time.monotonic() - self._last_hand_off < HAND_OFF_EVERY_S:
            return
        if not self.owned or not self.placement.should_hand_off(len(self.owned), others):
            return
        self.leaving = min(self.owned, key=lambda n: len(self.owned[n].pending))  # nearest a chunk boundary
        self._leaving_since = time.monotonic()
        log.info("handing a stream off to a less loaded worker", stream=self.leaving, held=len(self.owned))

    def _finish_hand_off(self, name: str) -> None:
        """Release the stream once its questions taken here are answered and, preferably, at a chunk
        boundary; a partial chunk's frames stay un-acked and its next owner claims them."""
        owned = self.owned.get(name)
        if owned is None:  # lost meanwhile
            self.leaving = None
            return
        if name in self.tasks or (owned.pending and time.monotonic() - self._leaving_since < HAND_OFF_WAIT_S):
            return
        if self._questions_taken(name):
            return
        self.leaving = None
        self._last_hand_off = time.monotonic()
        self._release(name)
        event(self.r, name, "encoder_released", consumer=self.cfg.consumer, unencoded=len(owned.pending))
        log.info("stream handed off", stream=name, held=len(self.owned))
        self.placement.beat(self.owned)

    def _questions_taken(self, name: str) -> bool:
        """Has this process (QA in `streamvqa worker` uses the same consumer name) questions of the
        stream still pending, i.e. being answered?"""
        try:
            return bool(
                self.r.xpending_range(keys.questions(name), keys.QA_GROUP, "-", "+", 1, consumername=self.cfg.consumer)
            )
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            return False  # no queue or no group yet: nothing taken

    def _process(self, entries: list[redisio.Entry]) -> None:
        redisio.process(
            self.frames,
            keys.ENCODER_GROUP,
            self.cfg.consumer,
            entries,
            self._handle,
            self._reject,
            max_deliveries=self.cfg.max_deliveries,
        )

    def _handle(self, frames_key: str, entry_id: str, fields: dict, deliveries: int) -> None:
        owned = self.owned.get(keys.stream_of(frames_key))
        if owned is None or owned.lost:
            return  # lease lost between read and handle: the new owner gets it redelivered
        if not self._renew_if_due(owned):
            return
        check_frame_entry(fields, owned.entry_cap)  # SchemaError: rejected by the boundary, never unpacked
        m = unpack_frame(fields)
        if owned.skip_late(entry_id, capture_time(m)):
            return  # a worker behind reads mostly such frames: decoding them would slow it more
        if owned.refused_grid(entry_id, m):
            return
        msg = self.decoder.decode(m)
        try:
            owned.add(entry_id, msg)
        except LeaseLost:
            log.warning("lease lost while publishing; the new owner continues from its head", stream=owned.name)
            owned.lost = True
        except WriterClosed:  # stopping, and this chunk finished after the writer closed: not the frames' fault
            log.warning("worker stopping; the chunk stays pending for the next owner", stream=owned.name)
            owned.lost = True
        except WriteFailed as e:  # its engine holds a chunk that is not stored: reopen from the head
            log.error(
                "segment not written; the stream reopens from its published head", stream=owned.name, error=str(e)
            )
            owned.lost = True
        except redisio.OUTAGE_ERRORS:
            raise
        except Exception as e:  # the engine refused the chunk: its other frames go too, the worker goes on
            for eid, _ in owned.pending:
                if eid != entry_id:
                    owned.reject(eid, {}, f"chunk failed: {type(e).__name__}: {e}"[:500])
            owned.pending = []
            raise

    def _renew_if_due(self, owned: OwnedStream) -> bool:
        """Keep this stream's lease between its entries (encoding several chunks can outlast a
        lease on a slow device); each stream is renewed only by the task handling it."""
        if time.monotonic() - owned.renewed_at < self.cfg.lease_ms / 3000:
            return True
        if self.leases[owned.name].renew():
            owned.renewed_at = time.monotonic()
            return True
        log.warning("lease lost; another encoder owns the stream now", stream=owned.name)
        owned.lost = True
        return False

    def _reject(self, frames_key: str, entry_id: str, fields: dict, reason: str) -> None:
        name = keys.stream_of(frames_key)
        owned = self.owned.get(name)
        if owned is not None and owned.refused_duplicate(entry_id, fields):
            return
        if owned is not None:
            owned.reject(entry_id, fields, reason)
        else:
            dead_letter_frame(self.r, self.frames, frames_key, entry_id, fields, reason)
            event(self.r, name, "dead_letter", entry_id=entry_id, reason=reason[:200])

    def _drop(self, name: str) -> None:
        self.owned.pop(name, None)
        self.reader.remove(keys.frames(name))
        if self.leaving == name:
            self.leaving = None

    def _release(self, name: str) -> None:
        self._drop(name)
        self.leases[name].release()


def _head_bytes(cfg: EncoderConfig, rt: Runtime) -> int:
    """A restore slot's bytes: a head at the eviction budget (a longer one reads its overflow into
    memory of its own)."""
    return int((cfg.max_cache_tokens or UNBOUNDED_HEAD_TOKENS) * rt.pool.bytes_per_token * HEAD_SLACK)


def main(argv: list[str]) -> int:
    cfg, r = boot.start(EncoderConfig, argv, "streamvqa encoder")
    rt = boot.load_runtime(cfg.model, cfg.device, cfg, cfg.gemm_dtype)
    cfg = boot.stream_capacity(cfg, rt)
    service = EncoderService(cfg, rt, r, open_store(cfg.segment_store, r), boot.frames_redis(cfg, r))
    return redisio.exit_code(lambda: service.run(boot.stop_on_signals()))
