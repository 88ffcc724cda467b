"""Decode steps queued ahead (tiny-random, fp32, CPU): a step fed the step before's greedy picks
on the device, queued before the host reads that step (`Launched.ahead`), answers exactly as
steps read one by one do, also where a question stops at end of text with a step already
queued for it, and the scheduler runs them only while it would choose decoding anyway.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from common.engine.answer import Generation
from common.engine.grid import Grid, StreamSpec
from common.engine.kvcache import Version
from common.engine.model import load_model
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.scheduler import AHEAD_STEPS, SchedulePolicy, Scheduler
from common.engine.stream_engine import StreamEngine
from common.engine.work import InlineExecutor, run_ahead, start

SPEC = StreamSpec("a", 2, Grid(56, 84), 4)
QUESTIONS = ["What is happening?", "Is anything red?", "Describe the scene in detail, please."]


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


@pytest.fixture(scope="module")
def version(rt: Runtime) -> Version:
    rng = np.random.default_rng(7)
    frames = [rng.integers(0, 256, (SPEC.grid.height, SPEC.grid.width, 3), dtype=np.uint8) for _ in range(8)]
    engine = StreamEngine(rt, SPEC)
    for i in range(0, 8, 4):
        engine.append(frames[i : i + 4], [(i + k) / 2 for k in range(4)], list(range(i, i + 4)))
    return engine.head


def one_by_one(rt: Runtime, version: Version, question: str, params: GenerationParams, **kw) -> Generation:
    """The reference: each step launched only after the one before was read."""
    gen = Generation(rt, version, question, params, **kw)
    assert start(gen)
    while not gen.done:
        Generation.step_batch([gen])
    return gen


def ahead(gens: list[Generation]) -> tuple[int, int]:
    """Run `gens` to their ends, steps queued ahead wherever they may be: (steps, runs of them)."""
    for g in gens:
        assert start(g)
    steps = runs = 0
    while live := [g for g in gens if not g.done]:
        steps += run_ahead(Generation.launch_batch(live))
        runs += 1
    return steps, runs


def test_steps_queued_ahead_answer_as_steps_read_one_by_one(rt: Runtime, version: Version):
    lengths = [3, 6, 10]  # two leave the run of steps by length while it goes on
    want = [one_by_one(rt, version, q, GenerationParams(max_tokens=n)) for q, n in zip(QUESTIONS, lengths, strict=True)]
    kept = one_by_one(rt, version, QUESTIONS[0], GenerationParams(max_tokens=5), keep_logits=True)

    gens = [Generation(rt, version, q, GenerationParams(max_tokens=n)) for q, n in zip(QUESTIONS, lengths, strict=True)]
    gens.append(Generation(rt, version, QUESTIONS[0], GenerationParams(max_tokens=5), keep_logits=True))
    steps, runs = ahead(gens)

    assert runs < steps, "no step was queued ahead"
    for got, ref in zip(gens, [*want, kept], strict=True):
        assert got.future.result().token_ids == ref.future.result().token_ids
    assert torch.allclose(gens[-1].future.result().first_logits, kept.future.result().first_logits, atol=1e-5)


def test_a_question_stopping_with_a_step_queued_for_it_ends_there_and_gives_its_scratch_back(
    rt: Runtime, version: Version
):
    params = GenerationParams(max_tokens=8)
    tokens = one_by_one(rt, version, QUESTIONS[1], params).future.result().token_ids
    other = one_by_one(rt, version, QUESTIONS[2], params).future.result().token_ids
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])  # its first new token from the 3rd
    gc.collect()
    room = rt.lm.pool.room_tokens()

    stopping = Generation(rt, version, QUESTIONS[1], params)
    stopping.stops.add(tokens[k])  # as if that token were the end of text
    going = Generation(rt, version, QUESTIONS[2], params)
    steps, runs = ahead([stopping, going])

    done = stopping.future.result()
    assert (done.token_ids, done.stop) == (tokens[:k], "eos")
    assert going.future.result().token_ids == other
    assert runs < steps
    del stopping, going, done
    gc.collect()
    assert rt.lm.pool.room_tokens() == room, "a scratch region was not given back"


def test_the_scheduler_reports_each_step_run_ahead_and_stops_for_a_question_waiting(rt: Runtime, version: Version):
    reports: list[tuple[str, int]] = []
    late: list[Generation] = []

    def on_step(kind: str, seconds: float, units: int) -> None:
        reports.append((kind, units))
        if len(reports) == 1:  # a question arrives while the first run of steps is under way
            late.append(Generation(rt, version, QUESTIONS[1], GenerationParams(max_tokens=4)))
            scheduler.submit(late[0])

    scheduler = Scheduler(SchedulePolicy(), on_step=on_step)  # driven by hand: one decision a call
    first = Generation(rt, version, QUESTIONS[0], GenerationParams(max_tokens=3 * AHEAD_STEPS))
    scheduler.submit(first)
    try:
        scheduler.step()
        assert reports == [("decode", 1), ("decode", 1)], "the run went on past a question waiting to start"
        scheduler.step()  # the late one starts; both run ahead together
        # the late one's 4 steps beside the first's, then the first's alone
        assert reports[2:] == [("decode", 2)] * 4 + [("decode", 1)] * (AHEAD_STEPS - 4)
        while not (first.done and late[0].done):
            scheduler.step()
    finally:
        scheduler.stop()
    assert len(reports) == 3 * AHEAD_STEPS  # one report a step, each the steps its question took
    rt.executor = InlineExecutor()
    want = one_by_one(rt, version, QUESTIONS[0], GenerationParams(max_tokens=3 * AHEAD_STEPS))
    assert first.future.result().token_ids == want.future.result().token_ids


def test_the_question_benchmark_steps_its_batch_ahead_as_the_scheduler_would(rt: Runtime, version: Version):
    from scripts.bench_engine import batched_decode

    row = batched_decode(rt, [version] * 3, tokens=5)
    assert row["questions"] == 3 and row["aggregate_tok_s"] > 0
