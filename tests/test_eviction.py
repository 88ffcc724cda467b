"""Oracles for eviction (tiny-random, fp32, CPU).

With `exact` eviction, after any number of evictions an answer equals one-shot transformers
inference over the prompt built from only the frames the cache still holds: greedy tokens equal
and first-token logits within 1e-4. The same comparison with `rebase` must fail (its retained
chunks keep K/V computed while evicted chunks were there), so the oracle cannot pass vacuously.
Salient chunks ("star memory") keep scene changes through many evictions, still exactly.

An exact eviction's rebuild runs in pieces through the scheduler, batched with other streams'
chunks; the result equals the rebuild done alone, and a question on the version before the
eviction gets the same answer while the rebuild is under way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest
import redis
import torch

from apps import status
from apps.samplevideo import render_scene, write_scenes_video
from common.config import ConfigError, load_config
from common.engine.answer import Answer, Decoded, Generation, ask
from common.engine.eviction import EvictionPolicy
from common.engine.frames import frames_to_pixels
from common.engine.grid import Grid, StreamSpec, resize_to_grid
from common.engine.model import load_model
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.salience import mean_embedding, salience
from common.engine.scheduler import SchedulePolicy, Scheduler
from common.engine.stream_engine import ChunkWork, StreamEngine
from common.engine.work import InlineExecutor
from common.wire import keys
from common.wire.manifest import to_manifest
from common.wire.schemas import manifest_to_bytes
from encoder_worker.config import EncoderConfig
from ingest.video import iter_file_frames
from tests.engine_helpers import (  # executor: a fixture
    QUESTION,
    append_chunk,
    compare_with_offline,
    kept_frames,
    make_frames,
    policy_keeping,
    same_kv,
    stream,
    submit_chunk,
)

GRID = Grid(56, 56)  # 4 tokens per temporal patch (2 frames)


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


# fps (0.75 and 3: fractional seconds per grid), sink chunks, frames per chunk
CASES = [(1, 1, 4), (3, 0, 2), (0.75, 2, 6), (2, 2, 2), (3, 1, 6), (0.75, 0, 4)]
PIECE = 6  # tokens re-prefilled per step: pieces cut through patches and chunks, which must not matter


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["exact", "rebase"])
@pytest.mark.parametrize(("fps", "sink", "chunk"), CASES, ids=[f"fps{f}-sink{s}-chunk{c}" for f, s, c in CASES])
def test_answer_after_evictions_equals_one_shot_on_the_retained_frames(rt, executor, mode, fps, sink, chunk):
    chunk_tokens = 2 * chunk  # chunk / 2 patches of 4 tokens
    budget, keep = (sink + 4) * chunk_tokens, (sink + 2) * chunk_tokens
    policy = policy_keeping(rt, budget, keep, sink_chunks=sink, mode=mode, rebuild_piece_tokens=PIECE)
    frames = make_frames((sink + 14) * chunk, GRID, seed=chunk + sink)
    engine = StreamEngine(rt, StreamSpec("cam", fps, GRID, chunk), policy)
    compared = []
    for i in range(0, len(frames), chunk):
        evictions = engine.head.stats.evictions
        version = append_chunk(engine, frames, i, chunk)
        if version.stats.evictions > evictions:  # right after each eviction: the hardest moment
            compared.append(compare_with_offline(rt, version, kept_frames(version, frames), GRID, fps))
    assert len(compared) >= 3 and engine.head.stats.chunks_evicted >= 6
    if mode == "exact":
        assert all(c.equal for c in compared), compared
    else:  # today's re-basing: positions right, deeper layers not; the equality must fail
        assert not any(c.equal for c in compared), compared
        assert max(c.max_logit_diff for c in compared) > 1e-2


def test_exact_eviction_renames_only_the_chunks_it_prefilled_again(rt):
    policy = policy_keeping(rt, 6 * 8, 3 * 8, sink_chunks=1, mode="exact")
    frames = make_frames(40, GRID)
    engine = stream(rt, frames[:24], GRID, 2, 4, policy)  # 6 chunks: at the budget
    before = engine.head
    assert before.stats.evictions == 0 and not any(".r" in p.segment.id for p in before.placements)
    after = append_chunk(engine, frames, 24, 4)
    assert after.stats.evictions == 1
    ids = [p.segment.id for p in after.placements]
    # prefix and sink untouched (nothing before them changed); the rest re-prefilled at eviction 1
    assert ids[:2] == ["prefix", "f000000000000"] and all(i.endswith(".r1") for i in ids[2:])
    assert all(not any(p.t_delta) and p.segment.first_patch == p.first_patch for p in after.chunks)
    assert set(engine.cache.embeds) == {p.segment.chunk_id for p in after.chunks}
    assert same_kv(after, stream(rt, kept_frames(after, frames), GRID, 2, 4).head)


def test_salient_chunks_keep_scene_changes_through_many_evictions_exactly(rt, tmp_path):
    scene_seconds = [7, 5, 8, 6, 9]  # scene changes at 7, 12, 20 and 26 s
    video = write_scenes_video(str(tmp_path / "scenes.mp4"), scene_seconds, fps=10)
    fps, chunk = 2.0, 2  # one chunk per second: frame seq 2t starts the chunk at t seconds
    frames = [resize_to_grid(f.rgb, GRID) for f in iter_file_frames(video, fps)]
    assert len(frames) == 70
    changes = {14, 24, 40, 52}

    def run(salient_chunks: int) -> StreamEngine:
        policy = policy_keeping(rt, 10 * 4, 7 * 4, sink_chunks=1, mode="exact", salient_chunks=salient_chunks)
        return stream(rt, frames, GRID, fps, chunk, policy)

    head = run(salient_chunks=4).head
    kept = {p.segment.frame_seqs[0] for p in head.chunks}
    assert head.stats.evictions >= 5 and changes <= kept, sorted(kept)
    assert head.capture_ranges == [(0.0, 0.5), (7.0, 7.5), (12.0, 12.5), (20.0, 20.5), (26.0, 26.5), (33.0, 34.5)]
    assert compare_with_offline(rt, head, kept_frames(head, frames), GRID, fps).equal
    recent_only = run(salient_chunks=0).head  # control: without salient chunks they are gone
    assert not changes & {p.segment.frame_seqs[0] for p in recent_only.chunks}


def test_policy_evicts_ordinary_chunks_first_and_salient_ones_least_salient_first():
    policy = EvictionPolicy(max_cache_tokens=10, low_watermark=0.5, sink_chunks=1, salient_chunks=2)
    tokens = [1] * 10  # prefix 1 + 10 = 11 > 10: down to 5
    scores = [0.0, 0.9, 0.0, 0.0, 0.5, 0.0, 0.7, 0.0, 0.0, 0.0]
    assert policy.chunks_to_evict(1, tokens, scores) == [2, 3, 4, 5, 7, 8]  # 1 and 6 stay, 4 is third
    tight = EvictionPolicy(max_cache_tokens=10, low_watermark=0.3, sink_chunks=1, salient_chunks=2)
    assert tight.chunks_to_evict(1, tokens, scores) == [1, 2, 3, 4, 5, 6, 7, 8]  # the budget wins
    assert EvictionPolicy(10, 0.5, 1).chunks_to_evict(1, tokens, scores) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="mode"):
        EvictionPolicy(mode="fresh")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="salient"):
        EvictionPolicy(salient_chunks=-1)
    with pytest.raises(ValueError, match="rebuild_piece_tokens"):
        EvictionPolicy(rebuild_piece_tokens=0)


def test_salience_is_zero_for_a_static_scene_and_large_at_a_change(rt):
    scenes = [resize_to_grid(render_scene(i, width=112, height=112), GRID) for i in range(2)]
    means = [mean_embedding(rt.vision(*frames_to_pixels([f, f], GRID))) for f in scenes]
    assert salience(means[0], means[0]) == pytest.approx(0.0, abs=1e-6)
    assert salience(means[0], means[1]) > 1e-3 and salience(None, means[1]) == 0.0


def test_eviction_setting_keeps_the_rebase_flag_working():
    base = {"SVQA_STREAMS": "cam"}
    assert load_config(EncoderConfig, [], base).eviction_policy().mode == "rebase"
    assert load_config(EncoderConfig, [], base | {"SVQA_REBASE": "false"}).eviction_policy().mode == "absolute"
    assert load_config(EncoderConfig, ["--no-rebase"], base).eviction_policy().mode == "absolute"
    cfg = load_config(EncoderConfig, ["--eviction", "exact", "--salient-chunks", "3"], base)
    assert (cfg.eviction_policy().mode, cfg.eviction_policy().salient_chunks) == ("exact", 3)
    with pytest.raises(ConfigError, match="contradicts"):
        load_config(EncoderConfig, ["--eviction", "exact", "--no-rebase"], base)
    with pytest.raises(ConfigError, match=r"SVQA_EVICTION.*not one of"):
        load_config(EncoderConfig, [], base | {"SVQA_EVICTION": "fresh"})
    with pytest.raises(ConfigError, match="salient"):
        load_config(EncoderConfig, ["--salient-chunks", "-1"], base)


def test_status_reports_every_range_a_version_holds(rt, redis_url):
    policy = policy_keeping(rt, 6 * 4, 4 * 4, sink_chunks=1)
    engine = stream(rt, make_frames(24, GRID), GRID, 2, 2, policy)
    head = engine.head
    assert len(head.capture_ranges) == 2
    r = redis.Redis.from_url(redis_url)
    r.set(keys.head("cam"), manifest_to_bytes(to_manifest(head, engine.spec)))
    (cam,) = status.collect(r)["streams"]
    assert cam["head"]["ranges"] == [list(x) for x in head.capture_ranges]
    assert json.loads(json.dumps(cam))["head"]["ranges"][1][1] == 11.5
    assert "0.0-0.5s,7.0-11.5s" in status.render(status.collect(r))


def test_benchmark_hook_runs_on_cpu(rt):
    from scripts.bench_engine import bench_eviction_cost

    prefix = len(rt.prefix_ids())
    cost = bench_eviction_cost(rt, budget=prefix + 10 * 8, side=56, cycles=2)
    assert cost["rebase"]["evictions"] == cost["exact"]["evictions"] == 3
    assert cost["rebase"]["kept_embeds_mib"] == 0 and cost["exact"]["kept_embeds_mib"] > 0
    assert all(c["amortized_chunk_ms"] > 0 and c["measured_chunks"] >= 4 for c in cost.values())


# -- the rebuild as the scheduler's work ---------------------------------------------------------
# These drive a Scheduler step by step from the test (no loop thread), so what each step runs is
# certain; spies on the real work record it.

B_GRID = Grid(84, 56)  # another stream "b" (3 fps, 2-frame chunks) on another grid, no eviction


@pytest.fixture
def stepped(rt: Runtime, monkeypatch) -> Iterator[tuple[Scheduler, list[list[str]]]]:
    """A scheduler driven by hand, and what each of its steps ran: "question" for a decode step
    ("beside" for one launched between the layers of an encode step's forward),
    "<stream>:chunk" or "<stream>:rebuild" for each work of an encode step."""
    ran: list[list[str]] = []
    run_batch, launch_batch = ChunkWork.run_batch, Generation.launch_batch
    # encode_share 1.0: an encode step follows every question step (a piece between tokens)
    scheduler = Scheduler(SchedulePolicy(max_batch=8, max_chunks=4, encode_share=1.0))

    def chunks(cls, batch):
        if rt.executor is scheduler:
            ran[-1].extend(f"{j.lane}:{'rebuild' if j.rebuild else 'chunk'}" for j in batch)
        run_batch(batch)

    def questions(cls, batch, alongside=False):
        if rt.executor is scheduler:
            ran[-1].append("beside" if alongside else "question")
        return launch_batch(batch, alongside)

    monkeypatch.setattr(ChunkWork, "run_batch", classmethod(chunks))
    monkeypatch.setattr(Generation, "launch_batch", classmethod(questions))
    yield scheduler, ran
    rt.executor = InlineExecutor()


def drive(scheduler: Scheduler, ran: list[list[str]], futures: list[Future], check: Callable[[], None]) -> None:
    """Step until every future is done, calling `check` after each step."""
    for _ in range(200):
        if all(f.done() for f in futures):
            return
        ran.append([])
        scheduler.step()
        check()
    raise AssertionError(f"not done after 200 steps: {ran}")


def exact_stream(rt: Runtime, frames, n_chunks: int) -> StreamEngine:
    """Stream "a" (2-frame chunks of 4 tokens) with `n_chunks` appended alone, exact eviction at 7
    chunks down to 3, rebuilds in 3-token pieces: the 7th chunk's rebuild (its last two chunks,
    8 tokens) takes 3 pieces."""
    policy = policy_keeping(rt, 6 * 4, 3 * 4, sink_chunks=1, mode="exact", rebuild_piece_tokens=3)
    return stream(rt, frames[: 2 * n_chunks], GRID, 2, 2, policy, name="a")


def same_answer(got: Answer | Decoded, want: Answer | Decoded) -> bool:
    """Greedy tokens equal and first-token logits within 1e-4."""
    return got.token_ids == want.token_ids and torch.allclose(got.first_logits, want.first_logits, atol=1e-4, rtol=0)


def test_exact_rebuild_is_batched_with_other_streams_chunks_and_equals_it_alone(rt, stepped):
    scheduler, ran = stepped
    frames, b_frames = make_frames(14, GRID, seed=5), make_frames(8, B_GRID, seed=6)
    a, b = exact_stream(rt, frames, 6), stream(rt, b_frames[:2], B_GRID, 3, 2, name="b")
    before = a.head
    rt.executor = scheduler  # a's evicting chunk and three of b's, queued together
    rebuilt, *b_chunks = [submit_chunk(a, frames, 12, 2)] + [submit_chunk(b, b_frames, i, 2) for i in (2, 4, 6)]

    def head_stays_until_rebuilt() -> None:
        assert a.head is before or rebuilt.done(), "a half-rebuilt version was published"

    drive(scheduler, ran, [rebuilt, *b_chunks], head_stays_until_rebuilt)
    rt.executor = InlineExecutor()
    assert ran == [["a:chunk", "b:chunk"], ["b:chunk", "a:rebuild"], ["b:chunk", "a:rebuild"], ["a:rebuild"]]
    after = a.finish(rebuilt.result())
    for f in b_chunks:
        b.finish(f.result())
    assert after.stats.evictions == 1
    assert [p.segment.id for p in after.chunks] == ["f000000000000", "f000000000010.r1", "f000000000012.r1"]

    # the same chunks, one thing at a time; and a fresh encode of the frames a keeps
    alone_a, alone_b = exact_stream(rt, frames, 7), stream(rt, b_frames, B_GRID, 3, 2, name="b")
    assert same_kv(after, alone_a.head) and same_kv(b.head, alone_b.head)
    params = GenerationParams(max_tokens=8)
    got, want = (ask(rt, v, QUESTION, params, keep_logits=True) for v in (after, alone_a.head))
    assert same_answer(got, want)
    assert same_kv(after, stream(rt, kept_frames(after, frames), GRID, 2, 2).head)


def test_a_question_on_the_version_before_an_eviction_is_unchanged_by_the_rebuild(rt, stepped):
    scheduler, ran = stepped
    frames = make_frames(14, GRID, seed=7)
    params = GenerationParams(max_tokens=6)
    a = exact_stream(rt, frames, 6)
    before, kv = a.head, a.head.view.kv[:, :, :, : a.head.tokens].clone()
    want = ask(rt, before, QUESTION, params, keep_logits=True)

    rt.executor = scheduler
    chunk = submit_chunk(a, frames, 12, 2)
    ran.append([])
    scheduler.step()  # the chunk is prefilled and sets off the eviction
    question = scheduler.submit(Generation(rt, before, QUESTION, params, keep_logits=True))

    def head_stays_until_rebuilt() -> None:
        assert a.head is before or chunk.done(), "a half-rebuilt version was published"

    drive(scheduler, ran, [chunk, question], head_stays_until_rebuilt)
    rt.executor = InlineExecutor()
    # the question goes first, then decodes beside the rebuild's pieces until it is answered
    assert ran[0] == ["a:chunk"] and ran[1][:3] == ["question", "a:rebuild", "beside"]
    assert all("a:rebuild" in step for step in ran[1:-1])
    assert same_answer(question.result(), want)
    assert torch.equal(before.view.kv[:, :, :, : before.tokens], kv)
    after = a.finish(chunk.result())
    assert after.stats.evictions == 1 and a.head is after
    assert same_kv(after, stream(rt, kept_frames(after, frames), GRID, 2, 2).head)
