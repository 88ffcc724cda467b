"""`streamvqa qa`: answer questions against mirrored cache versions.

Two threads: the mirror tails cache versions; the main loop reads `svqa:questions` and the queues
of the streams it answers now (consumer group `qa`, own pending entries first after a restart),
forwards each question of the shared queue to its stream's queue (`qa_worker.routing`), answers
those of its streams' queues and, with the frames log, searches (read from `svqa:questions` and
`svqa:searches`; without it, it forwards them there), reclaims questions of dead workers, and
runs periodic jobs when they are due.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Protocol

import redis
import structlog

from common import boot, redisio
from common.config import load_cameras_file
from common.decoding import FrameDecoder
from common.engine.kvcache import Version
from common.engine.runtime import Runtime
from common.segment_store import open_store
from common.wire import keys
from common.wire.search_request import is_search
from qa_worker.admission import PUBLISH_EVERY_S
from qa_worker.alerts import AlertSettings
from qa_worker.answering import Answerer
from qa_worker.config import QAConfig
from qa_worker.jobs import JobRunner, model_answer
from qa_worker.mirror import Mirror
from qa_worker.routing import Router, requeue, take_over

log = structlog.get_logger()

PRUNE_EVERY_S = 600.0  # how often dead consumers are removed from the questions group


class VersionSource(Protocol):
    """Where versions come from: a Mirror (separate encoder) or the encoder in this process."""

    # True when only this process answers the streams it answers now (it holds their leases): it
    # then takes over their pending questions at once when it gets a stream.
    exclusive: bool

    def get(self, stream: str, at: int | None = None) -> Version | None: ...
    def serves(self, stream: str) -> bool: ...  # known here: a question for another gets an error reply
    def answering(self) -> list[str]: ...  # streams whose own question queues this process reads now
    def run(self, stop: threading.Event) -> None: ...


def served_streams(cfg: QAConfig) -> list[str]:
    return list(cfg.streams) or [c.name for c in load_cameras_file(cfg.cameras_file).cameras]


class QAService:
    def __init__(
        self,
        cfg: QAConfig,
        rt: Runtime,
        r: redis.Redis,
        versions: VersionSource,
        frames: redis.Redis | None = None,
        *,
        decoder: FrameDecoder | None = None,
        live_tokens: int | None = None,
    ):
        """``frames``: the Redis holding frame pictures, for alerts (default ``r``). ``decoder``: the
        processes that decode logged frames for questions about the past (a worker's encoder's; by
        default its own, with `framelog_dir`). ``live_tokens``: the KV pool tokens the live streams
        of this process are guaranteed (a worker's: `Runtime.live_tokens`); None: no live stream
        writes to its pool (qa alone), the number of history caches at once is their only bound."""
        self.cfg, self.rt, self.r = cfg, rt, r
        self.versions = versions
        self.own_decoder = decoder is None and cfg.framelog_dir is not None
        self.decoder = FrameDecoder(cfg.decode_processes) if self.own_decoder else decoder
        self.answerer = Answerer(
            rt,
            r,
            versions.get,
            versions.serves,
            consumer=cfg.consumer,
            reply_ttl_s=cfg.reply_ttl_s,
            max_reply_ttl_s=cfg.max_reply_ttl_s,
            answers_maxlen=cfg.answers_maxlen,
            max_deliveries=cfg.max_deliveries,
            framelog_dir=cfg.framelog_dir,
            history_max_tokens=cfg.history_max_tokens,
            history_max_concurrent=cfg.history_max_concurrent,
            max_queue_wait_s=cfg.max_queue_wait_s,
            live_tokens=live_tokens,
            decoder=self.decoder,
        )
        jobs = list(load_cameras_file(cfg.cameras_file).jobs) if cfg.cameras_file else []
        alerts = AlertSettings(
            cfg.alerts_maxlen, cfg.alert_frame_ttl_s, cfg.alert_base_url or "", cfg.mqtt_discovery_prefix or ""
        )
        self.jobs = JobRunner(
            r,
            versions.get,
            jobs,
            served_streams(cfg),
            model_answer(rt),
            cfg.transcript_dir,
            frames=frames,
            alerts=alerts,
        )
        self.router = Router(
            r,
            versions.serves,
            self.answerer.handle,
            self.answerer.reject,
            consumer=cfg.consumer,
            marker_ttl_s=cfg.reply_ttl_s,
            max_deliveries=cfg.max_deliveries,
        )
        # With the frames log this process answers searches, its own and those forwarded by the
        # processes without it (qa_worker/routing.py); without it, it forwards its own there.
        self.searches_here = cfg.framelog_dir is not None
        self.shared = [keys.QUESTIONS, keys.SEARCHES] if self.searches_here else [keys.QUESTIONS]
        self.reader = redisio.GroupReader(
            r, self.shared, keys.QA_GROUP, cfg.consumer, count=cfg.max_in_flight, block_ms=cfg.block_ms
        )
        self.queues: set[str] = set()  # the per-stream question queues the reader follows now
        # Questions are answered side by side, so the GPU scheduler batches their decode steps and
        # starts them in order (cameras first); a free slot is taken before an entry is answered,
        # so at most max_in_flight are taken at once, answered or waiting for the GPU.
        self.questions_pool = ThreadPoolExecutor(max_workers=cfg.max_in_flight, thread_name_prefix="question")
        self.slots = threading.BoundedSemaphore(cfg.max_in_flight)
        self.in_flight: set[tuple[str, str]] = set()  # (queue, entry id) being answered: never twice at once
        self._in_flight_lock = threading.Lock()
        self._last_claim = self._last_published = self._last_kept_alive = 0.0
        self._publish_refused = False  # said once
        self._last_prune = time.monotonic()
        self.versions_failed: BaseException | None = None

    def run(self, stop: threading.Event) -> None:
        log.info("qa started", consumer=self.cfg.consumer)
        versions = threading.Thread(target=self._run_versions, args=(stop,), name="versions", daemon=True)
        versions.start()
        redisio.run_riding_out(self.r, self.step, stop, self.cfg.redis_grace_s, on_back=self.reader.reset)
        self.questions_pool.shutdown(wait=True)  # questions in flight get their final answers
        self.answerer.searcher.close()
        if self.own_decoder and self.decoder is not None:
            self.decoder.close()
        self.jobs.flush()
        versions.join(timeout=30)
        if self.versions_failed is not None:
            raise self.versions_failed

    def _run_versions(self, stop: threading.Event) -> None:
        """The versions thread; if it dies the whole worker stops (no half-alive worker)."""
        try:
            self.versions.run(stop)
        except BaseException as e:
            log.exception("versions thread failed; stopping")
            self.versions_failed = e
            stop.set()

    def step(self) -> None:
        self._follow_streams()
        self.reader.ensure_groups()  # the claims below need them; made here, where outages are ridden out
        if time.monotonic() - self._last_claim > self.cfg.claim_idle_ms / 2000:
            self._last_claim = time.monotonic()
            self._keep_in_flight_alive()
            for queue in [*self.shared, *sorted(self.queues)]:
                stale = redisio.claim_stale(self.r, queue, keys.QA_GROUP, self.cfg.consumer, self.cfg.claim_idle_ms)
                self._dispatch(stale)
                redisio.trim_consumed(self.r, queue, keys.QA_GROUP)
            for queue in self.shared:  # the queues anybody allowed to ask writes to
                redisio.unless_refused(
                    lambda queue=queue: redisio.reopen_after_future_ids(self.r, queue), None, "reopen " + queue
                )
        self._dispatch(self.reader.read())
        self._publish_admission()
        if time.monotonic() - self._last_prune > PRUNE_EVERY_S:
            self._last_prune = time.monotonic()
            for queue in [*self.shared, *sorted(self.queues)]:
                redisio.prune_consumers(self.r, queue, keys.QA_GROUP, self.cfg.consumer)
        self.jobs.run_due()  # questions first: a person is waiting on those

    def _publish_admission(self) -> None:
        """What the API reads before it accepts a question (qa_worker/admission.py), when due. A
        Redis user not allowed to write it (an ACL file older than the key) costs the API its 429s,
        not the worker its life."""
        if time.monotonic() - self._last_published <= PUBLISH_EVERY_S:
            return
        self._last_published = time.monotonic()
        try:
            answerer = self.answerer
            answerer.admission.publish(
                self.r, self.cfg.consumer, self.versions.answering(), answerer.history.gate.queue
            )
        except redis.ResponseError as e:
            if not self._publish_refused:
                log.warning("queue not published for the API: Redis refused it", error=str(e)[:200])
            self._publish_refused = True

    def _keep_in_flight_alive(self) -> None:
        self._last_kept_alive = time.monotonic()
        with self._in_flight_lock:
            by_queue: dict[str, list[str]] = {}
            for queue, entry_id in self.in_flight:
                by_queue.setdefault(queue, []).append(entry_id)
        for queue, ids in by_queue.items():
            redisio.keep_alive(self.r, queue, keys.QA_GROUP, self.cfg.consumer, ids)

    def _follow_streams(self) -> None:
        """Read the question queues of the streams answered here now. A stream just taken over
        brings the questions its previous owner had taken and not answered (read as our own
        pending history next)."""
        wanted = {keys.questions(s) for s in self.versions.answering()}
        for queue in self.queues - wanted:
            self.reader.remove(queue)
        for queue in sorted(wanted - self.queues):
            self.reader.add(queue)
            if self.versions.exclusive:
                take_over(self.r, queue, self.cfg.consumer)
        self.queues = wanted

    def _dispatch(self, entries: list[redisio.Entry]) -> None:
        """Route the shared queue's entries, answer those of the streams' queues. A suspect (an entry
        under way when a worker died: ``redisio.Attempts``) is handled alone, by this thread once
        every slot is free: should it kill this worker too, nothing else shares the blame."""
        self._route([e for e in entries if self._routed(e)])
        answering = set(self.versions.answering())
        for entry in entries:
            if self._routed(entry):
                continue
            if entry[0] not in self.shared and keys.stream_of(entry[0]) not in answering:
                requeue(self.r, entry, self.cfg.consumer)  # the stream moved on: its new owner answers
                continue
            with self._in_flight_lock:
                if entry[:2] in self.in_flight:
                    continue  # our own, still being answered (idle only because it is slow)
            if self.answerer.attempts.suspect(*entry[:2]):
                with self._alone():
                    self._answer_one(entry, alone=True)
                continue
            with self._in_flight_lock:
                self.in_flight.add(entry[:2])
            while not self.slots.acquire(timeout=PUBLISH_EVERY_S):  # every slot taken: the API still learns so
                self._publish_admission()
                if time.monotonic() - self._last_kept_alive > self.cfg.claim_idle_ms / 2000:
                    self._keep_in_flight_alive()  # and the questions taken are not claimed from us meanwhile
            self.questions_pool.submit(self._answer_beside_others, entry)

    def _routed(self, entry: redisio.Entry) -> bool:
        """Whether the router handles ``entry``: a shared queue's question, or its search here
        without the frames log (a search needs no stream's owner, only the indexes on disk: a
        process with them answers it)."""
        return entry[0] == keys.QUESTIONS and not (self.searches_here and is_search(entry[2]))

    def _route(self, shared: list[redisio.Entry]) -> None:
        suspects = [e for e in shared if self.router.attempts.suspect(*e[:2])]
        self.router.route([e for e in shared if e not in suspects])  # fast: no model involved
        for entry in suspects:
            with self._alone():
                self.router.route([entry], alone=True)

    @contextmanager
    def _alone(self) -> Iterator[None]:
        """Every slot: no question is under way until the block ends."""
        for _ in range(self.cfg.max_in_flight):
            self.slots.acquire()
        try:
            yield
        finally:
            self.slots.release(self.cfg.max_in_flight)

    def _answer_beside_others(self, entry: redisio.Entry) -> None:
        try:
            self._answer_one(entry, alone=False)
        finally:
            with self._in_flight_lock:
                self.in_flight.discard(entry[:2])
            self.slots.release()

    def _answer_one(self, entry: redisio.Entry, alone: bool) -> None:
        try:
            self.answerer.handle_entries([entry], alone)
        except redisio.OUTAGE_ERRORS as e:  # left pending: answered once Redis is back (claim_stale)
            log.warning("question left pending: Redis unreachable", entry=entry[1], error=str(e))
        except Exception:
            log.exception("question handling failed", entry=entry[1])


def main(argv: list[str]) -> int:
    cfg, r = boot.start(QAConfig, argv, "streamvqa qa")
    rt = boot.load_runtime(cfg.model, cfg.device, cfg, cfg.gemm_dtype)
    mirror = Mirror(rt, r, open_store(cfg.segment_store, r), served_streams(cfg), cfg.block_ms)
    service = QAService(cfg, rt, r, mirror, boot.frames_redis(cfg, r))
    return redisio.exit_code(lambda: service.run(boot.stop_on_signals()))
