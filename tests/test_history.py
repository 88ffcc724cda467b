"""Questions about a past span (`since`/`until`, issue 39.2) on a real redis-server, a real frames
log of frames sampled from an encoded video, and a tiny random-weight model.

The oracle: the answer about a span equals one-shot offline inference (transformers' own forward)
on exactly the frames it chose, read back from the log, whatever the live cache holds; the span
here reaches across the live cache's window (its first chunks were evicted, its last are still
there). The final's ranges are those frames' capture times. Its re-encode goes through the GPU
scheduler batched with a live stream's chunks, and gives its pages back to the pool, also after
an error. Every way such a question cannot be answered is an error final, and the worker goes on.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import torch

from apps.samplevideo import write_sample_video
from common import redisio
from common.engine.answer import ask
from common.engine.grid import Grid, StreamSpec, resize_to_grid
from common.engine.model import load_model
from common.engine.offline import offline_answer
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.scheduler import SchedulePolicy, Scheduler
from common.engine.stream_engine import ChunkWork, StreamEngine
from common.engine.temporary_cache import TemporaryCache
from common.engine.work import InlineExecutor
from common.framelog import FrameLog
from common.segment_store import DirectoryStore
from common.wire import keys
from common.wire.schemas import (
    FIELD,
    FinalAnswer,
    FrameMsg,
    decode_answer,
    encode_frame,
    new_question_id,
    parse_question,
)
from encoder_worker.config import EncoderConfig
from encoder_worker.service import EncoderService
from ingest.video import iter_file_frames
from qa_worker.answering import Answerer
from qa_worker.history import LoggedChunk, evenly
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


def captured(seq: int) -> float:
    return T0 + seq / FPS


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
        writer = FrameLog(self.log_dir).writer(CAM, roll_s=600)
        for seq, rgb in enumerate(frames):
            fields = encode_frame(FrameMsg.from_rgb(seq, captured(seq), seq / FPS, rgb))
            r.xadd(keys.frames(CAM), fields)
            writer.append(seq, captured(seq), fields[FIELD])
        writer.commit()
        writer.close()
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
    rt, redis_url, tmp_path, frames, executor
):
    r = redis.Redis.from_url(redis_url)
    prefix = len(rt.prefix_ids())
    world = World(rt, r, redis_url, tmp_path, frames, history_max_tokens=prefix + 3 * 4)  # 3 chunks of the span
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
    """Through a running scheduler, with a live stream's chunk queued alongside: the temporary
    cache's chunks ride in encode steps with it (background lanes fill what the live ones leave),
    and an answer from it equals offline inference on its frames (first-token logits too)."""
    batches: list[list[tuple[str, bool]]] = []
    run_batch = ChunkWork.run_batch.__func__

    def recorded(cls, batch):
        batches.append([(j.lane, j.background) for j in batch])
        run_batch(cls, batch)

    monkeypatch.setattr(ChunkWork, "run_batch", classmethod(recorded))
    scheduler = Scheduler(SchedulePolicy(max_batch=8, max_chunks=4))
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


def test_seconds_before_asking_and_the_budget_choose_chunks_evenly_over_the_span(rt, redis_url, tmp_path, frames):
    r = redis.Redis.from_url(redis_url)
    prefix = len(rt.prefix_ids())
    world = World(rt, r, redis_url, tmp_path, frames, history_max_tokens=prefix + 4 * 4)
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
        "no frames": ({"since": iso(T0 - 600), "until": iso(T0 - 60)}, "holds no frame", None),
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


def test_answer_over_any_logged_chunks_says_which_it_saw(rt, redis_url, tmp_path, frames):
    """`Answerer.answer_over`, the entry point for chunks chosen otherwise (search): the order
    given, exactly those frames; a chunk the log no longer holds is left out of the answer and its
    ranges; frames of another grid are an error. The pool is as before each time."""
    r = redis.Redis.from_url(redis_url)
    world = World(rt, r, redis_url, tmp_path, frames)
    writer = FrameLog(world.log_dir).writer(CAM, roll_s=600)  # the camera set up anew: a larger grid
    big = np.zeros((112, 112, 3), dtype=np.uint8)
    for seq in range(FRAMES, FRAMES + 2):
        writer.append(seq, captured(seq), encode_frame(FrameMsg.from_rgb(seq, captured(seq), 0.0, big))[FIELD])
    writer.commit()
    writer.close()
    answerer, pool = world.answerer, rt.lm.pool.used_tokens

    def chunk(first: int) -> LoggedChunk:
        return LoggedChunk((first, first + 1), (captured(first), captured(first + 1)), 2)

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
