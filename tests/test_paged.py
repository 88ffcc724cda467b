"""The paged pool's promises, on CPU with tiny-random (fp32):

- accounting: streams with budget B fit in about B each, and all of them can evict at the same
  moment with nothing but the over-budget chunks on top (no 2x repack peak);
- snapshot isolation: a version somebody holds answers exactly as before, whatever the cache does
  after it (appends, a re-basing eviction, in place or copy-on-write, an exact eviction);
- pages that no version holds any more are back in the free list;
- a version in several extents answers exactly like the same cache in one.
"""

from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np
import pytest
import torch

from common.engine.answer import Generation, ask
from common.engine.grid import Grid, StreamSpec
from common.engine.kvcache import Version
from common.engine.lm import KVView
from common.engine.model import load_model
from common.engine.params import GenerationParams
from common.engine.pool import PoolFull
from common.engine.runtime import Runtime
from common.engine.scheduler import SchedulePolicy, Scheduler
from common.engine.stream_engine import ChunkWork, StreamEngine
from common.engine.work import InlineExecutor
from tests.engine_helpers import QUESTION, append_chunk, make_frames, policy_keeping, same_kv

GRID = Grid(56, 56)  # 4 tokens per temporal patch: a 4-frame chunk is 8 tokens
PAGE = 8  # pages the size of a chunk, which the prefix puts out of step with them


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"), page_tokens=PAGE)


def engine(rt: Runtime, name: str = "cam", mode: str = "rebase") -> StreamEngine:
    policy = policy_keeping(rt, 8 * 8, 4 * 8, sink_chunks=1, mode=mode, rebuild_piece_tokens=8)
    return StreamEngine(rt, StreamSpec(name, 2, GRID, 4), policy)


def feed(e: StreamEngine, frames, lo: int, hi: int) -> None:
    for i in range(lo, hi, 4):
        append_chunk(e, frames, i, 4)


def answer(rt: Runtime, v: Version):
    a = ask(rt, v, QUESTION, GenerationParams(max_tokens=6), keep_logits=True)
    return a.token_ids, a.first_logits


def same_answer(a, b) -> bool:
    return a[0] == b[0] and torch.allclose(a[1], b[1], atol=1e-5, rtol=0)


def pages(rt: Runtime, tokens: int) -> int:
    return rt.pool.pages_for(tokens) * PAGE


def first_slot(v: Version) -> tuple[int, int]:
    return v.view.extents[0].slab, v.view.extents[0].start


def test_streams_evict_all_at_once_within_their_budgets(rt):
    n = 6
    engines = [engine(rt, f"cam{k}") for k in range(n)]
    frames = make_frames(36, GRID)
    for e in engines:
        feed(e, frames, 0, 32)  # 8 chunks: at the budget
    budget = engines[0].cache.policy.max_cache_tokens
    assert all(e.head.stats.evictions == 0 and e.head.tokens == budget for e in engines)
    rt.pool.peak_tokens = used = rt.pool.used_tokens
    assert used == n * pages(rt, budget), "each stream holds its budget, in whole pages, and nothing else"
    batch = [ChunkWork(e, e.prepare(frames[32:36], [16, 16.5, 17, 17.5], range(32, 36))) for e in engines]
    ChunkWork.run_batch(batch)  # one prefill, then every stream evicts
    heads = [e.finish(j.future.result()) for e, j in zip(engines, batch, strict=True)]
    assert all(v.stats.evictions == 1 for v in heads)
    assert rt.pool.peak_tokens == used + n * pages(rt, 8), "on top of the budgets: only the chunks that went over"
    assert all(len(v.view.extents) == 1 for v in heads), "re-laid out in place, in one extent"
    del heads, batch
    assert rt.pool.used_tokens == used, "the over-budget chunks' pages are free again"


def test_held_versions_answer_as_before_through_appends_and_evictions(rt):
    frames = make_frames(96, GRID, seed=1)
    e = engine(rt)
    feed(e, frames, 0, 28)
    old = e.head
    want, kv = answer(rt, old), old.view.kv.clone()
    counted = dict(rt.pool.relayouts)
    feed(e, frames, 28, 36)  # appends, then a re-basing eviction while `old` is held
    assert e.head.stats.evictions == 1 and first_slot(e.head) != first_slot(old)
    assert len(e.head.view.extents) == 1, "copied whole, the prefix and sink too: one extent"
    assert rt.pool.relayouts == {**counted, "copied": counted["copied"] + 1}
    feed(e, frames, 36, 96)  # more evictions, in place now that only `old` holds the first pages
    assert e.head.stats.evictions >= 4
    assert rt.pool.relayouts["in_place"] - counted["in_place"] == e.head.stats.evictions - 1
    assert same_answer(answer(rt, old), want) and torch.equal(old.view.kv, kv)

    # the same stream with nobody holding anything: evicted in place, one extent, the same cache
    alone = engine(rt, "alone")
    feed(alone, frames, 0, 96)
    assert len(alone.head.view.extents) == 1
    assert same_kv(alone.head, e.head) and same_answer(answer(rt, alone.head), answer(rt, e.head))


def test_held_version_answers_as_before_through_an_exact_eviction(rt):
    frames = make_frames(48, GRID, seed=2)
    e = engine(rt, mode="exact")
    feed(e, frames, 0, 32)
    old = e.head
    want, kv = answer(rt, old), old.view.kv.clone()
    feed(e, frames, 32, 48)
    assert e.head.stats.evictions >= 1 and any(".r" in p.segment.id for p in e.head.chunks)
    assert len(e.head.view.extents) == 1, "the prefix and sink copied before the rebuilt chunks: one extent"
    assert same_answer(answer(rt, old), want) and torch.equal(old.view.kv, kv)


def held_pages(rt: Runtime, *engines: StreamEngine) -> int:
    """Tokens of the pages the engines' caches hold: their runs and their heads' extents."""
    held = set()
    for e in engines:
        for r in (e.cache._run, *e.head.view.extents):
            held |= {(r.slab, p) for p in range(r.start // PAGE, -(-r.end // PAGE))}
    return len(held) * PAGE


@pytest.mark.parametrize("mode", ["rebase", "exact"])
def test_pages_of_evicted_chunks_go_back_once_no_version_holds_them(rt, mode):
    frames = make_frames(40, GRID, seed=3)
    base = rt.pool.used_tokens
    e = engine(rt, mode=mode)
    feed(e, frames, 0, 32)
    old = e.head
    feed(e, frames, 32, 40)
    assert e.head.stats.evictions == 1
    assert rt.pool.used_tokens > base + held_pages(rt, e), "the held version keeps the evicted chunks"
    del old
    assert rt.pool.used_tokens == base + held_pages(rt, e)


def test_a_version_in_several_extents_answers_like_one_in_a_single_extent(rt):
    frames = make_frames(16, GRID, seed=4)
    e = engine(rt)
    feed(e, frames, 0, 16)
    head = e.head
    assert len(head.view.extents) == 1
    scattered, gaps = [], []
    for p in head.placements:  # every segment in its own region, a page apart
        gaps.append(rt.pool.alloc(PAGE))
        region = rt.pool.alloc(p.segment.tokens)
        region.kv[:, :, :, : p.segment.tokens] = head.view.read(p.offset, p.segment.tokens)
        scattered.append(rt.pool.hold(region.slab, region.start, p.segment.tokens))
    split = replace(head, view=KVView(tuple(scattered)))
    assert len(split.view.extents) == len(head.placements) and torch.equal(split.view.kv, head.view.kv)
    assert same_answer(answer(rt, split), answer(rt, head))


def test_warm_up_caches_lie_in_one_extent_as_serving_caches_do(rt, monkeypatch):
    """The warm-up's streams have a budget covering all it gives them, so their caches stay in one
    extent like a serving stream's: its batch of chunks reads each cache as one causal range (no
    base: the cuDNN body path on a GPU) and its questions read one-extent bases (the pieces, and so
    the CUDA graph keys, of serving). Unbudgeted, a long cache continues in a second run."""
    from common.engine import warmup

    made: list[StreamEngine] = []

    class Recorded(StreamEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    planned: list[list] = []
    plan = rt.lm.plan
    monkeypatch.setattr(rt.lm, "plan", lambda items, *a, **k: planned.append(list(items)) or plan(items, *a, **k))
    monkeypatch.setattr(warmup, "StreamEngine", Recorded)
    long_tokens = 5000  # past a fresh unbudgeted run (4096 tokens)
    used = rt.pool.used_tokens
    assert warmup.warm_up(rt, long_tokens=long_tokens) > 0
    first = [e for e in made if not e.spec.name.startswith("warm-up-evict")]
    evicting = [e for e in made if e.spec.name.startswith("warm-up-evict")]
    assert len(first) == len(evicting) == rt.lm.bodies.min_items
    for e in first:
        assert e.head.stats.evictions == 0 and e.head.tokens > long_tokens and len(e.head.chunks) == 2
        assert len(e.head.view.extents) == 1, "one extent, like a serving cache"
    for e in evicting:  # caches that reached their budget: evicted, re-laid out in place, one extent still
        assert e.head.stats.evictions >= 1 and len(e.head.view.extents) == 1
    chunk_tokens = first[0].head.chunks[-1].segment.tokens
    batches = [items for items in planned if len(items) == len(first) and all(it.n == chunk_tokens for it in items)]
    assert len(batches) == 3, "a batch of long caches, then two of the eviction round"
    for items in (batches[0], batches[2]):
        assert all(it.base is None and it.since == 0 for it in items), "one causal range each"
    # serving's first eviction step: shortened caches' chunks beside full caches' chunks, each of
    # which goes over its budget into a spill of its own, reading its cache as a base
    spills = [it for it in batches[1] if it.base is not None]
    assert len(spills) == len(evicting) // 2 and all(it.at == 0 and len(it.base.extents) == 1 for it in spills)
    bases = [it.base for items in planned for it in items if it.base is not None]
    assert bases and all(len(b.extents) == 1 for b in bases)
    made.clear(), planned.clear()
    del e, first, evicting, bases, batches, spills, items
    assert rt.pool.used_tokens == used, "the warm-up gives its pages back"


def test_a_chunk_the_cache_holds_already_is_refused_and_the_stream_goes_on(rt):
    """A segment is known by its id (its first frame's seq) in the cache's slot map: a second chunk
    under the same id would make a version point at the wrong slots, so it is refused with a clear
    error, nothing is published, and the next chunk lands as if it had never come."""
    frames = make_frames(12, GRID, seed=5)
    e, alone = engine(rt, "dup"), engine(rt, "no-dup")
    feed(e, frames, 0, 8)
    feed(alone, frames, 0, 8)
    head = e.head
    with pytest.raises(ValueError, match="in the cache already"):
        e.append(frames[8:12], [4, 4.5, 5, 5.5], range(4, 8))  # the seqs of the second chunk again
    assert e.head is head
    e.append(frames[8:12], [4, 4.5, 5, 5.5], range(8, 12))
    alone.append(frames[8:12], [4, 4.5, 5, 5.5], range(8, 12))
    assert len(e.head.view.extents) == 1 and same_kv(e.head, alone.head)


def test_a_cache_rewinds_to_an_earlier_version_of_its_layout(rt):
    """What benchmarks do to repeat a step on one cache: after a rewind the next chunk goes where
    the forgotten one went, and equals it; across an eviction there is nothing to rewind to."""
    frames = make_frames(40, GRID, seed=6)
    e = engine(rt, "rewind")
    feed(e, frames, 0, 16)
    base = e.head
    first = append_chunk(e, frames, 16, 4)
    kv = first.view.kv.clone()
    e.cache.rewind(base)
    assert e.head is base
    again = append_chunk(e, frames, 16, 4)
    assert again.view.extents[0].start == first.view.extents[0].start and torch.equal(again.view.kv, kv)
    feed(e, frames, 20, 40)
    assert e.head.stats.evictions >= 1
    with pytest.raises(ValueError, match="another layout"):
        e.cache.rewind(base)


def test_an_unbudgeted_cache_stays_one_extent_as_it_grows():
    """A stream without a budget (a QA mirror's, say) doubles its run: in place where the pages
    after it are free (tests/test_pool.py), else by copying the cache to a new run, never by
    continuing in a second extent. Versions taken along the way keep what they held; the cache
    equals one that grew without a neighbour."""
    rt = Runtime(load_model("tiny-random"), page_tokens=PAGE)
    dim = rt.lm.embed_tokens.embedding_dim
    chunks = [
        torch.randn(256 * GRID.tokens_per_patch, dim, generator=torch.Generator().manual_seed(k)) for k in range(9)
    ]

    def grow(e: StreamEngine, neighbour: StreamEngine | None = None) -> list[tuple[Version, torch.Tensor]]:
        held = []
        for k, embeds in enumerate(chunks):
            e.append_embeddings(embeds, 256, (k, k), (float(k), float(k)))
            held.append((e.head, e.head.view.kv.clone()))
            if neighbour is not None:  # takes the pages right after `e`'s run, so it cannot grow in place
                neighbour.append_embeddings(embeds[:256], 64, (k, k), (float(k), float(k)))
        return held

    crowded = StreamEngine(rt, StreamSpec("crowded", 2, GRID, 4))
    held = grow(crowded, StreamEngine(rt, StreamSpec("neighbour", 2, GRID, 4)))
    alone = StreamEngine(rt, StreamSpec("alone", 2, GRID, 4))
    grown_alone = grow(alone)
    assert crowded.head.tokens > 2 * 4096, "past two doublings of the first run"
    assert first_slot(held[-1][0]) != first_slot(held[0][0]), "copied to a new run"
    assert all(len(v.view.extents) == 1 for v, _ in held + grown_alone)
    assert all(torch.equal(v.view.kv, kv) for v, kv in held), "a held version changed"
    assert same_kv(crowded.head, alone.head)


def test_random_appends_evictions_and_holders_keep_every_promise():
    """A seeded random walk over three streams (re-basing, exact, unbudgeted) appending chunks
    while versions are taken and let go at random, so evictions go in place or copy-on-write as it
    falls: every held version stays as it was, every head is one extent, each cache equals the
    same stream encoded with nobody holding anything, and once everything is let go the pool is
    back where it started (no page leaked, none freed twice)."""
    rt = Runtime(load_model("tiny-random"), page_tokens=PAGE)
    base = rt.pool.used_tokens
    walk(rt, np.random.default_rng(1), make_frames(4 * 40, GRID, seed=8))
    gc.collect()
    assert rt.pool.used_tokens == base


def walk(rt: Runtime, rng: np.random.Generator, frames: list) -> None:
    def streams(tag: str) -> list[StreamEngine]:
        budgeted = [engine(rt, f"{tag}-rebase"), engine(rt, f"{tag}-exact", mode="exact")]
        return [*budgeted, StreamEngine(rt, StreamSpec(f"{tag}-open", 2, GRID, 4))]

    def unchanged(v: Version, kv: torch.Tensor) -> None:
        assert torch.equal(v.view.kv, kv), f"{v.stream} version {v.id} changed while held"

    walked, quiet = streams("walk"), streams("quiet")
    fed = [0, 0, 0]
    held: list[tuple[Version, torch.Tensor]] = []
    for _ in range(90):
        k = int(rng.integers(3))
        if fed[k] < len(frames):
            append_chunk(walked[k], frames, fed[k], 4)
            fed[k] += 4
        if rng.random() < 0.25:  # somebody takes a version (a question, a mirror's recent list)
            head = walked[int(rng.integers(3))].head
            held.append((head, head.view.kv.clone()))
            del head
        if held and rng.random() < 0.5:  # and somebody lets one go
            unchanged(*held.pop(int(rng.integers(len(held)))))
        assert all(len(e.head.view.extents) == 1 for e in walked)
    assert rt.pool.relayouts["copied"] > 0 and rt.pool.relayouts["in_place"] > 0, "both ways were walked"
    assert all(e.head.stats.evictions > 0 for e in walked[:2])
    for v in held:
        unchanged(*v)
    for e, q, n in zip(walked, quiet, fed, strict=True):
        for i in range(0, n, 4):
            append_chunk(q, frames, i, 4)
        assert same_kv(e.head, q.head), f"{e.spec.name} differs from the same stream with nobody holding"


def test_no_room_for_a_copy_fails_that_chunk_alone_and_the_stream_goes_on(rt, monkeypatch):
    """An eviction that must copy (a question holds the version it replaces) and finds no room in
    the pool fails the chunk that set it off, and only that: the stream's head stays what it was,
    another stream's chunk in the same batch is published, and once the old version is let go the
    stream goes on as if the chunk had never come. (A GPU's memory is what cannot run out here:
    the pool is made to refuse allocations of a whole cache.)"""
    frames = make_frames(40, GRID, seed=9)
    a, b, same = engine(rt, "full-a"), engine(rt, "full-b"), engine(rt, "full-same")
    for e in (a, b, same):
        feed(e, frames, 0, 32)  # at the budget: the next chunk evicts
    held, kv = a.head, a.head.view.kv.clone()
    budget, alloc = a.cache.policy.max_cache_tokens, rt.pool.alloc

    def no_room_for_a_cache(n_tokens: int):
        if n_tokens >= budget:
            raise PoolFull(f"no room for {n_tokens} more KV tokens (test)")
        return alloc(n_tokens)

    monkeypatch.setattr(rt.pool, "alloc", no_room_for_a_cache)
    times = [16, 16.5, 17, 17.5]
    batch = [ChunkWork(e, e.prepare(frames[32:36], times, range(32, 36))) for e in (a, b)]
    ChunkWork.run_batch(batch)
    with pytest.raises(PoolFull):
        batch[0].future.result()
    assert b.finish(batch[1].future.result()).stats.evictions == 1, "the other stream's chunk went on"
    assert a.head.id == held.id and torch.equal(a.head.view.kv, kv) and len(a.head.view.extents) == 1
    monkeypatch.undo()
    del held, batch
    feed(a, frames, 36, 40)  # the version is let go: this eviction goes in place
    feed(same, frames, 36, 40)  # the same stream, never sent the refused chunk
    assert a.head.stats.evictions == 1 and same_kv(a.head, same.head)


def room_rule_run(rt: Runtime, rule: bool):
    """Three streams at their budget, a live question on each (the two first fit the pool's room
    with one eviction copy each, the third does not) and a chunk on each that evicts, through a
    scheduler driven by hand over a pool that refuses past its limit. Returns the order questions
    started and finished in, and each chunk's outcome."""
    frames = make_frames(40, GRID, seed=11)
    engines = [engine(rt, f"room-{rule}-{k}") for k in range(3)]
    for e in engines:
        feed(e, frames, 0, 32)  # at the budget: the next chunk evicts
    gc.collect()
    params = GenerationParams(max_tokens=6)
    copy = rt.pool.pages_for(engines[0].head.run_tokens) * PAGE  # what an eviction beside a question copies
    assert copy >= engines[0].head.tokens
    scratch = Generation(rt, engines[0].head, QUESTION, params).scratch_tokens()
    limit = rt.pool.used_tokens + 2 * (copy + scratch) + 3 * PAGE + copy // 2  # two copies and 3 spills, not three
    alloc = rt.pool.alloc

    def limited(n_tokens: int):
        if rt.pool.used_tokens + rt.pool.pages_for(n_tokens) * PAGE > limit:
            raise PoolFull(f"no room for {n_tokens} more KV tokens (test: a pool of {limit})")
        return alloc(n_tokens)

    order: list[tuple[str, int]] = []
    # no decoding beside encode steps: the questions are still reading when the chunks evict
    policy = SchedulePolicy(decode_during_encode=False)
    scheduler = Scheduler(policy, room=(lambda: limit - rt.pool.used_tokens) if rule else None)
    rt.executor, rt.pool.alloc = scheduler, limited
    try:
        asked = []
        for k, e in enumerate(engines):
            work = Generation(rt, lambda e=e: e.head, QUESTION, params, on_start=lambda k=k: order.append(("start", k)))
            work.stops = set()  # every question answers max_tokens
            work.future.add_done_callback(lambda _, k=k: order.append(("done", k)))
            asked.append(scheduler.submit(work))
            del work  # only the scheduler holds it: its version is let go of when it is done
        times = [16, 16.5, 17, 17.5]
        chunks = [e.submit(e.prepare(frames[32:36], times, range(32, 36))) for e in engines]
        for _ in range(200):
            if all(f.done() for f in asked + chunks):
                break
            scheduler.step()
        outcomes = [c.exception() or e.finish(c.result()) for e, c in zip(engines, chunks, strict=True)]
    finally:
        rt.executor, rt.pool.alloc = InlineExecutor(), alloc
    return order, outcomes, [f.exception() for f in asked]


def test_questions_start_only_while_the_cameras_keep_room_to_evict(rt):
    """With room in the pool for two eviction copies, questions on two streams start, the one on
    a third stream waits until one of them is done, and every stream's chunk evicts (two by a
    copy around the questions' versions) without `PoolFull`. Without the rule all three start
    and a chunk finds no room."""
    copied = rt.pool.relayouts["copied"]
    order, outcomes, failed = room_rule_run(rt, rule=True)
    assert rt.pool.relayouts["copied"] - copied == 2, "two evictions copied around the questions' versions"
    assert not any(failed) and all(isinstance(v, Version) and v.stats.evictions == 1 for v in outcomes), outcomes
    assert order[:2] == [("start", 0), ("start", 1)], order
    first_done = min(order.index(("done", 0)), order.index(("done", 1)))
    assert order.index(("start", 2)) > first_done, f"the third started before room was given back: {order}"
    order, outcomes, failed = room_rule_run(rt, rule=False)
    assert order[:3] == [("start", 0), ("start", 1), ("start", 2)], order
    assert any(isinstance(v, PoolFull) for v in outcomes), "the oracle: without the rule a camera finds no room"


def test_with_no_room_at_all_questions_still_go_one_at_a_time(rt):
    """A pool too small for the rule never holds questions forever: with none active, one starts."""
    e = engine(rt, "no-room")
    feed(e, make_frames(8, GRID, seed=12), 0, 8)
    params = GenerationParams(max_tokens=4)
    order: list[tuple[str, int]] = []
    scheduler = Scheduler(room=lambda: 0)
    rt.executor = scheduler
    try:
        asked = []
        for k in range(2):
            work = Generation(rt, lambda: e.head, QUESTION, params, on_start=lambda k=k: order.append(("start", k)))
            work.future.add_done_callback(lambda _, k=k: order.append(("done", k)))
            asked.append(scheduler.submit(work))
        for _ in range(50):
            if all(f.done() for f in asked):
                break
            scheduler.step()
    finally:
        rt.executor = InlineExecutor()
    assert order == [("start", 0), ("done", 0), ("start", 1), ("done", 1)]
    want = ask(rt, e.head, QUESTION, params).token_ids
    assert [f.result().token_ids for f in asked] == [want, want]
