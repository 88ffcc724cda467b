"""Questions about a past span (`since`/`until`, issue 39.2) on a real redis-server, a real frames
log of frames sampled from an encoded video, and a tiny random-weight model.

The oracle: the answer about a span equals one-shot offline inference (transformers' own forward)
on exactly the frames it chose, read back from the log, whatever the live cache holds; the span
here reaches across the live cache's window (its first chunks were evicted, its last are still
there). The final's ranges are those frames' capture times. Its re-encode goes through the GPU
scheduler batched with a live stream's chunks, and gives its pages back to the pool, also after
an error. Every way such a question cannot be answered is an error final, and the worker goes on.

Cameras first: temporary caches take turns (`history_max_concurrent`), in order, the waiting ones
told their place and refused past `max_queue_wait_s`, and only within the pool's room beside what
the live streams are guaranteed, while a live stream goes on appending and evicting. Logged frames
are decoded in the decoder's processes (WebP on the wire, as ingest sends by default), exactly as here.
"""

from __future__ import annotations

import gc
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import torch

from apps.samplevideo import write_sample_video
from common import framelog, redisio
from common.decoding import FrameDecoder, Pending
from common.engine.answer import ask
from common.engine.eviction import EvictionPolicy
from common.engine.grid import Grid, StreamSpec, resize_to_grid
from common.engine.model import load_model
from common.engine.offline import offline_answer
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.scheduler import SchedulePolicy, Scheduler
from common.engine.stream_engine import ChunkWork, StreamEngine
from common.engine.temporary_cache import TemporaryCache
from common.engine.work import InlineExecutor
from common.framelog import FrameLog, decode
from common.segment_store import DirectoryStore
from common.wire import keys
from common.wire.admission import AdmissionEntry
from common.wire.manifest import to_manifest
from common.wire.schemas import (
    FIELD,
    FRAME_CODECS,
    AnswerDelta,
    FinalAnswer,
    FrameMsg,
    Question,
    SchemaError,
    decode_answer,
    encode_frame,
    manifest_to_bytes,
    new_question_id,
    parse_question,
)
from encoder_worker.config import EncoderConfig
from encoder_worker.service import EncoderService
from ingest.video import iter_file_frames
from qa_worker import history as history_module
from qa_worker.answering import Answerer
from qa_worker.history import History, LoggedChunk, evenly, logged_chunks
from tests.groupread import read_group
from tests.pipeline import wait_for
from tests.test_persistence import encoded, run_until, stop

CAM = "cam"
GRID = Grid(56, 56)  # 4 tokens a temporal patch: a chunk of 2 frames is 4 tokens
FPS = 2.0
FRAMES = 24  # 12 chunks of 2
T0 = float(int(time.time()) - 3600)  # frame k was captured at T0 + k / FPS, an hour ago (whole seconds: exact in ISO)
QUESTION = "What is happening in the video?"
TOKENS = 6


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


@pytest.fixture(scope="module")
def frames(tmp_path_factory) -> list[np.ndarray]:
    """Frames sampled at 2 fps from an H.264 video whose every frame differs."""
    path = str(tmp_path_factory.mktemp("video") / "cam.mp4")
    write_sample_video(path, seconds=12.5, fps=10, width=112, height=112)
    out = [resize_to_grid(f.rgb, GRID) for f in iter_file_frames(path, FPS)]
    assert len(out) >= FRAMES
    return out[:FRAMES]


@pytest.fixture(scope="module")
def decoder() -> Iterator[FrameDecoder]:
    """The processes that decode logged frames, as a worker's (common/decoding.py)."""
    decoder = FrameDecoder(2)
    yield decoder
    decoder.close()


def captured(seq: int) -> float:
    return T0 + seq / FPS


def write_log(log_dir: Path, frames: list[np.ndarray], codec: str = "webp") -> list[dict[str, bytes]]:
    """Every frame in the camera's frames log, as ingest sends it (`codec`); its frames entries."""
    writer = FrameLog(log_dir).writer(CAM, roll_s=600)
    entries = []
    for seq, rgb in enumerate(frames):
        entries.append(encode_frame(FrameMsg.from_rgb(seq, captured(seq), seq / FPS, rgb), codec=codec))
        writer.append(seq, captured(seq), entries[-1][FIELD])
    writer.commit()
    writer.close()
    return entries


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


class World:
    """The camera's frames encoded by an encoder whose cache keeps 1 sink chunk and its newest
    ones (evicting), every frame in the frames log, and an answerer reading that log."""

    def __init__(self, rt: Runtime, r: redis.Redis, url: str, tmp_path: Path, frames: list[np.ndarray], **qa):
        self.r, self.log_dir = r, tmp_path / "log"
        r.hset(keys.meta(CAM), mapping={"fps": FPS, "height": GRID.height, "width": GRID.width, "live": 0})
        prefix = len(rt.prefix_ids())
        cfg = EncoderConfig(
            redis_url=url,
            streams=(CAM,),
            consumer="enc",
            chunk_frames=2,
            block_ms=50,
            max_cache_tokens=prefix + 5 * 4,
            low_watermark=(prefix + 3 * 4) / (prefix + 5 * 4),
        )
        svc = EncoderService(cfg, rt, r, DirectoryStore(tmp_path / "segments"))
        for fields in write_log(self.log_dir, frames):
            r.xadd(keys.frames(CAM), fields)
        run_until(svc, lambda: encoded(r, CAM, FRAMES - 1), "every frame encoded")
        self.head = svc.owned[CAM].engine.head
        stop(svc, r)
        redisio.ensure_group(r, keys.QUESTIONS, keys.QA_GROUP)
        options = {"framelog_dir": str(self.log_dir), "history_max_tokens": 4096} | qa
        self.answerer = Answerer(rt, r, lambda s, at: self.head, lambda s: s == CAM, consumer="qa", **options)

    def ask(self, **fields: str) -> FinalAnswer:
        qid = new_question_id()
        entry = {"id": qid, "stream": CAM, "question": QUESTION, "max_tokens": str(TOKENS)} | fields
        self.r.xadd(keys.QUESTIONS, entry)
        entries = read_group(self.r, [keys.QUESTIONS], keys.QA_GROUP, "qa", block_ms=100)
        self.answerer.handle_entries(entries)
        assert self.r.xpending(keys.QUESTIONS, keys.QA_GROUP)["pending"] == 0
        replies = [decode_answer(f) for _, f in self.r.xrange(keys.answer(qid))]
        assert isinstance(replies[-1], FinalAnswer)
        return replies[-1]


def test_a_span_across_the_live_windows_edge_equals_offline_inference_on_the_frames_it_chose(
    rt, redis_url, tmp_path, frames, executor, decoder
):
    r = redis.Redis.from_url(redis_url)
    prefix = len(rt.prefix_ids())
    world = World(rt, r, redis_url, tmp_path, frames, history_max_tokens=prefix + 3 * 4, decoder=decoder)  # 3 chunks
    live = [p.segment.frame_seqs for p in world.head.chunks]
    edge = live[1][0]  # the oldest chunk after the sink: everything between was evicted
    assert live[0] == (0, 1) and edge >= 8 and world.head.stats.evictions > 0, live
    pool = rt.lm.pool.used_tokens

    final = world.ask(since=iso(captured(edge - 4)), until=iso(captured(edge + 3)))  # 4 chunks: 2 evicted, 2 live

    assert final.error is None, final.error
    chosen = [edge - 4, edge - 3, edge, edge + 1, edge + 2, edge + 3]  # 3 of the 4 chunks, evenly: 1st, 3rd, 4th
    assert final.ranges == ((captured(edge - 4), captured(edge - 3)), (captured(edge), captured(edge + 3)))
    assert (final.t_start, final.t_end) == (captured(edge - 4), captured(edge + 3))
    assert final.version is None and final.cache_tokens == prefix + 3 * 4
    offline = offline_answer(rt, [frames[s] for s in chosen], GRID, FPS, QUESTION, max_tokens=TOKENS)
    assert final.tokens == len(offline.token_ids) > 0
    assert final.text == offline.text
    assert rt.lm.pool.used_tokens == pool, "the temporary cache's pages went back to the pool"

    live_final = world.ask()  # without since: the live cache, as before
    assert live_final.version == world.head.id and live_final.ranges == tuple(world.head.capture_ranges)


def test_the_history_cache_is_encoded_beside_a_live_stream_and_equals_offline(rt, frames, monkeypatch):
    """Through a running scheduler, with a live stream's chunk queued alongside and the past
    without credit: the temporary cache's chunks ride in encode steps with it (background lanes
    fill what the live ones leave),
    and an answer from it equals offline inference on its frames (first-token logits too)."""
    batches: list[list[tuple[str, bool]]] = []
    run_batch = ChunkWork.run_batch.__func__

    def recorded(cls, batch):
        batches.append([(j.lane, j.background) for j in batch])
        run_batch(cls, batch)

    monkeypatch.setattr(ChunkWork, "run_batch", classmethod(recorded))
    scheduler = Scheduler(SchedulePolicy(max_batch=8, max_chunks=4, history_burst_s=0.0))  # no steps of its own
    rt.executor = scheduler.start()
    chosen = list(range(4, 20))
    try:
        live = StreamEngine(rt, StreamSpec("live", FPS, GRID, 2))
        with TemporaryCache(rt, StreamSpec(CAM, FPS, GRID, 2)) as cache:

            def history() -> None:
                for i in range(0, len(chosen), 2):  # one chunk an append: several encode steps
                    part = chosen[i : i + 2]
                    cache.append([frames[s] for s in part], [captured(s) for s in part], part)

            # The loop is held in a task until both lanes have a chunk queued, so that the next
            # encode step finds both (without the hold, which comes first is a matter of timing).
            gate = threading.Event()
            holding = threading.Thread(target=scheduler.call, args=(gate.wait,))
            holding.start()
            appends = [threading.Thread(target=history), threading.Thread(target=live.append, args=(frames[:2],))]
            for thread in appends:
                thread.start()
            wait_for(lambda: len(scheduler._lanes) == 2, 30, "a live and a history chunk queued")
            gate.set()
            for thread in [holding, *appends]:
                thread.join(60)
            streamed = ask(rt, cache.version, QUESTION, GenerationParams(max_tokens=TOKENS), keep_logits=True)
    finally:
        rt.executor.stop()
        rt.executor = InlineExecutor()
    offline = offline_answer(rt, [frames[s] for s in chosen], GRID, FPS, QUESTION, max_tokens=TOKENS)
    assert streamed.token_ids == offline.token_ids
    assert torch.allclose(streamed.first_logits, offline.first_logits, atol=1e-4)
    mixed = [b for b in batches if any(bg for _, bg in b) and not all(bg for _, bg in b)]
    assert mixed, f"no encode step held both: {batches}"
    assert all(lane.startswith(f"{CAM}~history") for b in batches for lane, bg in b if bg)


def test_the_temporary_cache_is_let_go_of_after_an_error(rt, frames):
    pool = rt.lm.pool.used_tokens
    with pytest.raises(RuntimeError, match="boom"), TemporaryCache(rt, StreamSpec(CAM, FPS, GRID, 2)) as cache:
        cache.append(frames[:4], [captured(s) for s in range(4)], range(4))
        assert rt.lm.pool.used_tokens > pool
        raise RuntimeError("boom")
    assert rt.lm.pool.used_tokens == pool
    with pytest.raises(RuntimeError, match="let go of"):
        cache.version  # noqa: B018 (a closed cache refuses, rather than hand out freed pages)


def test_seconds_before_asking_and_the_budget_choose_chunks_evenly_over_the_span(
    rt, redis_url, tmp_path, frames, decoder
):
    r = redis.Redis.from_url(redis_url)
    prefix = len(rt.prefix_ids())
    world = World(rt, r, redis_url, tmp_path, frames, history_max_tokens=prefix + 4 * 4, decoder=decoder)
    ago = time.time() - T0 + 60  # a minute before the first frame: counted from the asking, a little later
    final = world.ask(since=f"{ago:.3f}")  # the whole log, 12 chunks: 4 of them, first and last included
    assert final.error is None, final.error
    starts = [0, 8, 14, 22]  # chunks 0, round(11/3) = 4, round(22/3) = 7 and 11
    assert final.ranges == tuple((captured(s), captured(s + 1)) for s in starts)
    chosen = [frames[s] for first in starts for s in (first, first + 1)]
    offline = offline_answer(rt, chosen, GRID, FPS, QUESTION, max_tokens=TOKENS)
    assert final.text == offline.text and final.tokens == len(offline.token_ids)


def test_evenly_keeps_the_first_and_the_last_chunk():
    chunks = [LoggedChunk((2 * i, 2 * i + 1), (float(i), i + 0.5), 2) for i in range(12)]
    assert [c.frame_seqs[0] // 2 for c in evenly(chunks, 4)] == [0, 4, 7, 11]
    assert [c.frame_seqs[0] // 2 for c in evenly(chunks, 1)] == [6]
    assert evenly(chunks, 20) == chunks


def test_what_cannot_be_answered_about_the_past_is_an_error_final_and_the_worker_goes_on(
    rt, redis_url, tmp_path, frames
):
    r = redis.Redis.from_url(redis_url)
    world = World(rt, r, redis_url, tmp_path, frames)
    pool = rt.lm.pool.used_tokens
    cases = {
        "no frames": ({"since": iso(T0 - 600), "until": iso(T0 - 60)}, "holds no frame", "since"),
        "future": ({"since": iso(time.time() + 3600)}, "in the future", "since"),
        "empty": ({"since": iso(T0 + 5), "until": "7200"}, "later than since", "until"),  # until: 2 h ago
        "contradiction": ({"since": "1h", "until": "2h"}, "bad question: until", None),
        "too long": ({"since": "2h", "question": "𝔸" * 1000}, "the limit is 2048", None),  # found after encoding
    }
    for name, (fields, error, param) in cases.items():
        final = world.ask(**fields)
        assert final.error is not None and error in final.error, (name, final.error)
        assert final.param == param, (name, final.param)
    assert rt.lm.pool.used_tokens == pool
    assert world.ask(since="2h").error is None, "the worker answers the next one"

    world.answerer = Answerer(rt, r, lambda s, at: world.head, lambda s: s == CAM, consumer="qa")  # no framelog_dir
    final = world.ask(since="2h")
    assert "no frames log (framelog_dir)" in final.error
    assert world.ask().error is None, "questions without since are answered from the live cache"


def test_the_http_api_and_the_openai_endpoint_answer_about_the_past(rt, redis_url, tmp_path, frames):
    """End to end: the API queues the span, a worker answers it over the frames it chose, and the
    API tells the final (ranges, and evidence where it reads the same log) and the OpenAI reply."""
    from openai import OpenAI

    from api.config import ApiConfig
    from tests.test_api import served

    r = redis.Redis.from_url(redis_url)
    world = World(rt, r, redis_url, tmp_path, frames)
    stopped = threading.Event()

    def worker() -> None:
        while not stopped.is_set():
            world.answerer.handle_entries(read_group(r, [keys.QUESTIONS], keys.QA_GROUP, "qa", block_ms=100))

    answering = threading.Thread(target=worker, daemon=True)
    answering.start()
    span = {"since": iso(captured(4)), "until": iso(captured(11))}  # 8 frames, 4 chunks: all fit
    offline = offline_answer(rt, frames[4:12], GRID, FPS, QUESTION, max_tokens=TOKENS)
    cfg = ApiConfig(redis_url=redis_url, framelog_dir=str(world.log_dir))
    try:
        with served(cfg) as base:
            body = {"question": QUESTION, "max_tokens": TOKENS, "stream": False} | span
            final = httpx.post(f"{base}/api/streams/{CAM}/ask", json=body, timeout=120).json()
            assert final["text"] == offline.text and final["ranges"] == [[captured(4), captured(11)]], final
            assert final["evidence"]["ranges"] == final["ranges"]
            assert final["queue_s"] >= 0 and final["elapsed_s"] >= final["queue_s"] + final["total_s"] - 0.002, final
            client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            asked = [{"role": "user", "content": QUESTION}]
            done = client.chat.completions.create(model=CAM, messages=asked, max_tokens=TOKENS, extra_body=span)
            assert done.choices[0].message.content == offline.text
            assert done.model_extra["streamvqa"]["ranges"] == final["ranges"]
            refused = httpx.post(
                f"{base}/api/streams/{CAM}/ask",
                json=body | {"since": iso(T0 - 600), "until": iso(T0 - 60)},
                timeout=120,
            )
            assert refused.status_code == 422 and "holds no frame" in refused.json()["error"]["message"]
    finally:
        stopped.set()
        answering.join(10)


def test_answer_over_any_logged_chunks_says_which_it_saw(rt, redis_url, tmp_path, frames, decoder):
    """`Answerer.answer_over`, the entry point for chunks chosen otherwise (search): the order
    given, exactly those frames; a chunk the log no longer holds is left out of the answer and its
    ranges; frames of another grid are an error. The pool is as before each time."""
    r = redis.Redis.from_url(redis_url)
    world = World(rt, r, redis_url, tmp_path, frames, decoder=decoder)
    writer = FrameLog(world.log_dir).writer(CAM, roll_s=600)  # the camera set up anew: a larger grid
    big = np.zeros((112, 112, 3), dtype=np.uint8)
    for seq in range(FRAMES, FRAMES + 2):
        writer.append(seq, captured(seq), encode_frame(FrameMsg.from_rgb(seq, captured(seq), 0.0, big))[FIELD])
    writer.commit()
    writer.close()
    gc.collect()  # earlier tests' caches give their pages back now, not during this one
    answerer, pool = world.answerer, rt.lm.pool.used_tokens

    gone = LoggedChunk((500, 501), (captured(500), captured(501)), 2)  # collected: not in the log
    q = parse_question({"id": "q1", "stream": CAM, "question": QUESTION, "max_tokens": str(TOKENS)})
    final = answerer.answer_over(q, [chunk(20), gone, chunk(2)], ttl=60)
    assert final.ranges == ((captured(20), captured(21)), (captured(2), captured(3))), final
    offline = offline_answer(rt, [frames[s] for s in (20, 21, 2, 3)], GRID, FPS, QUESTION, max_tokens=TOKENS)
    assert final.text == offline.text and final.tokens == len(offline.token_ids)
    assert "no longer holds" in answerer.answer_over(q, [gone], ttl=60).error
    assert "not on the stream's 56x56 grid" in answerer.answer_over(q, [chunk(2), chunk(FRAMES)], ttl=60).error
    assert rt.lm.pool.used_tokens == pool
    assert answerer.history.fit(StreamSpec(CAM, FPS, GRID, 2)) == (4096 - len(rt.prefix_ids())) // 4


def chunk(first: int) -> LoggedChunk:
    """The logged chunk of frames `first` and `first + 1`."""
    return LoggedChunk((first, first + 1), (captured(first), captured(first + 1)), 2)


def test_logged_frames_decoded_in_the_decoders_processes_are_those_decoded_here(tmp_path, frames, decoder):
    """Every codec on the wire: the frames `submit_logged` gives back equal `framelog.decode`'s in
    this thread, pixel for pixel (the lossless ones the frames sent), in order; a record that does
    not decode raises as here."""
    for codec in FRAME_CODECS:
        records = [rec.raw for rec in FrameLog(write_log_dir(tmp_path, codec, frames)).between(CAM, T0, captured(7))]
        here, there = [decode(raw) for raw in records], decoder.submit_logged(records).result()
        assert len(there) == 8 and there == here, codec
        if codec != "jpeg":  # lossless: the frames sent
            assert all(np.array_equal(m.rgb(), frames[m.seq]) for m in there), codec
    with pytest.raises(SchemaError):
        decoder.submit_logged([records[0], b"not a frame"]).result()


def write_log_dir(tmp_path: Path, codec: str, frames: list[np.ndarray]) -> Path:
    write_log(tmp_path / codec, frames[:8], codec)
    return tmp_path / codec


def _question(qid: str) -> Question:
    return parse_question({"id": qid, "stream": CAM, "question": QUESTION, "max_tokens": str(TOKENS)})


def _places(r: redis.Redis, qid: str) -> list[int]:
    """The places a question was told, in its reply stream."""
    replies = [decode_answer(f) for _, f in r.xrange(keys.answer(qid))]
    return [d.position for d in replies if isinstance(d, AnswerDelta) and d.position is not None]


class Asking:
    """Questions over logged chunks answered side by side (`Answerer.answer_over`, each in a thread
    of its own) while the test steps a GPU scheduler by hand: work waits exactly until it steps."""

    def __init__(self, rt: Runtime, answerer: Answerer):
        self.rt, self.answerer = rt, answerer
        self.scheduler = Scheduler(SchedulePolicy(max_batch=8, max_chunks=4))  # never started
        self.finals: dict[str, FinalAnswer] = {}
        self.threads: list[threading.Thread] = []

    def ask(self, qid: str, chunks: list[LoggedChunk]) -> None:
        def answer() -> None:
            self.finals[qid] = self.answerer.answer_over(_question(qid), chunks, ttl=60, spec=SPEC)

        self.threads.append(threading.Thread(target=answer, daemon=True))
        self.threads[-1].start()

    def holding(self, n: int) -> None:
        """Until `n` questions hold a temporary cache."""
        wait_for(lambda: len(self.answerer.history.gate._held) == n, 10, f"{n} holding a history cache")

    def step_until(self, done, each=lambda: None) -> None:
        deadline = time.monotonic() + 120
        while not done() and time.monotonic() < deadline:
            self.scheduler.step()
            each()
            time.sleep(0.002)
        assert done()

    def finished(self) -> bool:
        return not any(t.is_alive() for t in self.threads)

    def __enter__(self) -> Asking:
        self.rt.executor = self.scheduler
        return self

    def __exit__(self, *_) -> None:
        self.rt.executor = InlineExecutor()


SPEC = StreamSpec(CAM, FPS, GRID, 2)
SPANS = {"qa": [chunk(0), chunk(10), chunk(16)], "qb": [chunk(4), chunk(12), chunk(20)]}


def test_history_caches_take_turns_in_order_told_their_place_answered_as_alone_or_refused_past_the_wait(
    rt, redis_url, tmp_path, frames, decoder
):
    """history_max_concurrent 1: a second question about the past waits while the first holds its
    cache, is told it is first in line, and is then answered exactly as alone; one that waits past
    max_queue_wait_s gets an error final that says why, and the first is answered all the same."""
    r = redis.Redis.from_url(redis_url)
    write_log(tmp_path / "log", frames)
    answerer = Answerer(
        rt, r, lambda s, at: None, lambda s: s == CAM, framelog_dir=str(tmp_path / "log"), decoder=decoder,
        history_max_concurrent=1, max_queue_wait_s=60,
    )  # fmt: skip
    alone = {qid: answerer.answer_over(_question(qid), chunks, ttl=60, spec=SPEC) for qid, chunks in SPANS.items()}
    assert all(f.error is None for f in alone.values())
    pool = rt.lm.pool.used_tokens

    with Asking(rt, answerer) as asking:
        asking.ask("qa", SPANS["qa"])
        asking.holding(1)
        asking.ask("qb", SPANS["qb"])
        wait_for(lambda: _places(r, "qb"), 10, "the second told its place")
        assert _places(r, "qb") == [1] and answerer.history.gate.queue.queued == 1
        assert len(answerer.history.gate._held) == 1 and "qa" not in asking.finals, "the first holds the only turn"
        asking.step_until(asking.finished)
    assert {qid: f.text for qid, f in asking.finals.items()} == {qid: f.text for qid, f in alone.items()}
    assert all(f.ranges == alone[qid].ranges for qid, f in asking.finals.items())
    assert rt.lm.pool.used_tokens == pool and answerer.history.gate.queue.queued == 0

    answerer.history.gate.max_wait_s = 0.5
    with Asking(rt, answerer) as asking:
        asking.ask("qa", SPANS["qa"])
        asking.holding(1)
        refused = answerer.answer_over(_question("qb"), SPANS["qb"], ttl=60, spec=SPEC)  # waits 0.5 s, in vain
        asking.step_until(asking.finished)
    assert refused.error is not None and "max_queue_wait_s" in refused.error, refused.error
    assert "history_max_concurrent" in refused.error and refused.text is None
    assert asking.finals["qa"].text == alone["qa"].text
    assert rt.lm.pool.used_tokens == pool and answerer.history.gate.queue.queued == 0


def test_a_history_cache_waits_for_room_beside_the_live_streams_which_keep_appending(
    rt, redis_url, tmp_path, frames, decoder, monkeypatch
):
    """The pool's room for history caches is its limit less what the live streams are guaranteed
    (their budgets and SPARE_BUDGETS more): with room for one cache, a second waits for it though a
    turn is free, while a live stream appends past its budget and evicts, and the pool never holds
    more than its limit; then it is answered as alone. A history_max_tokens the room can never hold
    fails at once, naming the setting."""
    r = redis.Redis.from_url(redis_url)
    write_log(tmp_path / "log", frames)
    prefix = len(rt.prefix_ids())
    budget = prefix + 5 * 4  # the live stream's: its 6th chunk spills over it and evicts
    live_tokens = rt.lm.pool.used_tokens + rt.live_tokens(1, budget)
    one_cache = rt.in_pages(prefix + 3 * 4)
    limit = live_tokens + one_cache  # room for one history cache, not two
    monkeypatch.setattr(rt.lm.pool, "limit_tokens", lambda: limit)
    options = dict(framelog_dir=str(tmp_path / "log"), decoder=decoder, live_tokens=live_tokens)
    answerer = Answerer(rt, r, lambda s, at: None, lambda s: True, history_max_tokens=prefix + 3 * 4, **options)
    alone = {qid: answerer.answer_over(_question(qid), chunks, ttl=60, spec=SPEC) for qid, chunks in SPANS.items()}
    live = StreamEngine(rt, StreamSpec("live", FPS, GRID, 2), EvictionPolicy(max_cache_tokens=budget))

    def live_appends() -> None:
        for first in range(0, 14, 2):
            live.append(frames[first : first + 2], [captured(first), captured(first + 1)], [first, first + 1])

    peak = [0]
    with Asking(rt, answerer) as asking:
        asking.ask("qa", SPANS["qa"])
        asking.holding(1)
        asking.ask("qb", SPANS["qb"])
        wait_for(lambda: _places(r, "qb"), 10, "the second told its place")
        assert _places(r, "qb") == [1] and len(answerer.history.gate._held) == 1, "no room for a second"
        appending = threading.Thread(target=live_appends)
        appending.start()
        asking.threads.append(appending)
        asking.step_until(asking.finished, lambda: peak.__setitem__(0, max(peak[0], rt.lm.pool.used_tokens)))
    assert live.head.stats.evictions > 0 and live.head.last_frame_seq == 13, "every live chunk appended"
    assert peak[0] <= limit
    assert {qid: f.text for qid, f in asking.finals.items()} == {qid: f.text for qid, f in alone.items()}

    too_big = Answerer(rt, r, lambda s, at: None, lambda s: True, history_max_tokens=2 * one_cache, **options)
    t0 = time.monotonic()
    final = too_big.answer_over(_question("qc"), SPANS["qa"], ttl=60, spec=SPEC)
    # at once: not after the 30 s (max_queue_wait_s) it would wait for room (a bound that far off
    # holds on a loaded machine, and the error names which it was)
    assert final.error is not None and "history_max_tokens" in final.error and time.monotonic() - t0 < 20, final.error


def test_a_qa_service_bounds_its_history_caches_as_configured_and_decodes_out_of_its_gil(rt, redis_url, tmp_path):
    """`qa` alone: decoder processes of its own (`decode_processes`) with a frames log, turns and
    wait as its settings say, no room rule (no live stream writes to its pool); a worker hands it
    its encoder's decoder and the live streams' guarantee."""
    from qa_worker.config import QAConfig
    from qa_worker.service import QAService

    class NoVersions:
        exclusive = False
        get, serves, answering, run = (lambda *_: None), (lambda _: True), (lambda *_: [CAM]), (lambda _: None)

    r = redis.Redis.from_url(redis_url)
    cfg = QAConfig(redis_url=redis_url, streams=(CAM,), framelog_dir=str(tmp_path), decode_processes=1)
    cfg = replace(cfg, history_max_concurrent=3, max_queue_wait_s=7.0)
    alone = QAService(cfg, rt, r, NoVersions())
    history = alone.answerer.history
    assert isinstance(history.decoder, FrameDecoder) and history.decoder.processes == 1 and alone.own_decoder
    assert (history.gate.at_once, history.gate.max_wait_s, history.live_tokens) == (3, 7.0, None)
    waiting = history.gate.queue.take()  # published for the API beside the GPU's queue
    alone._publish_admission()
    history.gate.queue.done(waiting)
    published = AdmissionEntry.from_json(r.hget(keys.admission(CAM), cfg.consumer))
    assert published is not None and (published.queued, published.history_queued) == (0, 1)
    alone.decoder.close()
    shared = FrameDecoder(1)
    beside_an_encoder = QAService(cfg, rt, r, NoVersions(), decoder=shared, live_tokens=4096)
    assert beside_an_encoder.answerer.history.decoder is shared and not beside_an_encoder.own_decoder
    assert beside_an_encoder.answerer.history.live_tokens == 4096
    shared.close()
    assert QAService(replace(cfg, framelog_dir=None), rt, r, NoVersions()).decoder is None


def test_every_piece_is_decoded_at_once_and_queued_before_the_first_is_encoded_and_the_answer_is_unchanged(
    rt, redis_url, tmp_path, frames, decoder, monkeypatch
):
    """Pieces of two chunks: every piece's frames are handed to the decoder's processes at once,
    and each piece is queued for the GPU before the first one's encode is waited for (so that
    the scheduler finds the next piece waiting). The cache holds exactly the chunks' frames in
    order, a chunk the log no longer holds left out: the answer equals offline inference on them,
    also through a GPU scheduler and without decoder processes. A queue that fails drops the
    pieces still decoding and lets the cache go."""
    monkeypatch.setattr(history_module, "PIECE_TOKENS", 8)  # a chunk of 2 frames is 4 tokens
    r = redis.Redis.from_url(redis_url)
    write_log(tmp_path / "log", frames)
    answerer = Answerer(rt, r, lambda s, at: None, lambda s: True, framelog_dir=str(tmp_path / "log"))
    events: list[tuple[str, list[int]]] = []
    pending: list[Pending] = []

    class Recorded:
        """The decoder's hand-overs of logged frames and their cancelling, in order."""

        def submit_logged(self, raws):
            seqs = [decode(raw).seq for raw in raws]
            events.append(("decode", seqs))
            pending.append(decoder.submit_logged(raws))
            cancel = pending[-1].cancel
            pending[-1].cancel = lambda: (events.append(("cancel", seqs)), cancel())
            return pending[-1]

    queue, finish = TemporaryCache.queue, TemporaryCache.finish

    def queued(cache, frames_, capture_times, frame_seqs):
        events.append(("queued", list(frame_seqs)))
        future = queue(cache, frames_, capture_times, frame_seqs)
        future.seqs = list(frame_seqs)
        return future

    def finished(cache, future) -> None:
        finish(cache, future)
        events.append(("finished", future.seqs))

    monkeypatch.setattr(TemporaryCache, "queue", queued)
    monkeypatch.setattr(TemporaryCache, "finish", finished)
    answerer.history.decoder = Recorded()
    gone = LoggedChunk((500, 501), (captured(500), captured(501)), 2)
    chunks = [chunk(0), chunk(6), gone, chunk(10), chunk(14), chunk(20)]  # pieces: 0 6 | gone 10 | 14 20
    pieces = [[0, 1, 6, 7], [10, 11], [14, 15, 20, 21]]
    gc.collect()  # earlier tests' caches give their pages back now, not during this one
    pool = rt.lm.pool.used_tokens

    final = answerer.answer_over(_question("qp"), chunks, ttl=60, spec=SPEC)
    assert events == [
        *(("decode", piece) for piece in pieces),
        *(("queued", piece) for piece in pieces),
        *(("finished", piece) for piece in pieces),
    ]
    seqs = [s for piece in pieces for s in piece]
    offline = offline_answer(rt, [frames[s] for s in seqs], GRID, FPS, QUESTION, max_tokens=TOKENS)
    assert final.error is None and final.text == offline.text and final.tokens == len(offline.token_ids)
    assert final.ranges == tuple((captured(s), captured(s + 1)) for s in (0, 6, 10, 14, 20))
    with Asking(rt, answerer) as asking:  # through a GPU scheduler, stepped by hand
        pending.clear()
        asking.ask("qs", chunks)
        asking.step_until(asking.finished)
    assert asking.finals["qs"].text == offline.text
    answerer.history.decoder = None  # decoded in this thread
    assert answerer.answer_over(_question("qh"), chunks, ttl=60, spec=SPEC).text == offline.text
    assert rt.lm.pool.used_tokens == pool

    def failing(cache, frames_, capture_times, frame_seqs):
        if frame_seqs[0] == pieces[1][0]:
            raise RuntimeError("no room in the KV pool")
        return queued(cache, frames_, capture_times, frame_seqs)

    monkeypatch.setattr(TemporaryCache, "queue", failing)
    answerer.history.decoder, events[:] = Recorded(), []
    final = answerer.answer_over(_question("qf"), chunks, ttl=60, spec=SPEC)
    assert final.error is not None and "no room in the KV pool" in final.error, final.error
    assert events == [*(("decode", piece) for piece in pieces), ("queued", pieces[0]), ("cancel", pieces[2])]
    assert rt.lm.pool.used_tokens == pool


def test_a_history_questions_queue_s_counts_its_wait_for_a_turn(rt, redis_url, tmp_path, frames, decoder):
    """history_max_concurrent 1, its turn held: a question about the past that waited for it has
    that wait in its final's `queue_s` (beside its wait for the GPU), and `elapsed_s` is still at
    least `queue_s` + `total_s`; one refused past max_queue_wait_s has its wait in `queue_s` too."""
    r = redis.Redis.from_url(redis_url)
    world = World(rt, r, redis_url, tmp_path, frames, decoder=decoder, history_max_concurrent=1)
    gate, span = world.answerer.history.gate, {"since": iso(captured(4)), "until": iso(captured(11))}
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with gate.turn(1, lambda _: None):
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    gate.max_wait_s = 0.3
    refused = world.ask(**span)
    assert refused.error is not None and "max_queue_wait_s" in refused.error, refused.error
    assert refused.queue_s >= 0.3 and refused.elapsed_s >= refused.queue_s, refused

    gate.max_wait_s = 60
    finals: list[FinalAnswer] = []
    asking = threading.Thread(target=lambda: finals.append(world.ask(**span)), daemon=True)
    asking.start()
    wait_for(lambda: gate.queue.queued == 1, 30, "the question waiting for its turn")
    t0 = time.perf_counter()
    time.sleep(0.3)  # a wait it is known to have had
    waited = time.perf_counter() - t0
    release.set()
    asking.join(60)
    holder.join(10)
    (final,) = finals
    assert final.error is None, final.error
    assert final.queue_s >= waited - 0.001, (final, waited)  # rounded to the millisecond
    assert final.elapsed_s >= final.queue_s + final.total_s - 0.002, final


def test_choosing_over_a_long_span_builds_what_it_chooses_not_the_span(rt, redis_url, tmp_path, monkeypatch):
    """A question about a week at 2 fps chose from a list of the span's every frame stamp (1.2 M)
    and every chunk (300,000), built holding the GIL before it waited for its turn: several at
    once piled that up. Now it looks up only the chunks it chooses, the same chunks: here 60,000
    frames in 200 files (their indexes cached, as a worker's are), 8 chunks chosen."""
    r = redis.Redis.from_url(redis_url)
    spec = StreamSpec("long", FPS, GRID, chunk_frames=2)
    r.set(keys.head(spec.name), manifest_to_bytes(to_manifest(StreamEngine(rt, spec).head, spec)))
    start = time.time() - 7 * 86400
    with monkeypatch.context() as m:  # 200 files a minute apart, written at once: a clock that runs ahead
        clock = [start]
        m.setattr(framelog.time, "time", lambda: clock[0])
        w = FrameLog(tmp_path).writer(spec.name, roll_s=60)
        for seq in range(60_000):
            w.append(seq, start + seq / FPS, b"x")
            if seq % 300 == 299:
                w.commit()
                clock[0] += 60
        w.close()
    history = History(rt, r, str(tmp_path), len(rt.prefix_ids()) + 8 * 4)
    assert len(list((tmp_path / spec.name).glob("*.log"))) == 200
    q = parse_question({"id": new_question_id(), "stream": spec.name, "question": QUESTION, "since": "8d"})
    history.choose(q, time.time())  # the log's indexes read (and cached)
    tracemalloc.start()
    try:
        _, chosen = history.choose(q, time.time())
        built = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert built < 256 << 10, f"{built} bytes built to choose 8 chunks"  # the span's stamps alone: ~5 MB
    everything = logged_chunks(history.framelog, spec.name, start - 1, time.time(), 2)
    assert len(everything) == 30_000 and chosen == evenly(everything, 8)
