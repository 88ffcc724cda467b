"""Questions beyond what the GPU can start wait in order, and their wait is visible: their place and
estimated wait in the reply stream (qa_worker/admission.py), the API's 429 past
`max_queue_wait_s`, the CLI's "queued:" line. Real redis-server, tiny-random, a GPU scheduler
driven by hand so that questions wait exactly as long as the test says.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import redis

from api.app import create_app
from api.config import ApiConfig
from common import metrics
from common.engine.answer import ask
from common.engine.grid import Grid, StreamSpec
from common.engine.model import load_model
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.scheduler import SchedulePolicy, Scheduler
from common.engine.stream_engine import StreamEngine
from common.engine.work import InlineExecutor
from common.wire import keys
from common.wire.admission import AdmissionEntry, estimated_wait_s
from common.wire.schemas import AnswerDelta, FinalAnswer, decode_answer, encode_delta, encode_final, encode_queued
from qa_worker.admission import GONE_S, RATE_WINDOW_S, Admission, forget_gone
from qa_worker.answering import Answerer
from tests.pipeline import wait_for
from tests.test_api import _parse_sse

CAM = "cam"
QUESTIONS = ["What is happening?", "Is anything red?", "Describe the scene.", "Who is there?", "Why?"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_positions_count_the_questions_taken_before_that_have_not_started():
    admission = Admission()
    a, b, c = admission.take(), admission.take(), admission.take()
    assert [admission.position(t) for t in (a, b, c)] == [1, 2, 3] and admission.queued == 3
    admission.start(b)
    assert [admission.position(t) for t in (a, b, c)] == [1, None, 2]
    admission.done(a)  # failed before it started: no answer for the rate
    assert admission.position(c) == 1 and admission.queued == 1 and admission.rate() is None
    admission.start(c), admission.done(b), admission.done(c)
    assert admission.queued == 0


def test_the_rate_counts_answers_over_busy_time_only():
    """Answers a second while questions were open, over the last RATE_WINDOW_S of such time: an
    idle hour before a burst does not read as a slow GPU."""
    clock = Clock()
    admission = Admission(clock)
    first = admission.take()
    clock.now += 0.5
    admission.start(first)
    clock.now += 1.5
    admission.done(first)  # 1 answer in 2 s of busy time
    assert admission.rate() == pytest.approx(0.5)
    clock.now += 3600  # idle
    assert admission.rate() == pytest.approx(0.5) and admission.wait_s(3) == pytest.approx(6.0)
    for _ in range(40):  # then busy: 2 answers a second
        tickets = [admission.take(), admission.take()]
        for t in tickets:
            admission.start(t)
        clock.now += 1.0
        for t in tickets:
            admission.done(t)
    assert admission.rate() == pytest.approx(2.0, rel=0.05), "the window holds the last RATE_WINDOW_S only"
    assert RATE_WINDOW_S < 40


def test_a_new_questions_estimated_wait_is_the_best_of_the_fresh_entries():
    now = 5000.0
    entries = {
        b"busy": AdmissionEntry(queued=30, rate=2.0, at=now - 1).to_json(),
        b"quick": AdmissionEntry(queued=9, rate=5.0, at=now - 1).to_json(),
        b"gone": AdmissionEntry(queued=0, rate=100.0, at=now - 60).to_json(),  # stale: a process gone
        b"new": AdmissionEntry(queued=0, rate=None, at=now).to_json(),  # no answer yet: no estimate
        b"bad": b"{not json",
    }
    assert estimated_wait_s(entries, now=now) == pytest.approx((9 + 1) / 5.0)
    assert estimated_wait_s(entries, backlog=5, now=now) == pytest.approx((9 + 5 + 1) / 5.0)
    assert estimated_wait_s({b"new": entries[b"new"]}, now=now) is None
    assert estimated_wait_s({}, now=now) is None


def test_a_question_about_the_past_adds_its_wait_for_a_turn_at_a_history_cache(redis_url):
    """A process's history queue and turn rate (published beside its GPU queue) add to the estimate
    of a question about the past only: a live question does not wait for a history turn. An entry
    of an older worker, without them, reads as no history queue."""
    now = 5000.0
    both = AdmissionEntry(queued=3, rate=2.0, at=now, history_queued=5, history_rate=0.5).to_json()
    assert estimated_wait_s({b"qa-1": both}, backlog=1, now=now) == pytest.approx((3 + 1 + 1) / 2.0)
    past = estimated_wait_s({b"qa-1": both}, backlog=1, now=now, about_past=True)
    assert past == pytest.approx((3 + 1 + 1) / 2.0 + (5 + 1) / 0.5)
    no_turn_yet = AdmissionEntry(queued=3, rate=2.0, at=now, history_queued=5).to_json()  # no turn finished yet
    assert estimated_wait_s({b"qa-1": no_turn_yet}, now=now, about_past=True) == pytest.approx(2.0)
    only_turns = AdmissionEntry(queued=0, rate=None, at=now, history_queued=1, history_rate=1.0).to_json()
    assert estimated_wait_s({b"qa-1": only_turns}, now=now) is None
    assert estimated_wait_s({b"qa-1": only_turns}, now=now, about_past=True) == pytest.approx(2.0)
    older = json.dumps({"queued": 3, "rate": 2.0, "at": now})
    assert AdmissionEntry.from_json(older) == AdmissionEntry(3, 2.0, now, 0, None)

    r = redis.Redis.from_url(redis_url)  # what a QA process publishes: both queues
    gpu, turns = Admission(), Admission()
    gpu.take(), turns.take(), turns.take()
    gpu.publish(r, "qa-1", [CAM], turns)
    entry = AdmissionEntry.from_json(r.hget(keys.admission(CAM), "qa-1"))
    assert entry is not None and (entry.queued, entry.history_queued, entry.history_rate) == (1, 2, None)


def test_publishing_forgets_the_entries_of_processes_gone(redis_url):
    """The hash's TTL never lapses while one process writes it: entries of processes gone (a
    restart is a new name) are removed by the living, first at their first publish, and a fresh
    entry of another process stays."""
    r = redis.Redis.from_url(redis_url)
    now = time.time()
    key = keys.admission(CAM)
    r.hset(key, "gone", AdmissionEntry(queued=1, rate=1.0, at=now - GONE_S - 5).to_json())
    r.hset(key, "garbled", "not json")
    r.hset(key, "peer", AdmissionEntry(queued=2, rate=1.0, at=now - 3).to_json())
    Admission().publish(r, "qa-1", [CAM])
    assert set(r.hkeys(key)) == {b"peer", b"qa-1"}
    r.hset(key, "gone", AdmissionEntry(queued=1, rate=1.0, at=now - GONE_S - 5).to_json())
    forget_gone(r, [CAM, "quiet"], time.time())  # a stream without a hash: nothing to remove
    assert set(r.hkeys(key)) == {b"peer", b"qa-1"}


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


@pytest.fixture(scope="module")
def head(rt: Runtime):
    spec = StreamSpec(CAM, 2, Grid(56, 56), 2)
    engine = StreamEngine(rt, spec)
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(4)]
    engine.append(frames, [0.0, 0.5, 1.0, 1.5], [0, 1, 2, 3])
    return engine.head


def _replies(r: redis.Redis, qid: str) -> list[AnswerDelta | FinalAnswer]:
    return [decode_answer(f) for _, f in r.xrange(keys.answer(qid))]


def _places(replies: list) -> list[int]:
    return [d.position for d in replies if isinstance(d, AnswerDelta) and d.position is not None]


def test_questions_waiting_for_the_gpu_are_told_their_place_in_order_then_answered_as_alone(rt, head, redis_url):
    """A worker's questions wait while the GPU starts none (the scheduler is stepped by hand, two
    questions at most at once): each one's reply stream begins with its place, 1 to 4 in the order
    taken, and an estimated wait that grows with it; places move up as questions ahead start; the
    answers are those each question gets alone."""
    r = redis.Redis.from_url(redis_url)
    params = GenerationParams(max_tokens=3)
    alone = {q: ask(rt, head, q, params).text for q in QUESTIONS}
    scheduler = Scheduler(SchedulePolicy(max_batch=2))  # never started: it steps when the test says
    rt.executor = scheduler
    admission = Admission()
    answerer = Answerer(rt, r, lambda s, at: head, lambda s: s == CAM, consumer="qa", admission=admission)
    queued_before = metrics.QUESTIONS_QUEUED._value.get()

    def asked(question: str) -> tuple[str, threading.Thread]:
        qid = f"q{QUESTIONS.index(question)}"
        fields = {b"id": qid.encode(), b"stream": CAM.encode(), b"question": question.encode(), b"max_tokens": b"3"}
        eid = r.xadd(keys.QUESTIONS, fields).decode()
        thread = threading.Thread(target=answerer.handle, args=(keys.QUESTIONS, eid, fields), daemon=True)
        thread.start()
        return qid, thread

    def step_until(done) -> None:
        deadline = time.monotonic() + 60
        while not done() and time.monotonic() < deadline:
            scheduler.step()
            time.sleep(0.005)
        assert done()

    try:
        first, thread = asked(QUESTIONS[0])  # one answered first: the worker measures its rate
        step_until(lambda: not thread.is_alive())
        assert admission.rate() is not None
        waiting = []
        for n, question in enumerate(QUESTIONS[1:], 1):
            waiting.append(asked(question))
            wait_for(lambda n=n: admission.queued == n, 10, "the question taken")
        for qid, _ in waiting:
            wait_for(lambda qid=qid: _places(_replies(r, qid)), 10, f"{qid} told its place")
        told = [_replies(r, qid)[0] for qid, _ in waiting]
        assert [d.position for d in told] == [1, 2, 3, 4], "in the order taken"
        assert all(d.text == "" for d in told) and [d.wait_s for d in told] == sorted(d.wait_s for d in told)
        assert told[0].wait_s > 0
        assert metrics.QUESTIONS_QUEUED._value.get() == queued_before + 4

        scheduler.step()  # two start; the other two move up, and are told so within a second
        last = waiting[-1][0]
        wait_for(lambda: _places(_replies(r, last))[-1] == 2, 10, "the last question told it moved up")
        step_until(lambda: not any(t.is_alive() for _, t in waiting))
    finally:
        rt.executor = InlineExecutor()
    for qid, _ in [(first, thread), *waiting]:
        replies = _replies(r, qid)
        final = replies[-1]
        assert isinstance(final, FinalAnswer) and final.error is None
        assert final.text == alone[QUESTIONS[int(qid[1:])]]
        places = _places(replies)
        assert places == sorted(places, reverse=True), "a place only moves up"
        text = [d for d in replies[:-1] if d.position is None]
        assert replies[: len(places)] == [d for d in replies if d not in text and d is not final], "places first"
        assert "".join(d.text for d in text) == final.text
        assert final.queue_s >= (0.2 if qid != first else 0.0)  # its wait for the GPU is in it
    assert metrics.QUESTIONS_QUEUED._value.get() == queued_before


def test_a_live_question_is_answered_from_the_head_it_starts_on_and_one_with_at_from_the_version_named(rt, redis_url):
    """A live question taken while the head is v1 holds nothing while it waits for the GPU; the
    stream moves to v2 meanwhile, and the question is answered from v2, its final saying so
    (version, time range, ranges, cache tokens) and its text that of v2 alone. One with `at` v1,
    taken at the same time, is answered from v1."""
    r = redis.Redis.from_url(redis_url)
    engine = StreamEngine(rt, StreamSpec(CAM, 2, Grid(56, 56), 2))
    rng = np.random.default_rng(5)
    frames = [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(4)]
    v1 = engine.append(frames[:2], [0.0, 0.5], [0, 1])
    v2 = engine.append(frames[2:], [1.0, 1.5], [2, 3])
    params = GenerationParams(max_tokens=3)
    alone = {v.id: ask(rt, v, QUESTIONS[0], params).text for v in (v1, v2)}
    head = {"now": v1}
    versions = {v1.id: v1, v2.id: v2}
    scheduler = Scheduler(SchedulePolicy(max_batch=2))  # never started: it steps when the test says
    rt.executor = scheduler
    admission = Admission()

    def lookup(stream: str, at: int | None):
        return head["now"] if at is None else versions.get(at)

    answerer = Answerer(rt, r, lookup, lambda s: s == CAM, consumer="qa", admission=admission)
    threads = []
    try:
        for qid, at in (("live", None), ("at", v1.id)):
            fields = {b"id": qid.encode(), b"stream": CAM.encode(), b"question": QUESTIONS[0].encode()}
            fields |= {b"max_tokens": b"3"} | ({b"at": str(at).encode()} if at is not None else {})
            eid = r.xadd(keys.QUESTIONS, fields).decode()
            threads.append(threading.Thread(target=answerer.handle, args=(keys.QUESTIONS, eid, fields), daemon=True))
            threads[-1].start()
        wait_for(lambda: admission.queued == 2, 10, "both questions taken")
        head["now"] = v2  # a chunk published while they wait
        deadline = time.monotonic() + 60
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            scheduler.step()
            time.sleep(0.005)
    finally:
        rt.executor = InlineExecutor()
    live, pinned = (_replies(r, qid)[-1] for qid in ("live", "at"))
    assert isinstance(live, FinalAnswer) and live.error is None and isinstance(pinned, FinalAnswer)
    assert (live.version, live.cache_tokens, live.t_start, live.t_end) == (v2.id, v2.tokens, 0.0, 1.5)
    assert live.text == alone[v2.id]
    assert (pinned.version, pinned.cache_tokens, pinned.t_end, pinned.text) == (v1.id, v1.tokens, 0.5, alone[v1.id])


def _api(cfg: ApiConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(cfg)), base_url="http://api", timeout=30)


def _worker_says(r: redis.Redis, queued: int, rate: float, **history: float) -> None:
    """What the QA process answering CAM publishes (its queue and rate, and its `history_queued`
    and `history_rate`), as Admission.publish does."""
    r.hset(keys.admission(CAM), "qa-1", AdmissionEntry(queued, rate, time.time(), **history).to_json())


def _answer_with_places(r: redis.Redis, places: list[tuple[int, float | None]]) -> None:
    """A worker: once a question is asked, its places as it waits, then its answer."""
    wait_for(lambda: r.xlen(keys.QUESTIONS) >= 1, 30, "a question")
    (_, fields), *_ = r.xrange(keys.QUESTIONS)
    qid = fields[b"id"].decode()
    for position, wait_s in places:
        r.xadd(keys.answer(qid), encode_queued(position, wait_s))
    r.xadd(keys.answer(qid), encode_delta("a van"))
    final = FinalAnswer(id=qid, stream=CAM, text="a van", tokens=2, total_s=0.5, queue_s=3.0)
    r.xadd(keys.answer(qid), encode_final(final))


def _refused_then_accepted(
    r: redis.Redis, cfg: ApiConfig, refuse: list[tuple[str, dict]], then, accept: dict, places: list
) -> tuple[list[httpx.Response], httpx.Response]:
    """The API's answers to the `refuse` requests ((path, body)), which queue nothing, and then,
    after `then()`, to `accept` on the ask endpoint, which a worker answers (its `places` first)."""

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with _api(cfg) as client:
            refused = [await client.post(path, json=body) for path, body in refuse]
            assert not r.exists(keys.QUESTIONS), "nothing queued"
            then()
            worker = threading.Thread(target=_answer_with_places, args=(r, places), daemon=True)
            worker.start()
            accepted = await client.post(f"/api/streams/{CAM}/ask", json=accept)
            worker.join(10)
            return refused, accepted

    return asyncio.run(run())


def _queue_full(responses: list[httpx.Response], retry_after: str, says: str) -> None:
    for response in responses:
        assert response.status_code == 429, response.text
        assert response.headers["Retry-After"] == retry_after
        error = response.json()["error"]
        assert error["code"] == "queue_full" and says in error["message"], error


ASK = f"/api/streams/{CAM}/ask"
CHAT = "/v1/chat/completions"


def test_the_api_refuses_with_429_a_question_it_could_not_start_in_time(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta(CAM), mapping={"fps": "2", "height": "56", "width": "56", "live": "1"})
    cfg = ApiConfig(redis_url=redis_url, max_queue_wait_s=10.0, answer_timeout_s=20, block_ms=100)
    _worker_says(r, queued=59, rate=2.0)  # a new question: (59 + 1) / 2 = 30 s
    chat = {"model": CAM, "messages": [{"role": "user", "content": "hi"}]}
    refused, accepted = _refused_then_accepted(
        r,
        cfg,
        [(ASK, {"question": "hi"}), (CHAT, chat)],
        lambda: _worker_says(r, queued=9, rate=2.0),  # 5 s: taken, waits, is told its place
        {"question": "hi"},
        [(3, 2.5), (1, 0.5)],
    )
    _queue_full(refused, "20", "30 s")  # 30 s estimated, 10 s allowed
    events = _parse_sse(accepted.text)
    queued = [data for event, data in events if event == "queued"]
    assert [(d["position"], d["wait_s"]) for d in queued] == [(3, 2.5), (1, 0.5)]
    assert [event for event, _ in events][-2:] == ["delta", "final"] and events[-2][1] == {"text": "a van"}


def test_the_api_refuses_a_question_about_the_past_its_history_queue_would_hold_up_not_a_live_one(redis_url):
    """The worker's GPU starts a question in 0.5 s, but 39 questions about the past wait for a turn
    at a history cache, one turn finished every 0.5 s: a new one would wait 20 s for its turn, and
    then 0.5 s for the GPU. Past max_queue_wait_s (10 s), a question with `since` or `scope:
    history` is refused with 429 (native and OpenAI endpoints), nothing queued; a live question to
    the same camera is accepted and answered."""
    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta(CAM), mapping={"fps": "2", "height": "56", "width": "56", "live": "1"})
    cfg = ApiConfig(redis_url=redis_url, max_queue_wait_s=10.0, answer_timeout_s=20, block_ms=100)
    _worker_says(r, queued=0, rate=2.0, history_queued=39, history_rate=2.0)
    chat = {"model": CAM, "messages": [{"role": "user", "content": "hi"}], "since": "10m"}
    past = [(ASK, {"question": "hi", "since": "10m"}), (ASK, {"question": "hi", "scope": "history"}), (CHAT, chat)]
    refused, accepted = _refused_then_accepted(r, cfg, past, lambda: None, {"question": "hi", "stream": False}, [])
    _queue_full(refused, "11", "about the past")  # 20.5 s estimated, 10 s allowed
    assert accepted.status_code == 200 and accepted.json()["text"] == "a van", accepted.text


def test_old_readers_see_a_place_as_empty_text():
    """A client that knows nothing of places reads a delta with no text: its answer is unchanged."""
    fields = {k.encode(): v.encode() for k, v in encode_queued(4, 12.5, attempt=2).items()}
    delta = decode_answer(fields)
    assert delta == AnswerDelta("", attempt=2, position=4, wait_s=12.5)
    assert decode_answer({k: v for k, v in fields.items() if k not in (b"position", b"wait_s")}) == AnswerDelta("", 2)


def test_streamvqa_ask_shows_the_place_while_it_waits(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta(CAM), mapping={"fps": "2", "height": "56", "width": "56", "live": "1"})
    worker = threading.Thread(target=_answer_with_places, args=(r, [(2, 14.4), (1, None)]), daemon=True)
    worker.start()
    out = subprocess.run(
        [sys.executable, "-m", "apps.cli", "ask", "--stream", CAM, "--redis-url", redis_url, "hi"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    worker.join(10)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "a van\n"
    lines = out.stderr.splitlines()
    assert lines[:2] == ["queued: position 2, ~14 s", "queued: position 1"], out.stderr
    assert lines[2].startswith("waited 3.00 s in the queue")
