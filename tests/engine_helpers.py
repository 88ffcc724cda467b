"""Shared by the engine oracles: frames, streaming a list of frames, and the one-shot comparison."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from common.engine.answer import ask
from common.engine.eviction import EvictionPolicy
from common.engine.grid import Grid, StreamSpec
from common.engine.kvcache import Version
from common.engine.lm import Item, KVView, LanguageModel
from common.engine.offline import offline_answer
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.stream_engine import Appended, StreamEngine

QUESTION = "What is happening in the video?"


def make_frames(n: int, grid: Grid, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (grid.height, grid.width, 3), dtype=np.uint8) for _ in range(n)]


def submit_chunk(engine: StreamEngine, frames: list[np.ndarray], i: int, chunk: int) -> Future[Appended]:
    """Frames i..i+chunk of `frames` as one chunk, queued; frame k is captured at k / fps and has seq k."""
    part = frames[i : i + chunk]
    fps = engine.spec.fps
    return engine.submit(engine.prepare(part, [(i + k) / fps for k in range(len(part))], range(i, i + len(part))))


def append_chunk(engine: StreamEngine, frames: list[np.ndarray], i: int, chunk: int) -> Version:
    """`submit_chunk`, waited for and published."""
    return engine.finish(submit_chunk(engine, frames, i, chunk).result())


def stream(
    rt: Runtime,
    frames,
    grid: Grid,
    fps: float,
    chunk: int,
    policy: EvictionPolicy | None = None,
    name: str = "cam",
):
    engine = StreamEngine(rt, StreamSpec(name, fps, grid, chunk), policy)
    for i in range(0, len(frames), chunk):
        append_chunk(engine, frames, i, chunk)
    return engine


def kept_frames(version: Version, frames: list[np.ndarray]) -> list[np.ndarray]:
    """The frames a version still holds, in order (frame seq = index into `frames`)."""
    return [f for p in version.chunks for f in frames[p.segment.frame_seqs[0] : p.segment.frame_seqs[1] + 1]]


@dataclass
class Comparison:
    tokens_equal: bool
    max_logit_diff: float

    @property
    def equal(self) -> bool:
        """Greedy tokens equal and first-token logits within 1e-4: the engine's oracle."""
        return self.tokens_equal and self.max_logit_diff <= 1e-4


def compare_with_offline(
    rt: Runtime, version: Version, frames: list[np.ndarray], grid: Grid, fps: float, max_tokens: int = 12
) -> Comparison:
    """A streamed answer on `version` against one-shot inference over `frames`."""
    streamed = ask(rt, version, QUESTION, GenerationParams(max_tokens=max_tokens), keep_logits=True)
    offline = offline_answer(rt, frames, grid, fps, QUESTION, max_tokens=max_tokens)
    diff = float((streamed.first_logits.cpu() - offline.first_logits).abs().max())
    assert len(offline.token_ids) > 0
    return Comparison(streamed.token_ids == offline.token_ids, diff)


def policy_keeping(rt: Runtime, budget_video_tokens: int, keep_video_tokens: int, **kw: object) -> EvictionPolicy:
    """A policy that evicts above `budget_video_tokens` video tokens down to `keep_video_tokens`."""
    prefix = len(rt.prefix_ids())
    budget = prefix + budget_video_tokens
    return EvictionPolicy(max_cache_tokens=budget, low_watermark=(prefix + keep_video_tokens) / budget, **kw)  # type: ignore[arg-type]


def same_kv(a: Version, b: Version, atol: float = 1e-5) -> bool:
    n = a.tokens
    return b.tokens == n and torch.allclose(a.view.kv[:, :, :, :n], b.view.kv[:, :, :, :n], atol=atol)


def items_over_one_cache(
    rt: Runtime, cache_tokens: int, items: list[tuple[int, int, tuple[tuple[int, int], ...]]]
) -> list[Item]:
    """A cache of `cache_tokens` random K/V, and per (new tokens, at, base ranges of the cache) an
    item writing into 64 random scratch slots at `at` over a base of those ranges (a range each an
    extent). Seeded: call `torch.manual_seed` first."""
    cache = rt.pool.alloc(cache_tokens)
    cache.kv.normal_()
    out = []
    for n, at, ranges in items:
        scratch = rt.pool.alloc(64)
        scratch.kv.normal_()
        base = KVView(tuple(rt.pool.hold(cache.slab, cache.start + a, k) for a, k in ranges))
        out.append(Item(n, scratch, at, base=base))
    return out


@contextmanager
def exact_attention(lm: LanguageModel) -> Iterator[None]:
    """The CPU path's attention (exact, fp32, piece by piece) on any device, for the block."""
    saved = lm.flash, lm.decode_kernel, lm.decode_combine
    lm.flash, lm.decode_kernel, lm.decode_combine = False, None, None
    try:
        yield
    finally:
        lm.flash, lm.decode_kernel, lm.decode_combine = saved
