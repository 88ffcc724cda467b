"""Question routing and stream placement, piece by piece against a real redis-server.

Forwarding from `svqa:questions` to a stream's own queue happens once per question id, however
often it is retried; questions left behind by a departed owner go to the next one; the placement
rule spreads streams over workers. The multi-process version is tests/test_placement.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis
from structlog.testing import capture_logs

from apps.status import collect, render
from common import redisio
from common.engine.model import load_model
from common.engine.runtime import Runtime
from common.lease import Lease, holder_name
from common.placement import Placement, WorkerLoad
from common.segment_store import MemoryStore
from common.wire import keys
from common.wire.schemas import FinalAnswer, decode_answer
from encoder_worker.config import EncoderConfig
from encoder_worker.service import EncoderService
from qa_worker.answering import Answerer
from qa_worker.client import Client
from qa_worker.routing import ID_IN_USE, Router, forward, requeue, take_over

CAM = "cam1"


@pytest.fixture
def r(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


def queued(r: redis.Redis, cam: str = CAM) -> list[dict[bytes, bytes]]:
    return [f for _, f in r.xrange(keys.questions(cam))]


def test_the_same_question_forwarded_twice_is_queued_once(r):
    fields = {b"stream": CAM.encode(), b"question": b"what now?", b"max_tokens": b"4"}
    assert forward(r, CAM, "1700000000000-0", fields, ttl_s=60, asked="1700000000000-0")
    assert not forward(r, CAM, "1700000000000-0", fields, ttl_s=60, asked="1700000000000-0")  # the marker stops it
    assert forward(r, CAM, "other-question", fields, ttl_s=60, asked="1700000000001-0")
    first, second = queued(r)
    # the id and when it was asked travel explicitly: the entry id is new
    assert first == fields | {b"id": b"1700000000000-0", b"asked": b"1700000000000-0"}
    assert second[b"id"] == b"other-question"
    assert 0 < r.pttl(keys.once(keys.questions(CAM), "other-question")) <= 60_000


def test_router_forwards_once_across_a_redelivery_and_replies_to_bad_questions(r, rt):
    known = {CAM, "cam2"}.__contains__
    answerer = Answerer(rt, r, lambda s, at: None, known, consumer="a")
    router = Router(r, known, answerer.handle, answerer.reject, consumer="a", marker_ttl_s=60, max_deliveries=3)
    r.set(keys.head(CAM), b"a manifest")  # CAM has been started; cam2 never was
    redisio.ensure_group(r, keys.QUESTIONS, keys.QA_GROUP)
    good_eid = r.xadd(keys.QUESTIONS, {"id": "good", "stream": CAM, "question": "what now?"}).decode()
    r.xadd(keys.QUESTIONS, {"id": "unknown", "stream": "nope", "question": "hi"})
    r.xadd(keys.QUESTIONS, {"id": "unstarted", "stream": "cam2", "question": "hi"})
    r.xadd(keys.QUESTIONS, {"id": "bad", "stream": CAM, "question": "hi", "max_tokens": "many"})
    no_id = r.xadd(keys.QUESTIONS, {"stream": CAM, "question": "whose answer?"}).decode()
    entries = redisio.GroupReader(r, [keys.QUESTIONS], keys.QA_GROUP, "a", block_ms=100).read()
    router.route([e for e in entries if e[1] == good_eid])
    # Forwarder "a" dies before acking (simulated: its ack undone by a fresh delivery): "b" reclaims
    # the entry and forwards it again.
    r.xadd(keys.QUESTIONS, {"id": "later", "stream": CAM, "question": "later"})
    r.xgroup_setid(keys.QUESTIONS, keys.QA_GROUP, "0")
    again = redisio.GroupReader(r, [keys.QUESTIONS], keys.QA_GROUP, "b", block_ms=100).read()
    assert good_eid in [e[1] for e in again]
    router.route(again)
    assert [f[b"id"].decode() for f in queued(r)].count("good") == 1
    assert [f[b"question"] for f in queued(r)] == [b"what now?", b"later"]
    assert r.xpending(keys.QUESTIONS, keys.QA_GROUP)["pending"] == 0, "every shared entry acked"
    assert not queued(r, "cam2"), "nothing to wait for: answered at once"
    # no id: refused, the refusal where the asker can find it (a stream entry id is no secret)
    refused = {"unknown": "unknown stream", "unstarted": "no frames yet", "bad": "max_tokens", no_id: "id: missing"}
    for qid, word in refused.items():
        (final,) = [decode_answer(f) for _, f in r.xrange(keys.answer(qid))]
        assert isinstance(final, FinalAnswer) and word in final.error


def test_a_reused_question_id_is_not_answered_and_its_asker_is_told(r, rt):
    """Two questions with one id (on one stream, or on two): the second was dropped by the
    forwarding marker, or answered into the first one's answer stream, and its asker read the
    other question's answer, about another camera even, as its own."""
    known = {CAM, "cam2"}.__contains__
    answerer = Answerer(rt, r, lambda s, at: None, known, consumer="a")
    router = Router(r, known, answerer.handle, answerer.reject, consumer="a", marker_ttl_s=60, max_deliveries=3)
    for cam in (CAM, "cam2"):
        r.set(keys.head(cam), b"a manifest")
    redisio.ensure_group(r, keys.QUESTIONS, keys.QA_GROUP)
    reader = redisio.GroupReader(r, [keys.QUESTIONS], keys.QA_GROUP, "a", block_ms=100)
    first = r.xadd(keys.QUESTIONS, {"id": "dup", "stream": CAM, "question": "first"}).decode()
    router.route(reader.read())
    answerer.handle_entries(redisio.GroupReader(r, [keys.questions(CAM)], keys.QA_GROUP, "a", block_ms=100).read())
    (theirs,) = [decode_answer(f) for _, f in r.xrange(keys.answer("dup"))]
    assert theirs.asked == first and theirs.stream == CAM

    client = Client(r)
    for cam in (CAM, "cam2"):  # the first's final is there already: each asker reads it at once
        mine = client.ask(cam, "second, another asker", id="dup", timeout_s=5)
        assert mine.param == "id" and "in use by another question" in mine.error and mine.stream == cam
    router.route(reader.read())
    assert [f[b"question"] for f in queued(r)] == [b"first"] and not queued(r, "cam2"), "neither is answered"
    assert [decode_answer(f) for _, f in r.xrange(keys.answer("dup"))] == [theirs], "the first's answer is kept"
    dead = [f for _, f in r.xrange(keys.DEAD_LETTER)]
    assert [f[b"f:question"] for f in dead] == [b"second, another asker"] * 2
    assert all(f[b"reason"].decode() == ID_IN_USE for f in dead)
    assert r.xpending(keys.QUESTIONS, keys.QA_GROUP)["pending"] == 0


def test_a_final_answer_counts_the_queue_from_the_asking_and_names_the_field_it_refuses(r, rt):
    """Asked 5 s before it was forwarded and taken: the final's queue_s counts from the asking
    (its entry id in svqa:questions), not from the forwarding; elapsed_s includes it. A version
    `at` that is not held is refused naming param "at" (the API's 422 named "question")."""
    known = {CAM}.__contains__
    answerer = Answerer(rt, r, lambda s, at: None, known, consumer="a")
    router = Router(r, known, answerer.handle, answerer.reject, consumer="a", marker_ttl_s=60, max_deliveries=3)
    r.set(keys.head(CAM), b"a manifest")
    redisio.ensure_group(r, keys.QUESTIONS, keys.QA_GROUP)
    asked_ms = int(time.time() * 1000) - 5000
    qid = "q-asked-earlier"
    r.xadd(keys.QUESTIONS, {"id": qid, "stream": CAM, "question": "then?", "at": "3"}, id=f"{asked_ms}-0")
    router.route(redisio.GroupReader(r, [keys.QUESTIONS], keys.QA_GROUP, "a", block_ms=100).read())
    answerer.handle_entries(redisio.GroupReader(r, [keys.questions(CAM)], keys.QA_GROUP, "a", block_ms=100).read())
    (final,) = [decode_answer(f) for _, f in r.xrange(keys.answer(qid))]
    assert isinstance(final, FinalAnswer) and final.param == "at" and "version 3" in final.error
    assert final.queue_s >= 4.9 and final.elapsed_s >= final.queue_s, final


def test_a_question_id_stays_claimed_as_long_as_its_answer_is_kept(r, rt):
    """A question's own `reply_ttl` longer than the server's `reply_ttl_s` (here 3600 s against
    60): its id's claim, set for `reply_ttl_s` when it was routed, ran out 59 minutes before its
    answer stream did, and another question with the id was answered there. The claim now lives
    as long as the answer it guards, a short `reply_ttl` alike."""
    known = {CAM}.__contains__
    answerer = Answerer(rt, r, lambda s, at: None, known, consumer="a", reply_ttl_s=60, max_reply_ttl_s=86_400)
    router = Router(r, known, answerer.handle, answerer.reject, consumer="a", marker_ttl_s=60, max_deliveries=3)
    r.set(keys.head(CAM), b"a manifest")
    redisio.ensure_group(r, keys.QUESTIONS, keys.QA_GROUP)
    for qid, reply_ttl in (("kept-long", 3600), ("kept-short", 20)):
        r.xadd(keys.QUESTIONS, {"id": qid, "stream": CAM, "question": "then?", "at": "3", "reply_ttl": str(reply_ttl)})
    router.route(redisio.GroupReader(r, [keys.QUESTIONS], keys.QA_GROUP, "a", block_ms=100).read())
    answerer.handle_entries(redisio.GroupReader(r, [keys.questions(CAM)], keys.QA_GROUP, "a", block_ms=100).read())
    for qid, reply_ttl in (("kept-long", 3600), ("kept-short", 20)):
        answer, claim = r.ttl(keys.answer(qid)), r.ttl(keys.answer_owner(qid))
        assert reply_ttl - 5 <= answer <= claim <= reply_ttl, (qid, answer, claim)


def test_a_question_of_a_stream_that_moved_on_goes_back_to_its_queue_once(r):
    forward(r, CAM, "q1", {b"stream": CAM.encode(), b"question": b"hi"}, ttl_s=60)
    reader = redisio.GroupReader(r, [keys.questions(CAM)], keys.QA_GROUP, "old", block_ms=100)
    (entry,) = reader.read()
    take_over(r, keys.questions(CAM), "new")  # the new owner claimed it first: not ours to give back
    assert not requeue(r, entry, "old")
    take_over(r, keys.questions(CAM), "old")
    assert requeue(r, entry, "old")
    assert not requeue(r, entry, "old"), "already given back"
    assert [f[b"id"] for f in queued(r)] == [b"q1"], "moved to the end of the queue, not copied"
    (again,) = redisio.GroupReader(r, [keys.questions(CAM)], keys.QA_GROUP, "new", block_ms=100).read()
    assert again[2][b"id"] == b"q1"


def test_take_over_claims_every_pending_question_without_counting_a_delivery(r):
    for i in range(1500):  # more than one page
        forward(r, CAM, f"q{i}", {b"stream": CAM.encode(), b"question": b"hi"}, ttl_s=60)
    redisio.ensure_group(r, keys.questions(CAM), keys.QA_GROUP)
    r.xreadgroup(keys.QA_GROUP, "dead", {keys.questions(CAM): ">"}, count=2000)
    take_over(r, keys.questions(CAM), "owner")
    summary = r.xpending(keys.questions(CAM), keys.QA_GROUP)
    assert summary["pending"] == 1500 and [c["name"] for c in summary["consumers"]] == [b"owner"]
    pending = r.xpending_range(keys.questions(CAM), keys.QA_GROUP, "-", "+", 10)
    assert {p["times_delivered"] for p in pending} == {1}


def load(worker: str, n: int, capacity: int | None = None) -> WorkerLoad:
    return WorkerLoad(worker, tuple(f"cam{i}" for i in range(n)), capacity)


@pytest.mark.parametrize(
    ("mine", "capacity", "others", "takes", "hands_off"),
    [
        (0, None, [], True, False),  # alone: takes everything
        (3, None, [], True, False),
        (0, None, [load("b", 3)], True, False),  # a newcomer goes first ...
        (3, None, [load("b", 0)], False, True),  # ... and the loaded one hands off
        (2, None, [load("b", 1)], False, False),  # floor/ceil of the fair share: stable
        (2, None, [load("b", 2), load("c", 0)], False, True),  # 4 streams, 3 workers: 2,2,0 is not stable
        (1, None, [load("b", 1)], True, False),  # a tie: the lease decides
        (2, 2, [], False, False),  # at capacity
        (3, None, [load("b", 1, capacity=1)], True, False),  # a full worker is not a candidate
    ],
)
def test_placement_rule(mine, capacity, others, takes, hands_off):
    me = Placement(None, "a", capacity, 1000)  # type: ignore[arg-type]  # the rule needs no Redis
    assert (mine < me.share(mine, 1, others)) is takes  # one stream free: does it take it?
    assert Placement.should_hand_off(mine, others) is hands_off


def test_many_free_streams_are_shared_in_one_round():
    """64 cameras appear at once before two workers: each takes its half, not one stream a beat."""
    a, b = Placement(None, "a", None, 1000), Placement(None, "b", 20, 1000)  # type: ignore[arg-type]
    assert a.share(0, 64, [load("b", 0, capacity=20)]) == 32
    assert b.share(0, 64, [load("a", 0)]) == 20  # capped by its capacity
    assert a.share(32, 10, [load("b", 20, capacity=20)]) == 42  # a full worker takes no part


def test_a_dead_workers_streams_are_taken_in_one_round_while_its_heartbeat_lingers():
    """Its leases ran out a few ms before its heartbeat: the survivor takes all its streams at once."""
    survivor = Placement(None, "a", None, 1000)  # type: ignore[arg-type]
    dead, newcomer = load("b", 32), WorkerLoad("c", (), None)
    free = [f"cam{i}" for i in range(32)]
    assert survivor.share(32, 32, [dead]) == 48, "counted as alive, it would keep half of them"
    assert survivor.share(32, 32, Placement.holding([dead], free)) == 64
    assert Placement.holding([dead, newcomer], free[:31]) == [dead, newcomer], "a live one keeps its share"
    assert Placement.holding([newcomer], free) == [newcomer], "one that holds nothing yet is alive"


def test_two_live_processes_under_one_name_are_flagged_and_status_reads_holders_from_leases(r):
    """A worker holds three streams; a second process is started under its name by mistake and
    holds none. Their heartbeats overwrite each other: status said the name held nothing. Now it
    reads the leases, flags the name, and each process says so once (not at every beat)."""
    cams = ["cam1", "cam2", "cam3"]
    busy, idle = Placement(r, "w-x", None, 60_000), Placement(r, "w-x", None, 60_000)
    for cam in cams:
        r.xadd(keys.events(cam), {"type": "connected"})  # a stream status lists
        assert Lease(r, cam, busy.life, 60_000).acquire()
    with capture_logs() as logs:
        for _ in range(3):
            busy.beat(cams)
            idle.beat([])  # the heartbeat says "w-x holds nothing" last
    said = [e for e in logs if "another live process uses consumer name w-x" in e["event"]]
    assert len(said) == 2 and {e["life"] for e in said} == {busy.life, idle.life}, said
    (worker,) = collect(r)["workers"]
    assert worker == {"worker": "w-x", "streams": cams, "load": 3, "capacity": None, "namesake": True}
    assert "ANOTHER LIVE PROCESS USES THIS NAME" in render(collect(r))


def test_a_restarted_worker_is_no_namesake_of_its_dead_self(r):
    """Its predecessor's heartbeat, still within its TTL, is found at the first beat only."""
    Placement(r, "w-y", None, 60_000).beat(["cam1"])  # then killed: its heartbeat stays a while
    restarted = Placement(r, "w-y", None, 60_000)
    with capture_logs() as logs:
        restarted.beat([])
        restarted.beat([])
    assert restarted.namesake_at is None and not [e for e in logs if e["log_level"] == "error"]
    assert [w["namesake"] for w in collect(r)["workers"]] == [False]


def test_heartbeats_show_live_workers_and_forget_dead_ones(r):
    # "a" beats for 1.5 s: long enough to be seen alive by the next call on a loaded machine
    a, b = Placement(r, "a", None, 1500), Placement(r, "b", 2, 60_000)
    a.beat(["cam1", "cam2"])
    assert b.beat(["cam3"]) == [WorkerLoad("a", ("cam1", "cam2"), None)]
    assert a.beat(["cam1"]) == [WorkerLoad("b", ("cam3",), 2)]
    deadline = time.monotonic() + 30
    while b.beat([]) and time.monotonic() < deadline:  # "a" stops beating: its key expires
        time.sleep(0.05)
    assert b.beat([]) == [] and r.smembers(keys.WORKERS) == {b"b"}
    b.leave()
    assert not r.exists(keys.WORKERS, keys.worker("b"))


def test_workers_take_streams_up_to_capacity_and_hand_off_to_a_newcomer(r, rt, redis_url):
    """In process: three encoders step side by side over one Redis; placement settles as the rule says."""
    cams = ("c1", "c2", "c3")
    for cam in cams:  # described by ingest; no frames needed to own a stream
        r.hset(keys.meta(cam), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})

    store = MemoryStore()  # the segment store every worker reaches

    def worker(name: str, capacity: int | None) -> EncoderService:
        cfg = EncoderConfig(
            redis_url=redis_url, streams=cams, consumer=name, max_streams=capacity, block_ms=20, lease_ms=1000
        )
        return EncoderService(cfg, rt, r, store)

    def settle(workers: list[EncoderService], want: dict[str, int], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while {w.cfg.consumer: len(w.owned) for w in workers} != want:
            assert time.monotonic() < deadline, {w.cfg.consumer: sorted(w.owned) for w in workers}
            for w in workers:
                w.step()

    a = worker("a", 2)
    settle([a], {"a": 2})  # alone, but at capacity: one stream stays free
    b = worker("b", None)
    settle([a, b], {"a": 2, "b": 1})  # the free one is taken; 2 and 1 differ by one: nothing moves
    taken = []  # a question of each of a's streams that a's QA (same consumer name) is answering
    for cam in a.owned:
        forward(r, cam, f"q-{cam}", {b"stream": cam.encode(), b"question": b"hi"}, ttl_s=60)
        taken += redisio.GroupReader(r, [keys.questions(cam)], keys.QA_GROUP, "a", block_ms=20).read()
    c = worker("c", None)
    with pytest.raises(AssertionError):  # "a" is two above the newcomer, but its questions hold the stream
        settle([a, b, c], {"a": 1, "b": 1, "c": 1}, timeout_s=1.5)
    assert a.leaving in a.owned and a.leaving not in a.answering()  # still held; new questions wait
    for queue, entry_id, _ in taken:  # answered
        r.xack(queue, keys.QA_GROUP, entry_id)
    settle([a, b, c], {"a": 1, "b": 1, "c": 1})  # now it hands one off
    released = [f for cam in cams for _, f in r.xrange(keys.events(cam)) if f[b"type"] == b"encoder_released"]
    assert [f[b"consumer"] for f in released] == [b"a"]
    assert {holder_name(r.get(keys.lease(cam))) for cam in cams} == {"a", "b", "c"}
    loads = {w.worker: (w.load, w.capacity) for w in a.placement.beat(a.owned)}
    assert loads == {"b": (1, None), "c": (1, None)}


def test_a_stream_handed_off_is_released_while_its_frames_keep_coming(r, rt, redis_url):
    """Streams are read as their tasks end: the stream being handed off must still get a moment
    between its tasks to be released, though every read finds new frames of it."""
    import numpy as np

    from common.wire.schemas import FrameMsg, encode_frame

    cams = ("f1", "f2")
    for cam in cams:
        r.hset(keys.meta(cam), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    store = MemoryStore()

    def worker(name: str) -> EncoderService:
        cfg = EncoderConfig(
            redis_url=redis_url, streams=cams, consumer=name, chunk_frames=2, block_ms=20, lease_ms=1000
        )
        return EncoderService(cfg, rt, r, store)

    stop = threading.Event()

    def send() -> None:  # a chunk's two frames at a time, so a task's read ends on a chunk boundary
        frame, seq = np.zeros((56, 56, 3), np.uint8), 0
        while not stop.is_set():
            pipe = r.pipeline(transaction=True)
            for cam in cams:
                for s in (seq, seq + 1):
                    pipe.xadd(keys.frames(cam), encode_frame(FrameMsg.from_rgb(s, s / 2, s / 2, frame)))
            pipe.execute()
            seq += 2
            time.sleep(0.01)

    a, b = worker("a"), worker("b")
    sender = threading.Thread(target=send)
    sender.start()
    try:
        deadline = time.monotonic() + 60
        while len(a.owned) < 2:
            assert time.monotonic() < deadline
            a.step()
        # Released at a chunk boundary, not by HAND_OFF_WAIT_S: the event's unencoded == 0 below
        # says which (a release by the timeout leaves the partial chunk), not how long it took.
        deadline = time.monotonic() + 60
        while (len(a.owned), len(b.owned)) != (1, 1):
            assert time.monotonic() < deadline, (sorted(a.owned), sorted(b.owned), a.leaving)
            a.step()
            b.step()
    finally:
        stop.set()
        sender.join()
    released = [f for cam in cams for _, f in r.xrange(keys.events(cam)) if f[b"type"] == b"encoder_released"]
    assert [(f[b"consumer"], f[b"unencoded"]) for f in released] == [(b"a", b"0")]


def test_a_worker_busy_longer_than_a_lease_keeps_its_streams(r, rt, redis_url):
    """A chunk waiting its turn on a busy GPU can hold the main loop for longer than a lease; the
    lease and the heartbeat are renewed by their own thread, so no other worker takes the stream."""
    r.hset(keys.meta("c1"), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    store = MemoryStore()

    def worker(name: str) -> EncoderService:  # a lease of 1.5 s: renewed by a thread that a loaded machine may hold up
        cfg = EncoderConfig(redis_url=redis_url, streams=("c1",), consumer=name, block_ms=20, lease_ms=1500)
        return EncoderService(cfg, rt, r, store)

    busy, other = worker("busy"), worker("other")
    deadline = time.monotonic() + 60
    while not busy.owned and time.monotonic() < deadline:
        busy.step()  # takes the lease; a task of its own opens the stream
    assert list(busy.owned) == ["c1"]
    busy.step = lambda: time.sleep(0.05)  # type: ignore[method-assign]  # the main loop, stuck in a chunk
    stop = threading.Event()
    running = threading.Thread(target=busy.run, args=(stop,))
    running.start()
    try:
        deadline = time.monotonic() + 2 * 1.5  # two leases
        while time.monotonic() < deadline:
            other.step()
            assert not other.owned and holder_name(r.get(keys.lease("c1"))) == "busy"
            assert [w.worker for w in other.placement.beat(other.owned)] == ["busy"]  # alive, say its beats
    finally:
        stop.set()
        running.join(timeout=30)


def test_a_worker_takes_no_more_streams_than_its_kv_pool_holds(r, rt, redis_url, monkeypatch, capsys):
    """On a GPU the KV pool bounds max_streams (the streams' budgets, with SPARE_BUDGETS to spare and,
    in a worker with a frames log, its history caches' room), so
    placement leaves a stream the memory cannot hold to another worker instead of failing its
    chunks; on a CPU the pool grows as needed. (The GPU's memory is what cannot exist here: only
    the pool's limit is set.) Not one stream fitting is a configuration error: one line, exit 2."""
    import json
    from dataclasses import replace

    from apps.worker import history_tokens
    from apps.worker_config import WorkerConfig
    from common import boot
    from common.engine.runtime import SPARE_BUDGETS
    from common.logs import configure_logging

    cfg = EncoderConfig(redis_url=redis_url, streams=("c1", "c2", "c3"), consumer="a", max_cache_tokens=4096)
    assert rt.pool.limit_tokens() is None and boot.stream_capacity(cfg, rt) is cfg
    monkeypatch.setattr(rt.pool, "limit_tokens", lambda: (SPARE_BUDGETS + 2) * 4096 + 100)
    capped = boot.stream_capacity(cfg, rt)
    assert capped.max_streams == 2
    assert boot.stream_capacity(replace(cfg, max_streams=1), rt).max_streams == 1  # a lower cap stays
    assert boot.stream_capacity(replace(cfg, max_cache_tokens=None), rt).max_streams is None  # no budget, no bound
    assert boot.stream_capacity(replace(cfg, max_cache_tokens=4097), rt).max_streams == 1  # a budget in whole pages
    # a worker that answers about the past keeps its history caches' room out of the streams'
    history = WorkerConfig(**{f: getattr(cfg, f) for f in ("redis_url", "streams", "consumer", "max_cache_tokens")})
    history = replace(history, framelog_dir="/frames", history_max_tokens=100, history_max_concurrent=2)
    assert history_tokens(history, rt) == 2 * 128 and history_tokens(replace(history, framelog_dir=None), rt) == 0
    worker_cfg = boot.stream_capacity(history, rt, history_tokens(history, rt))
    assert worker_cfg.max_streams == 1
    assert rt.pool.limit_tokens() - rt.live_tokens(worker_cfg.max_streams, 4096) >= history_tokens(history, rt)

    for cam in cfg.streams:
        r.hset(keys.meta(cam), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    worker = EncoderService(replace(capped, block_ms=20, lease_ms=1000), rt, r, MemoryStore())
    deadline = time.monotonic() + 60
    while (worker.opening or len(worker.owned) < 2) and time.monotonic() < deadline:
        worker.step()  # takes leases; tasks of their own open the streams
    for _ in range(5):
        worker.step()  # and no more: the third stream stays another worker's
    assert len(worker.owned) == 2 and sum(r.exists(keys.lease(cam)) for cam in cfg.streams) == 2

    configure_logging("INFO")
    monkeypatch.setattr(rt.pool, "limit_tokens", lambda: SPARE_BUDGETS * 4096)
    capsys.readouterr()  # what was logged before
    with pytest.raises(SystemExit) as exited:
        boot.stream_capacity(cfg, rt)
    (line,) = [json.loads(x) for x in capsys.readouterr().err.splitlines() if "no stream fits" in x]
    assert exited.value.code == 2 and line["exit_code"] == 2 and line["max_cache_tokens"] == 4096
