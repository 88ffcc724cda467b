"""Defects found reviewing the changes since 8d01a1e (2026-11-28), each with the test that failed
before its fix."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import redis
import torch

from common.segment_store import MemoryStore, embeds_id
from common.wire import keys
from encoder_worker.restore import Restorer


class _EmbedsAway(MemoryStore):
    """A store (Redis, say) whose reads of kept embeddings fail as an outage fails them."""

    def get(self, stream: str, segment_id: str, *args, **kwargs) -> torch.Tensor:
        if segment_id.endswith(embeds_id("")):
            raise redis.ConnectionError("Redis went away mid-restore")
        return super().get(stream, segment_id, *args, **kwargs)


def test_restorer_slot_comes_back_when_reading_embeddings_fails():
    """An outage while a head's kept embeddings are read fails the restore, and its slot goes back
    to the restorer: lost, every later restore of the worker waited for a slot forever."""
    store = _EmbedsAway()
    store.put("cam", "c1", torch.ones(2, 2, 1, 4, 8))
    store.put("cam", embeds_id("c1"), torch.ones(4, 8))
    restorer = Restorer(torch.device("cpu"), threads=2, slots=1, slot_bytes=1 << 16)
    try:
        with pytest.raises(redis.ConnectionError):
            restorer.load(store, "cam", ["c1"], ["c1"])
        assert restorer._slots.qsize() == 1, "the slot is back"
        loaded = restorer.load(MemoryStore(), "cam", [], [])  # and the next restore gets it
        loaded.release()
    finally:
        restorer.close()


def test_a_worker_without_a_cache_budget_starts_with_max_streams_set():
    """`max_cache_tokens: none` (no eviction budget) with `max_streams` set is a valid worker
    configuration: the live streams then have no bound for the history caches to stay out of.
    Before, `streamvqa worker` computed their tokens from the missing budget and died at start
    with a TypeError."""
    from apps.worker import live_tokens
    from apps.worker_config import WorkerConfig
    from common.engine.model import load_model
    from common.engine.runtime import Runtime

    rt = Runtime(load_model("tiny-random"))
    base = dict(streams=("c1",), consumer="a", framelog_dir="/frames")
    assert live_tokens(WorkerConfig(**base, max_cache_tokens=None, max_streams=2), rt) is None
    assert live_tokens(WorkerConfig(**base, max_cache_tokens=4096, max_streams=None), rt) is None
    assert live_tokens(WorkerConfig(**base, max_cache_tokens=4096, max_streams=2), rt) == rt.live_tokens(2, 4096)


@pytest.fixture(scope="module")
def rt():
    from common.engine.model import load_model
    from common.engine.runtime import Runtime

    return Runtime(load_model("tiny-random"))


@pytest.mark.parametrize("foreign", ["more_layers", "one_layer"])
def test_a_head_of_another_models_shapes_restarts_its_stream_and_the_worker_lives(rt, redis_url, tmp_path, foreign):
    """A head whose segments are valid records of another model's K/V (the model was changed over
    a kept segment store) is not restorable: the stream starts over (`cache_restarted`, or rebuilt
    from the frames log where there is one), as for a damaged store. Before, the GPU loop's copy of
    other layers raised out of the stream's open task and killed the worker, at every start (a
    crash loop, which docs/DESIGN.md says cannot happen); a layer count of 1 was broadcast into
    every layer without an error: a wrong cache, answered from."""
    from common.segment_store import DirectoryStore
    from tests.test_persistence import encoded, encoded_then_stopped, events, head, push, run_until, service, stop

    r = redis.Redis.from_url(redis_url)
    store = DirectoryStore(tmp_path)
    encoded_then_stopped(rt, r, redis_url, store, 6)
    sid = head(r, "cam").segment_ids[-1]
    kv = store.get("cam", sid)
    store.put("cam", sid, torch.cat([kv, kv]) if foreign == "more_layers" else kv[:1].clone())

    again = service(rt, r, redis_url, store, ("cam",))
    run_until(again, lambda: "cam" in again.owned, "the stream owned")  # raised here before
    (restarted,) = events(r, "cam", b"cache_restarted")
    assert b"another model" in restarted[b"reason"]
    assert head(r, "cam").last_frame_seq == -1, "started over: an empty cache, not a wrong one"
    push(r, "cam", range(6, 8))
    run_until(again, lambda: encoded(r, "cam", 7), "the stream goes on")
    assert r.exists(keys.head("cam"))
    stop(again, r)


def test_the_client_role_runs_the_documented_cli_commands(tmp_path):
    """README: clients on the host run `streamvqa ask --redis-url redis://client:...`. The CLI
    first checks that the stream exists (the API's check: EXISTS on its meta and head, and its
    transcript for `transcript`), which the `client` user was not allowed: every ask, transcript
    and `search --stream` under it exited 3, "redis failed", before asking anything."""
    from qa_worker import client as client_cli
    from qa_worker import search_cli
    from tests.conftest import RedisServer
    from tests.test_acl import ACL, as_role

    server = RedisServer(tmp_path, args=("--aclfile", str(ACL)))
    server.start()
    try:
        url = f"redis://client:change-me-client@127.0.0.1:{server.port}/0"
        for argv in (
            ["ask", "--redis-url", url, "--stream", "nocam", "what?"],
            ["transcript", "--redis-url", url, "--stream", "nocam"],
            ["search", "--redis-url", url, "--stream", "nocam", "a red van"],
        ):
            main = search_cli.main if argv[0] == "search" else client_cli.main
            with pytest.raises(SystemExit) as exited:
                main(argv)
            assert exited.value.code == 2, f"{argv[0]}: refused as an unknown stream, not a Redis failure"
        as_role(server, "ingest").hset(keys.meta("cam1"), mapping={"fps": 2, "height": 56, "width": 56})
        assert client_cli.Client(as_role(server, "client")).known("cam1")
    finally:
        server.stop()


def test_a_stopping_encoder_keeps_its_decoder_for_the_questions_it_waits_for(rt, redis_url):
    """At a clean stop the encoder waits (STOP_WAIT_S) for the questions taken here before it
    releases its streams; in `streamvqa worker` those questions decode logged frames (questions
    about the past) in the encoder's decoder processes. The decoder was closed before that wait:
    such a question failed (its decodes cancelled), or spawned a pool nobody shut down."""
    import threading

    from encoder_worker.config import EncoderConfig
    from encoder_worker.service import EncoderService

    cfg = EncoderConfig(redis_url=redis_url, streams=("cam",), consumer="enc", block_ms=50)
    svc = EncoderService(cfg, rt, redis.Redis.from_url(redis_url), MemoryStore())
    seen: list[bool] = []

    def questions_taken(name: str) -> bool:
        seen.append(svc.decoder._pool is not None)
        return len(seen) == 1  # one question still being answered at the first look

    svc.step = lambda: None  # nothing to read: the stop is what is tested
    svc._questions_taken = questions_taken
    svc.owned["cam"] = object()  # a stream held, its question being answered
    stop = threading.Event()
    stop.set()
    svc.run(stop)
    assert seen == [True, True], "the decoder serves the questions waited for"
    assert svc.decoder._pool is None, "and is closed once they are answered"


class _FullSlots:
    """Every question slot taken for `waits` acquire timeouts, then one frees."""

    def __init__(self, waits: int) -> None:
        self.waits = waits

    def acquire(self, timeout: float | None = None) -> bool:
        self.waits -= 1
        return self.waits < 0

    def release(self, n: int = 1) -> None:
        pass


class _NoVersions:
    """A QA service's versions where no stream is answered here (questions are routed on)."""

    exclusive = False
    get, serves, answering, run = (lambda *_: None), (lambda _: True), (lambda *_: []), (lambda _: None)


def test_questions_in_flight_are_kept_alive_while_dispatch_waits_for_a_slot(rt, redis_url, tmp_path):
    """With every slot taken (max_in_flight questions answered or waiting for the GPU), the main
    loop waits in `_dispatch` for one to free, and only there: it no longer reached the step that
    keeps the questions in flight fresh, so one in flight longer than `claim_idle_ms` looked
    abandoned and was claimed (answered twice by a peer, a delivery counted each time)."""
    from common import redisio
    from common.wire.search_request import checked_search, encode_search
    from qa_worker.config import QAConfig
    from qa_worker.service import QAService

    r = redis.Redis.from_url(redis_url)
    cfg = QAConfig(redis_url=redis_url, streams=("cam",), consumer="qa1", block_ms=50, claim_idle_ms=1000)
    cfg = dataclasses.replace(cfg, framelog_dir=str(tmp_path), decode_processes=1)  # it answers searches itself
    svc = QAService(cfg, rt, r, _NoVersions())
    queue = keys.questions("cam")
    redisio.ensure_group(r, queue, keys.QA_GROUP)
    r.xadd(queue, {"id": "slow"})
    ((_, [(slow, _)]),) = r.xreadgroup(keys.QA_GROUP, "qa1", {queue: ">"})
    svc.in_flight.add((queue, slow.decode()))  # being answered, slowly
    time.sleep(0.5)  # idle since its delivery
    svc.slots = _FullSlots(waits=1)
    redisio.ensure_group(r, keys.QUESTIONS, keys.QA_GROUP)
    fields = {k.encode(): v.encode() for k, v in encode_search(checked_search("red van")).items()}
    search = (keys.QUESTIONS, r.xadd(keys.QUESTIONS, fields).decode(), fields)
    svc._dispatch([search])  # waits for a slot once, then hands the search on
    (entry,) = r.xpending_range(queue, keys.QA_GROUP, "-", "+", 10)
    svc.questions_pool.shutdown(wait=True)
    svc.decoder.close()
    assert entry["time_since_delivered"] < 500, "kept alive while the dispatch waited"


@pytest.mark.parametrize("field, value", [("t", 5), ("t", None), ("seqs", None), ("seqs", 7)])
def test_a_malformed_features_entry_is_refused_not_a_recorder_crash(tmp_path, redis_url, field, value):
    """A features entry whose `t` or `seqs` is not a list raised TypeError out of `decode_features`
    (its contract: SchemaError naming the field), past `Indexes.add`, which refuses SchemaError
    only, and out of the recorder's step: the recorder died, and again at every start on the same
    pending entry, so no camera's frames were logged any more."""
    import msgpack

    from common.framelog import FrameLog
    from common.wire.feature_record import decode_features
    from common.wire.schemas import SCHEMA_VERSION, SchemaError
    from recorder.index import Indexes

    m = {"v": SCHEMA_VERSION, "t": [0.0, 1.0], "seqs": [0, 3], "frames": 4, "model": "m", "layers": [1]}
    m |= {"vec": b"\x00\x3c", field: value}
    fields = {b"m": msgpack.packb(m, use_bin_type=True)}
    with pytest.raises(SchemaError, match=field):
        decode_features(fields)
    r = redis.Redis.from_url(redis_url)
    indexes = Indexes(r, r, FrameLog(str(tmp_path)), ["cam"])
    indexes.add("cam", "1-0", fields)  # refused, acked with the next save
    assert indexes.unacked["cam"] == ["1-0"] and indexes.index_of("cam") is None


def test_a_quiet_encoder_looks_for_free_streams_every_free_check_s(rt, redis_url):
    """A dead worker's streams are taken within `lease_ms` + FREE_CHECK_S (README, `lease_ms`), by
    a worker that looks for free streams between its reads. One with no stream (or only quiet
    ones) waited `block_ms` (1 s by default) in each read, 5 times FREE_CHECK_S."""
    from encoder_worker.config import EncoderConfig
    from encoder_worker.service import FREE_CHECK_S, EncoderService

    cfg = EncoderConfig(redis_url=redis_url, streams=("cam",), consumer="enc", block_ms=1000)
    svc = EncoderService(cfg, rt, redis.Redis.from_url(redis_url), MemoryStore())
    waits: list[int | None] = []
    svc.reader.read = lambda streams=None, block_ms=None: waits.append(block_ms) or []
    svc.leases["cam"].acquire = lambda: False  # another worker holds it: nothing to open
    try:
        svc.step()
    finally:
        svc.writer.close()
        svc.decoder.close()
        svc.restorer.close()
    assert waits and all(w is not None and w <= FREE_CHECK_S * 1000 for w in waits), waits


def test_a_stream_that_fails_to_open_fails_alone(rt, redis_url, monkeypatch):
    """Anything a stream's open task raises but an outage (a restore the GPU loop refused, say) is
    that stream's: an `open_failed` event, its lease left to run out (then tried again), the worker
    and its other streams go on. Before, `_collect` re-raised it in the main loop: the worker
    exited, and so did every worker that took the stream next."""
    from encoder_worker import service as encoder_service
    from encoder_worker.config import EncoderConfig
    from tests.test_persistence import events, run_until, stop

    real = encoder_service.open_stream

    def open_stream(rt, r, writer, cfg, name, *args, **kw):
        if name == "bad":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(rt, r, writer, cfg, name, *args, **kw)

    monkeypatch.setattr(encoder_service, "open_stream", open_stream)
    r = redis.Redis.from_url(redis_url)
    for cam in ("bad", "good"):
        r.hset(keys.meta(cam), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    cfg = EncoderConfig(redis_url=redis_url, streams=("bad", "good"), consumer="enc", chunk_frames=2, block_ms=50)
    svc = encoder_service.EncoderService(cfg, rt, r, MemoryStore())

    def done() -> bool:  # the bad one's task collected too
        return "good" in svc.owned and bool(events(r, "bad", b"open_failed")) and "bad" not in svc.tasks

    run_until(svc, done, "good open, bad refused")
    (failed,) = events(r, "bad", b"open_failed")
    assert b"illegal memory access" in failed[b"error"]
    assert "bad" not in svc.held(), "its lease is no longer renewed: it runs out, and the stream is tried again"
    stop(svc, r)


def test_a_stream_described_with_a_grid_over_the_frame_limit_fails_alone_with_an_event(rt, redis_url):
    """A stream's description (its meta hash) holding a grid over the frame limit, forged or
    damaged: that stream is not opened, an `open_failed` event says why, and the worker's other
    stream is encoded. It was opened on that grid, which no frame off the wire can have."""
    from encoder_worker import service as encoder_service
    from encoder_worker.config import EncoderConfig
    from tests.test_persistence import encoded, events, push, run_until, stop

    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("bad"), mapping={"fps": 2, "height": 4200, "width": 4200, "live": 0})
    r.hset(keys.meta("good"), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    cfg = EncoderConfig(redis_url=redis_url, streams=("bad", "good"), consumer="enc", chunk_frames=2, block_ms=50)
    svc = encoder_service.EncoderService(cfg, rt, r, MemoryStore())
    push(r, "good", range(4))
    run_until(
        svc, lambda: encoded(r, "good", 3) and bool(events(r, "bad", b"open_failed")), "good encoded, bad refused"
    )
    (failed,) = events(r, "bad", b"open_failed")
    assert b"grid 4200x4200 exceeds the frame limit" in failed[b"error"], failed
    assert "bad" not in svc.owned and not events(r, "bad", b"encoder_attached")
    stop(svc, r)


def test_a_bad_description_is_said_in_one_line_once_a_minute_while_another_stream_encodes(rt, redis_url, monkeypatch):
    """A stream whose description does not decode fails its open again every lease period; for
    ~12 s of that (6 tries at a 2 s lease) it is said once, an event and a log line without a
    traceback (it was both, with a traceback, every try), the status still shows it, and the
    worker's other stream encodes all the while. An unexpected failure keeps its traceback."""
    from structlog.testing import capture_logs

    from common import stream_status
    from encoder_worker import service as encoder_service
    from encoder_worker.config import EncoderConfig
    from tests.test_persistence import encoded, events, push, stop

    real, tries = encoder_service.open_stream, []

    def open_stream(rt, r, writer, cfg, name, *args, **kw):
        tries.append(name)  # counted, then opened as ever
        return real(rt, r, writer, cfg, name, *args, **kw)

    monkeypatch.setattr(encoder_service, "open_stream", open_stream)
    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("bad"), mapping={"fps": 2, "height": 4200, "width": 4200, "live": 0})
    r.hset(keys.meta("good"), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    cfg = EncoderConfig(
        redis_url=redis_url, streams=("bad", "good"), consumer="enc", chunk_frames=2, block_ms=50, lease_ms=2000
    )
    svc = encoder_service.EncoderService(cfg, rt, r, MemoryStore())
    start, sent = time.monotonic(), 0
    with capture_logs() as said:
        while time.monotonic() - start < 12:
            if sent < 2 * int(time.monotonic() - start) + 2:  # two frames a second, all along
                push(r, "good", range(sent, sent + 2))
                sent += 2
            svc.step()
        deadline = time.monotonic() + 30
        while not encoded(r, "good", sent - 1) and time.monotonic() < deadline:
            svc.step()
    assert encoded(r, "good", sent - 1), "the good stream encoded every frame"
    assert tries.count("bad") >= 4, tries
    (failed,) = events(r, "bad", b"open_failed")
    assert b"grid 4200x4200 exceeds the frame limit" in failed[b"error"], failed
    (line,) = [e for e in said if e.get("stream") == "bad" and e["log_level"] in ("warning", "error")]
    assert "BadDescription" in line["error"] and not line.get("exc_info"), line
    pipe = r.pipeline()
    stream_status.queue_stream(pipe, "bad")
    status = stream_status.stream_from("bad", pipe.execute(raise_on_error=False), time.time())
    assert status["error"].startswith("bad meta") and status["last_event"]["type"] == "open_failed", status
    with capture_logs() as said:  # a failure of another cause is news: said at once, with its traceback
        svc._say_open_failed("bad", RuntimeError("CUDA error: an illegal memory access was encountered"))
    (line,) = said
    assert line["exc_info"] is True and "illegal memory access" in line["error"], line
    assert len(events(r, "bad", b"open_failed")) == 2
    stop(svc, r)


def _refusing_worker(redis_url: str, params: list[str | None]) -> threading.Thread:
    """A worker for stream "ghost" that refuses each question in turn, naming `params[n]` the n-th."""
    from common.wire.schemas import FinalAnswer, encode_final
    from tests.pipeline import wait_for

    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("ghost"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})

    def worker() -> None:
        for n, param in enumerate(params):
            qid = wait_for(lambda n=n: (q := r.xrange(keys.QUESTIONS)) and len(q) > n and q[n][1][b"id"], 10, "q")
            final = FinalAnswer(id=qid.decode(), stream="ghost", error="refused", param=param)
            r.xadd(keys.answer(qid.decode()), encode_final(final))

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    return thread


def _params_of_refusals(redis_url: str, named_by_worker: list[str | None], refusal) -> list[str | None]:
    """The `param` of each refusal an API client gets while the worker names ``named_by_worker[n]``
    in the n-th; ``refusal(client)`` makes one request and returns its error object."""
    import asyncio

    import httpx

    from api.app import create_app
    from api.config import ApiConfig

    thread = _refusing_worker(redis_url, named_by_worker)

    async def ask() -> list[str | None]:
        named = []
        app = create_app(ApiConfig(redis_url=redis_url, answer_timeout_s=20))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            for _ in named_by_worker:
                error = await refusal(client)
                assert error["message"] == "refused", error
                named.append(error["param"])
        return named

    named = asyncio.run(ask())
    thread.join(10)
    return named


def test_a_refused_chat_question_names_the_same_field_streamed_or_not(redis_url):
    """A worker's refusal naming since/until/scope: the OpenAI endpoint's 422 names that field,
    and so does its streamed error chunk (which named "messages" whatever the worker said); the
    question is the messages; a refusal naming no field names none (it named "messages": a client
    fixing its messages for a span the frames log lacks, say)."""
    from tests.test_api import _parse_sse

    named_by_worker = ["until", "scope", None, "question", "at"]
    streamed = iter([False] * len(named_by_worker) + [True] * len(named_by_worker))

    async def refusal(client) -> dict:
        stream = next(streamed)
        body = {"model": "ghost", "messages": [{"role": "user", "content": "x"}], "stream": stream}
        response = await client.post("/v1/chat/completions", json=body)
        if stream:
            (error,) = [d["error"] for _, d in _parse_sse(response.text) if isinstance(d, dict) and "error" in d]
            return error
        assert response.status_code == 422, response.text
        return response.json()["error"]

    named = _params_of_refusals(redis_url, named_by_worker * 2, refusal)  # not streamed, then streamed
    assert named == ["until", "scope", None, "messages", None] * 2


def test_a_refused_native_question_names_the_field_the_worker_named_or_none(redis_url):
    """POST /api/streams/{name}/ask refused by the worker: the 422's param is the field the worker
    named (by this request's name for it), and null where it named none or one this request cannot
    send. It said "question" whenever the worker named none."""

    async def refusal(client) -> dict:
        response = await client.post("/api/streams/ghost/ask", json={"question": "x", "stream": False})
        assert response.status_code == 422, response.text
        return response.json()["error"]

    named = _params_of_refusals(redis_url, ["until", "scope", None, "question", "at", "id"], refusal)
    assert named == ["until", "scope", None, "question", "at", None]


def _finishes(fn, timeout_s: float = 30.0) -> list:
    """``fn()`` run in a thread: what it returned or raised, once it has, within ``timeout_s`` (a
    thread still waiting then is the failure: its work would have waited forever)."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{fn} still waits {timeout_s} s on"
    return out


def test_work_given_to_a_stopped_scheduler_fails_instead_of_waiting_forever():
    """`call` after `stop()` queued its task for a loop that had ended; `submit` looked at the
    flag outside the lock, so work queued between that look and the loop's last sweep waited
    forever. Both now fail with the scheduler's error; a submit racing with stop never hangs."""
    from concurrent.futures import Future

    from common.engine.scheduler import STOPPED, SchedulePolicy, Scheduler
    from tests.test_schedule_policy import Busy

    stopped = Scheduler(SchedulePolicy()).start()
    stopped.stop()
    (error,) = _finishes(lambda: stopped.call(lambda: "ran"))
    assert isinstance(error, RuntimeError) and str(error) == STOPPED
    late = stopped.submit(Busy("cam", []))
    assert isinstance(late.exception(timeout=0), RuntimeError), "failed at once"

    racing = Scheduler(SchedulePolicy())
    submitter: list = []

    class StopsAsSubmitLooks(threading.Event):
        """The submitter's look at the flag: stop() runs to its end right after it (as far as the
        lock lets it), the window in which the work used to be queued past the loop's last sweep."""

        def is_set(self) -> bool:
            seen = super().is_set()
            if submitter and threading.current_thread() is submitter[0]:
                submitter.clear()
                stopping = threading.Thread(target=racing.stop, daemon=True)
                stopping.start()
                stopping.join(1.0)  # stop() waits for the lock while the submit holds it
            return seen

    racing._stop = StopsAsSubmitLooks()
    racing.start()

    def submit() -> Future:
        submitter.append(threading.current_thread())
        return racing.submit(Busy("cam", []))

    (future,) = _finishes(submit)
    error = future.exception(timeout=30)  # run or failed, done either way (a TimeoutError: it waited on)
    assert error is None or str(error) == STOPPED, error


def test_a_lease_renewal_that_raises_is_logged_and_the_others_are_still_renewed(rt, redis_url):
    """The keeper thread renewing every held lease died on anything but an outage, silently:
    after it every lease lapsed and the streams moved to other workers for no reason anyone could
    see. A stream whose renewal raises once is logged (its stream named), and the keeper goes on
    renewing it and the others."""
    import structlog

    from encoder_worker.config import EncoderConfig
    from encoder_worker.service import EncoderService

    cfg = EncoderConfig(redis_url=redis_url, streams=("bad", "good"), consumer="enc", block_ms=50)
    svc = EncoderService(cfg, rt, redis.Redis.from_url(redis_url), MemoryStore())
    svc._lease_check_s = 0.01
    svc.held = lambda: ["bad", "good"]
    renewed = {"bad": 0, "good": 0}
    raised = threading.Event()

    def renewing(name: str):
        renew = svc.leases[name].renew

        def counted() -> bool:
            renewed[name] += 1
            if name == "bad" and not raised.is_set():
                raised.set()
                raise redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
            return renew()

        return counted

    for name in renewed:
        svc.leases[name].acquire()
        svc.leases[name].renew = renewing(name)
    done = threading.Event()
    keeper = threading.Thread(target=svc._renew_until, args=(done,), daemon=True)
    try:
        with structlog.testing.capture_logs() as said:
            keeper.start()
            deadline = time.monotonic() + 30
            while min(renewed.values()) < 3 and keeper.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert keeper.is_alive(), "the keeper died"
            done.set()
            keeper.join(10)
    finally:
        svc.writer.close()
        svc.decoder.close()
        svc.restorer.close()
    assert min(renewed.values()) >= 3, ("renewed after the error, every stream", renewed)
    (error,) = [e for e in said if e["log_level"] == "error"]
    assert error["stream"] == "bad" and "WRONGTYPE" in error["error"], error


def test_a_qa_worker_reopens_the_questions_queue_the_largest_id_shut(rt, redis_url, tmp_path):
    """One XADD of the largest id (2^64-1-2^64-1) to svqa:questions made every later question's
    XADD fail ("exhausted the last possible ID"), every client's, until an admin deleted the queue.
    The QA worker routes the forged entry like any other, then reopens the queue."""
    from qa_worker.client import Client
    from qa_worker.config import QAConfig
    from qa_worker.service import QAService

    r = redis.Redis.from_url(redis_url)
    r.delete(keys.QUESTIONS)
    cfg = QAConfig(redis_url=redis_url, streams=("cam",), consumer="qa1", block_ms=20, claim_idle_ms=200)
    svc = QAService(cfg, rt, r, _NoVersions())
    svc.step()  # its groups made
    r.xadd(keys.QUESTIONS, {"id": "forged"}, id=f"{2**64 - 1}-{2**64 - 1}")
    with pytest.raises(redis.ResponseError, match="exhausted"):
        Client(r).submit("cam", "what happened?")
    deadline = time.monotonic() + 30
    while r.xinfo_stream(keys.QUESTIONS)["last-generated-id"].startswith(b"18446744073709551615"):
        assert time.monotonic() < deadline, "the queue stayed shut"
        svc.step()
        time.sleep(0.05)
    assert Client(r).submit("cam", "what happened?")
    assert not r.xpending(keys.QUESTIONS, keys.QA_GROUP)["pending"]  # the forged one was routed, not left
