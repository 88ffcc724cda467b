"""Oracles for batching (tiny-random, fp32, CPU): a batched step equals the same work done one at
a time, whatever else is in the batch, and a snapshot never changes.

Streams of different grids, fps and cache sizes are encoded through one Scheduler while questions
on all of them are answered concurrently; every answer (greedy tokens and first logits) and
every cache must equal what the inline executor gives doing one thing at a time.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from common.engine import answer
from common.engine.answer import Generation, ask, choose
from common.engine.eviction import EvictionPolicy
from common.engine.grid import Grid, StreamSpec
from common.engine.lm import Item
from common.engine.model import load_model
from common.engine.params import GenerationParams, QuestionError
from common.engine.runtime import Runtime
from common.engine.scheduler import SchedulePolicy, Scheduler
from common.engine.stream_engine import StreamEngine
from common.engine.work import InlineExecutor

SPECS = [
    StreamSpec("a", 2, Grid(56, 84), 4),
    StreamSpec("b", 3, Grid(84, 56), 2),
    StreamSpec("c", 0.75, Grid(56, 56), 6),
]
QUESTIONS = ["What is happening?", "Is anything red?", "Describe the scene in detail, please."]


@pytest.fixture(scope="module", params=[None, 3000], ids=["one-slab", "many-slabs"])
def rt(request) -> Runtime:
    """Also with small pool slabs, so one batch reads and writes regions of several slabs."""
    return Runtime(load_model("tiny-random"), pool_tokens=request.param)


def frames_for(spec: StreamSpec, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(len(spec.name) + n)
    return [rng.integers(0, 256, (spec.grid.height, spec.grid.width, 3), dtype=np.uint8) for _ in range(n)]


def encode(rt: Runtime, spec: StreamSpec, frames: list[np.ndarray], policy: EvictionPolicy | None = None):
    engine = StreamEngine(rt, spec, policy)
    for i in range(0, len(frames), spec.chunk_frames):
        part = frames[i : i + spec.chunk_frames]
        engine.append(part, [(i + k) / spec.fps for k in range(len(part))], list(range(i, i + len(part))))
    return engine


def in_threads(fns) -> list:
    results: list = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def scheduled(rt: Runtime):
    scheduler = Scheduler(SchedulePolicy(max_batch=8, max_chunks=4)).start()
    rt.executor = scheduler
    yield scheduler
    scheduler.stop()
    rt.executor = InlineExecutor()


def test_batched_encoding_and_answers_equal_one_at_a_time(rt: Runtime, scheduled: Scheduler):
    lengths = {"a": 12, "b": 8, "c": 12}  # different cache sizes, odd chunk counts
    frames = {s.name: frames_for(s, lengths[s.name]) for s in SPECS}
    params = GenerationParams(max_tokens=10)

    engines = in_threads([lambda s=s: encode(rt, s, frames[s.name]) for s in SPECS])
    asks = [(e, q) for e in engines for q in QUESTIONS]  # 9 questions on 3 streams, all at once
    batched = in_threads([lambda e=e, q=q: ask(rt, e.head, q, params, keep_logits=True) for e, q in asks])
    steps = scheduled.steps

    rt.executor = InlineExecutor()
    alone_engines = [encode(rt, s, frames[s.name]) for s in SPECS]
    for e, alone in zip(engines, alone_engines, strict=True):
        n = e.head.tokens
        assert n == alone.head.tokens
        assert torch.allclose(e.head.view.kv[:, :, :, :n], alone.head.view.kv[:, :, :, :n], atol=1e-5)
    for (e, q), got in zip(asks, batched, strict=True):
        want = ask(rt, alone_engines[engines.index(e)].head, q, params, keep_logits=True)
        assert got.token_ids == want.token_ids, (e.spec.name, q)
        assert torch.allclose(got.first_logits, want.first_logits, atol=1e-4, rtol=0)
    assert steps < 3 * len(asks) * params.max_tokens, "questions were not batched"


def test_an_answer_does_not_depend_on_its_batch(rt: Runtime, scheduled: Scheduler):
    spec = SPECS[0]
    engine = encode(rt, spec, frames_for(spec, 8))
    params = GenerationParams(max_tokens=8)
    alone = ask(rt, engine.head, QUESTIONS[0], params, keep_logits=True)
    crowd = in_threads([lambda q=q: ask(rt, engine.head, q, params, keep_logits=True) for q in QUESTIONS * 3])
    for got in crowd[0::3]:
        assert got.token_ids == alone.token_ids
        assert torch.allclose(got.first_logits, alone.first_logits, atol=1e-4, rtol=0)


def test_the_question_benchmark_runs_through_a_scheduler(rt: Runtime):
    """bench_engine's `--question-executor scheduler`: questions submitted together, decoded in
    the scheduler's batches, every one to its full length."""
    from scripts.bench_engine import batched_decode

    versions = [encode(rt, spec, frames_for(spec, 4)).head for spec in SPECS]
    rt.executor = scheduler = Scheduler(SchedulePolicy()).start()
    try:
        row = batched_decode(rt, versions, tokens=5)
    finally:
        scheduler.stop()
        rt.executor = InlineExecutor()
    assert row["questions"] == 3 and row["aggregate_tok_s"] > 0 and row["first_token_ms_max"] > 0


def test_a_question_failing_in_its_own_step_work_fails_alone(rt: Runtime):
    """What goes wrong with one question's own part of a batched step (its token callback, its
    sampling) fails that question; the others in the step go on to the answers they get alone."""
    spec = SPECS[0]
    engine = encode(rt, spec, frames_for(spec, 4))
    params = GenerationParams(max_tokens=6)
    alone = [ask(rt, engine.head, q, params) for q in QUESTIONS[:2]]

    def client_gone(tokens: list[int]) -> None:
        raise ConnectionError("the asker went away")

    gens = [Generation(rt, engine.head, q, params) for q in QUESTIONS[:2]]
    gens.insert(1, Generation(rt, engine.head, QUESTIONS[2], params, on_tokens=client_gone))
    while not all(g.done for g in gens):
        Generation.step_batch([g for g in gens if not g.done])
    with pytest.raises(ConnectionError, match="went away"):
        gens[1].future.result()
    assert [g.future.result().token_ids for g in (gens[0], gens[2])] == [a.token_ids for a in alone]


def test_sampled_and_multiple_choice_go_through_the_scheduler(rt: Runtime, scheduled: Scheduler):
    spec = SPECS[1]
    engine = encode(rt, spec, frames_for(spec, 4))
    sampled = GenerationParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=3)
    runs = in_threads([lambda: ask(rt, engine.head, QUESTIONS[1], sampled) for _ in range(3)])
    assert len({tuple(r.token_ids) for r in runs}) == 1, "a seed fixes the sample, batched or not"
    picked = choose(rt, engine.head, QUESTIONS[1], ["yes", "no", "maybe"])
    rt.executor = InlineExecutor()
    assert choose(rt, engine.head, QUESTIONS[1], ["yes", "no", "maybe"]).scores == pytest.approx(
        picked.scores, abs=1e-5
    )


def test_snapshots_never_change_under_encoding_eviction_and_questions(rt: Runtime, scheduled: Scheduler):
    spec = StreamSpec("s", 2, Grid(56, 56), 2)
    policy = EvictionPolicy(max_cache_tokens=len(rt.prefix_ids()) + 24, sink_chunks=1)
    engine = StreamEngine(rt, spec, policy)
    frames = frames_for(spec, 40)
    held = []
    for i in range(0, 40, 2):
        v = engine.append(frames[i : i + 2], [i / 2, (i + 1) / 2], [i, i + 1])
        held.append((v, v.view.kv[:, :, :, : v.tokens].clone()))
        in_threads([lambda v=v: ask(rt, v, QUESTIONS[0], GenerationParams(max_tokens=3))] * 2)
    assert engine.head.stats.evictions > 0
    for v, before in held:
        assert torch.equal(v.view.kv[:, :, :, : v.tokens], before), f"version {v.id} changed"


def test_questions_decode_beside_an_encode_step_and_answer_the_same(rt: Runtime, monkeypatch):
    """A question being answered keeps decoding between the layers of an encode step: same tokens
    and logits as alone, and the chunks' caches are those of encoding alone (tests/test_gpu.py runs
    the same check where the decode steps go beside the encode step, on another CUDA stream)."""
    answer_beside_encoding(rt, monkeypatch)


@pytest.mark.parametrize("join", [True, False], ids=["join-during-encode", "wait-for-the-step"])
def test_a_question_arriving_during_an_encode_step_joins_it_only_if_asked_to(rt: Runtime, monkeypatch, join: bool):
    """With `join_during_encode`, questions submitted during an encode step are prefilled beside it
    instead of after it; either way they answer as alone, and the chunk's cache is what encoding
    alone gives (tests/test_gpu.py runs the same on the GPU, where a version just published is
    written only later)."""
    answer_joining_during_encoding(rt, monkeypatch, join)


def question_and_chunks(rt: Runtime, question: str, max_tokens: int, n_frames: int):
    """Stream b encoded, with `question`'s answer on it alone; frames of stream a and its cache
    encoded alone: what an answer and a cache produced beside each other must equal."""
    spec_a, spec_b = SPECS[0], SPECS[1]
    engine_b = encode(rt, spec_b, frames_for(spec_b, 4))
    params = GenerationParams(max_tokens=max_tokens)
    want = ask(rt, engine_b.head, question, params, keep_logits=True)
    frames = frames_for(spec_a, n_frames)
    return engine_b, params, want, frames, encode(rt, spec_a, frames)


def spy_on_launches(monkeypatch) -> list[bool]:
    """Filled with `alongside` of every question step launched: True beside an encode step."""
    launches: list[bool] = []
    launch = Generation.launch_batch

    def spy(cls, batch, alongside=False):
        launches.append(alongside)
        return launch(batch, alongside)

    monkeypatch.setattr(Generation, "launch_batch", classmethod(spy))
    return launches


def answer_joining_during_encoding(rt: Runtime, monkeypatch, join: bool, atol: float = 1e-4) -> None:
    """Two questions arrive during an encode step of stream a: one on stream b once the vision
    pass is done, one on stream a's version the step has just published. With `join` both start
    beside the step, the second only once that version is written on the device; each answers as
    alone, and stream a's cache is what encoding alone gives."""
    from common.engine import stream_engine

    engine_b, params, want, frames, alone = question_and_chunks(rt, QUESTIONS[1], 6, 4)
    want_a = ask(rt, alone.head, QUESTIONS[0], params, keep_logits=True)
    launches = spy_on_launches(monkeypatch)
    vision, published = stream_engine._vision, stream_engine.between_outputs
    scheduler = Scheduler(SchedulePolicy(join_during_encode=join))
    asked: list = []
    engine_a = StreamEngine(rt, SPECS[0])

    def vision_then_a_question(batch):
        vision(batch)
        if not asked:
            asked.append(scheduler.submit(Generation(rt, engine_b.head, QUESTIONS[1], params, keep_logits=True)))

    def published_then_a_question():
        if len(asked) == 1:
            asked.append(scheduler.submit(Generation(rt, engine_a.head, QUESTIONS[0], params, keep_logits=True)))
        published()

    monkeypatch.setattr(stream_engine, "_vision", vision_then_a_question)
    monkeypatch.setattr(stream_engine, "between_outputs", published_then_a_question)
    rt.executor = scheduler
    try:
        chunk = engine_a.submit(engine_a.prepare(frames, [k / 2 for k in range(4)], range(4)))
        scheduler.step()  # the encode step, during which the questions arrive
        first_launch = launches[:1]
        for _ in range(50):
            if all(a.done() for a in asked):
                break
            scheduler.step()
        engine_a.finish(chunk.result())
    finally:
        rt.executor = InlineExecutor()
    assert first_launch == ([True] if join else [])
    for got, wanted in zip((a.result() for a in asked), (want, want_a), strict=True):
        assert got.token_ids == wanted.token_ids
        assert torch.allclose(got.first_logits, wanted.first_logits, atol=atol, rtol=0)
    assert torch.equal(engine_a.head.view.kv, alone.head.view.kv)


def answer_beside_encoding(
    rt: Runtime, monkeypatch, atol: float = 1e-4, decode_sms: int = 0, cache_atol: float | None = None
) -> None:
    """`cache_atol`: how far the chunks' caches may be from encoding alone (None: bit for bit)."""
    from common.engine import stream_engine

    engine_b, params, want, frames, alone = question_and_chunks(rt, QUESTIONS[2], 12, 12)
    launches = spy_on_launches(monkeypatch)
    forward, vision = answer._forward, stream_engine._vision
    inference: list[bool] = []
    encode_cuda_streams: set[object] = set()  # where the encode steps' vision ran, on a GPU

    def forward_spy(gens, picks=None):
        # inside an encode step's forward, a step must still run as it would alone: a graph
        # captured in inference mode has buffers that no later replay can write
        inference.append(torch.is_inference_mode_enabled())
        return forward(gens, picks)

    def vision_spy(batch):
        if rt.device.type == "cuda":
            encode_cuda_streams.add(torch.cuda.current_stream())
        return vision(batch)

    outputs, between_outputs = [], stream_engine.between_outputs

    def between_outputs_spy():  # a published chunk: do questions decode on here too?
        before = len(launches)
        between_outputs()
        outputs.append(len(launches) - before)

    monkeypatch.setattr(answer, "_forward", forward_spy)
    monkeypatch.setattr(stream_engine, "_vision", vision_spy)
    monkeypatch.setattr(stream_engine, "between_outputs", between_outputs_spy)
    # driven by hand: an encode step after each decode
    scheduler = Scheduler(SchedulePolicy(encode_share=1.0, decode_sms=decode_sms))
    engine_a = StreamEngine(rt, SPECS[0])
    rt.executor = scheduler
    try:
        question = scheduler.submit(Generation(rt, engine_b.head, QUESTIONS[2], params, keep_logits=True))
        chunks = [
            engine_a.submit(engine_a.prepare(frames[i : i + 4], [(i + k) / 2 for k in range(4)], range(i, i + 4)))
            for i in range(0, 12, 4)
        ]
        for _ in range(100):
            if question.done() and all(c.done() for c in chunks):
                break
            scheduler.step()
        for c in chunks:
            engine_a.finish(c.result())
    finally:
        rt.executor = InlineExecutor()
    got = question.result()
    assert any(launches), "no decode step ran beside an encode step"
    if rt.device.type == "cpu":  # on a GPU the step in flight may not have finished by then: no launch
        assert any(outputs), "no decode step ran between the chunks an encode step published"
    assert not any(inference), "a decode step beside an encode step ran in its inference mode"
    again = ask(rt, engine_b.head, QUESTIONS[2], params)  # replays what was captured beside, if anything
    assert again.token_ids == want.token_ids
    assert got.token_ids == want.token_ids
    assert torch.allclose(got.first_logits, want.first_logits, atol=atol, rtol=0)
    n = alone.head.tokens
    assert engine_a.head.tokens == n
    got_kv, want_kv = engine_a.head.view.kv[:, :, :, :n], alone.head.view.kv[:, :, :, :n]
    if cache_atol is None:
        assert torch.equal(got_kv, want_kv)
    else:
        assert torch.allclose(got_kv.float(), want_kv.float(), atol=cache_atol, rtol=0)
    if rt.device.type == "cuda":  # beside questions, encoding ran on a CUDA stream of fewer SMs, if asked to
        fewer = {scheduler._fewer_sms[1]} if decode_sms else set()
        assert fewer <= encode_cuda_streams <= fewer | {torch.cuda.default_stream()}


def test_regions_return_to_the_pool(rt: Runtime):
    used = rt.pool.used_tokens
    region = rt.pool.alloc(100)
    item = Item(1, region, 0)
    assert rt.pool.used_tokens == used + region.size == used + 128 and item.dest is region  # whole pages
    del item, region
    assert rt.pool.used_tokens == used


def test_warm_up_leaves_nothing_behind(rt: Runtime):
    """Its throwaway streams and questions give their memory back, and answers are unchanged."""
    from common.engine.warmup import warm_up

    spec = SPECS[0]
    engine = encode(rt, spec, frames_for(spec, 4))
    params = GenerationParams(max_tokens=6)
    before = ask(rt, engine.head, QUESTIONS[0], params, keep_logits=True)
    used = rt.pool.used_tokens
    assert warm_up(rt) > 0
    assert rt.pool.used_tokens == used
    after = ask(rt, engine.head, QUESTIONS[0], params, keep_logits=True)
    assert after.token_ids == before.token_ids and torch.equal(after.first_logits, before.first_logits)


def test_the_loops_host_time_is_clocked_by_phase(rt: Runtime, scheduled: Scheduler):
    """The loop's phase clock (phases.py) sees an encode step's parts and a decode step's, each
    counted once: together no more than the time the loop ran them."""
    spec = SPECS[0]
    t0 = time.perf_counter()
    engine = encode(rt, spec, frames_for(spec, 8))
    ask(rt, engine.head, QUESTIONS[0], GenerationParams(max_tokens=4))
    # Read before the time is taken: the loop thread may close its last phase after the answer
    # has come back here, and that phase's end would then pass an elapsed time taken first.
    wall, cpu = dict(scheduled.phase_clock.wall), dict(scheduled.phase_clock.cpu)
    elapsed = time.perf_counter() - t0
    assert {"encode", "vision", "inputs", "plan", "prefill", "publish", "decode", "device wait"} <= set(wall)
    assert sum(wall.values()) <= elapsed
    assert all(0 <= cpu[name] <= wall[name] + 0.01 for name in wall)


def test_a_live_question_holds_no_version_while_it_waits_and_answers_from_the_head_it_starts_on(rt: Runtime):
    """A question given the stream's head as a source (a live question) binds a version only when it
    starts on the GPU: while it waits behind another it holds none, a chunk encoded meanwhile is in
    the version it answers from, and its answer (tokens, first logits, the version reported) is
    the inline answer on that version. A source that fails when it starts fails that question alone."""
    spec = SPECS[0]
    frames = frames_for(spec, 8)
    engine = encode(rt, spec, frames[:4])
    first = engine.head
    params = GenerationParams(max_tokens=6)
    scheduler = Scheduler(SchedulePolicy(max_batch=1))  # driven by hand: one question at a time
    rt.executor = scheduler
    try:
        busy = scheduler.submit(Generation(rt, first, QUESTIONS[0], params))
        live = Generation(rt, lambda: engine.head, QUESTIONS[1], params, keep_logits=True)
        scheduler.submit(live)

        def no_head():
            raise QuestionError("stream 'a': no frames yet")

        gone = scheduler.submit(Generation(rt, no_head, QUESTIONS[2], params))
        scheduler.step()
        assert not busy.done() and live.version is None, "waiting, it holds no version"
        chunk = engine.submit(engine.prepare(frames[4:], [k / spec.fps for k in range(4, 8)], range(4, 8)))
        for _ in range(100):
            if chunk.done() and live.future.done() and gone.done():
                break
            scheduler.step()
        engine.finish(chunk.result())
    finally:
        rt.executor = InlineExecutor()
    second = engine.head
    assert second.id == first.id + 1 and live.version is second, "bound to the head it started on"
    got, want = live.future.result(), ask(rt, second, QUESTIONS[1], params, keep_logits=True)
    assert got.token_ids == want.token_ids and torch.allclose(got.first_logits, want.first_logits, atol=1e-5, rtol=0)
    assert busy.result().token_ids == ask(rt, first, QUESTIONS[0], params).token_ids
    with pytest.raises(QuestionError, match="no frames yet"):
        gone.result()
    reported = ask(rt, lambda: engine.head, QUESTIONS[1], params)  # what `ask` reports: the version used
    assert (reported.version, reported.cache_tokens, reported.capture_range) == (
        second.id,
        second.tokens,
        second.capture_range,
    )
    assert reported.used is second and reported.token_ids == want.token_ids
