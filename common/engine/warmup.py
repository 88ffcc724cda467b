"""Every kind of GPU step once, before a service takes work, so the first real ones do not stall.

On a GPU the first step of each shape class compiles (torch.compile specializes on a few: how
many attention parts merge, their strides, inference mode or not), captures a CUDA graph, or
builds vision kernels: seconds each, during which the one GPU loop stands still. Measured in the
pipeline: stalls of 3-5 s in the first minute, every camera and question waiting behind them.
So a worker walks throwaway streams through what serving does before it reports ready, on short
caches and on caches long enough for the paths of long caches (cuDNN bodies, split-KV): a batch
of chunks, questions prefilled together and decoded in batches of every warmed size, questions
joining a batch mid-decode, lone questions of a few lengths, an eviction round (caches
reaching their budget), cuDNN's graph for a chunk's body at every cache length bucket, and, where
the vision tower replays graphs, its graph for every batch size of chunks.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from common.engine.answer import Generation, question_suffix_ids
from common.engine.eviction import EvictionPolicy
from common.engine.frames import patchify, stack_frames
from common.engine.grid import Grid, StreamSpec
from common.engine.lm import (
    SPLIT_KV_MIN_TOKENS,
    BodyItem,
    _body_splits,
    cudnn_body_attention,
)
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.step_graphs import GRAPH_BASE_TOKENS, StepGraphs
from common.engine.stream_engine import ChunkWork, StreamEngine

GRID = Grid(448, 448)  # two such chunks in one batch reach the compiled vision blocks
# Decode and prefill graph buckets captured at start: every one. Larger ones left to first use were
# captured while serving, beside encode steps, and one such capture failed in cuBLAS and ended
# a worker (H200, 64 cameras and 32 askers, 2026-11-28; step_graphs.py now runs such a shape eagerly).
DECODE_BATCHES = StepGraphs.BUCKETS
PREFILL_LENGTHS = (16, 32, 64, 128)  # questions' length buckets prefilled in each batch; longer on first use


def warm_up(rt: Runtime, long_tokens: int | None = None, max_chunks: int = 8) -> float:
    """Run the steps inline (before a scheduler is installed); the seconds it took. `long_tokens`:
    how long the long caches are (default: long enough for split-KV and cuDNN bodies where flash
    runs them, else none). `max_chunks`: the most chunks an encode step batches (vision graphs of
    every batch size up to it)."""
    t0 = time.perf_counter()
    if long_tokens is None:  # long caches only where their own paths exist (flash: split-KV and cuDNN bodies)
        long_tokens = max(rt.lm.bodies.min_tokens, SPLIT_KV_MIN_TOKENS) if rt.lm.flash else 0
    patches = math.ceil(long_tokens / GRID.tokens_per_patch) + 1
    frames = list(np.random.default_rng(0).integers(0, 256, (4, GRID.height, GRID.width, 3), dtype=np.uint8))
    # A budget for everything the warm-up gives a stream, so that, like a serving stream's, its cache
    # lies in the one run of its budget from the start (see kvcache.py), and the steps below take
    # the paths serving takes (one causal range and the cuDNN body for chunks, one piece count for
    # questions): what they compile and capture now is what serving would otherwise stall for.
    chunk_patches = math.ceil(len(frames) / rt.loaded.temporal_patch_size)
    budget = len(rt.prefix_ids()) + (patches + chunk_patches) * GRID.tokens_per_patch
    policy = EvictionPolicy(max_cache_tokens=budget)
    engines = [
        StreamEngine(rt, StreamSpec(f"warm-up-{i}", 2.0, GRID, 4), policy) for i in range(rt.lm.bodies.min_items)
    ]
    _question_steps(rt, [e.head for e in engines])  # short caches: one piece per base
    for engine in engines:  # a cache at once, from made-up embeddings
        embeds = torch.zeros(patches * GRID.tokens_per_patch, rt.lm.embed_tokens.embedding_dim, device=rt.device)
        engine.append_embeddings(embeds, patches, (0, 2 * patches - 1), (0.0, float(patches)))
    batch = [ChunkWork(e, e.prepare(frames)) for e in engines]
    ChunkWork.run_batch(batch)
    for engine, work in zip(engines, batch, strict=True):
        engine.finish(work.future.result())
    _question_steps(rt, [e.head for e in engines])
    if long_tokens:
        _eviction_round(rt, frames, 2 * long_tokens)
    _cudnn_bodies(rt, chunk_patches * GRID.tokens_per_patch)
    if rt.vision_tower.graphs:
        _vision_batches(rt, frames, max_chunks)
    return time.perf_counter() - t0


def _vision_batches(rt: Runtime, frames: list[np.ndarray], max_chunks: int) -> None:
    """Batches of 1 to `max_chunks` chunks through the vision tower, each twice: a composition
    coming the second time is captured as a CUDA graph (vision.py)."""
    video = stack_frames(frames, GRID).to(rt.device)
    pixels = patchify(video, temporal_patch_size=rt.loaded.temporal_patch_size)
    for n in range(1, max_chunks + 1):
        for _ in range(2):
            rt.vision_batch([pixels] * n)


def _cudnn_bodies(rt: Runtime, rows: int, up_to: int = GRAPH_BASE_TOKENS) -> None:
    """cuDNN's graph for a chunk's body of every length bucket up to `up_to` tokens (a 32K
    camera's cache passes through each as it fills): each is built on its first call, and each
    chunk has its own body length (lm.cudnn_body_attention). Reads pool slots as they are; the
    output is thrown away."""
    if not rt.lm.cudnn or not rt.pool.slabs:
        return
    lm, layer = rt.lm, rt.pool.slabs[0][0]
    q = torch.zeros(rows, lm.n_heads, lm.head_dim, device=rt.device, dtype=lm.dtype)
    splits = _body_splits(rt.device, rows, lm.n_heads, lm.n_kv_heads, lm.bodies)
    for length in range(lm.bodies.min_tokens, min(up_to, layer.shape[2]) + 1, lm.bodies.bucket):
        cudnn_body_attention(q, layer, (BodyItem(0, length, rows),), splits, 1.0)


def _eviction_round(rt: Runtime, frames: list[np.ndarray], budget: int) -> None:
    """Caches of chunks reaching their budget, as every camera's does after a few minutes: half of
    them evict first, so that the next encode step mixes shortened caches with full ones whose chunks
    spill (read their caches as bases) and evict in it, then one of shortened caches only, and
    questions on them. The mixed step merges attention parts not stacked alike (`_merge`), which
    nothing else runs: serving compiled it at the cameras' first evictions, a step of 3.7-4.8 s in
    3 of 5 64-camera runs (H200). `budget` keeps a shortened cache long enough for the cuDNN body,
    as a 32K camera's is."""
    policy = EvictionPolicy(max_cache_tokens=len(rt.prefix_ids()) + budget)
    engines = [
        StreamEngine(rt, StreamSpec(f"warm-up-evict-{i}", 2.0, GRID, 4), policy) for i in range(rt.lm.bodies.min_items)
    ]
    chunk_tokens = 2 * GRID.tokens_per_patch
    for engine in engines:
        while engine.head.tokens + chunk_tokens <= policy.max_cache_tokens:
            _append_chunk(rt, engine)
    for engine in engines[::2]:
        _append_chunk(rt, engine)  # over its budget: it evicts now
    for _ in range(2):
        batch = [ChunkWork(e, e.prepare(frames)) for e in engines]
        ChunkWork.run_batch(batch)
        for engine, work in zip(engines, batch, strict=True):
            engine.finish(work.future.result())
    if any(e.head.stats.evictions == 0 for e in engines):
        raise RuntimeError("the warm-up's eviction round evicted nothing")  # the budget arithmetic is off
    _question_steps(rt, [e.head for e in engines])


def _append_chunk(rt: Runtime, engine: StreamEngine) -> None:
    """One chunk's worth of made-up embeddings (no vision forward): 4 frames, 2 temporal patches."""
    seq = engine.head.last_frame_seq + 1
    embeds = torch.zeros(2 * GRID.tokens_per_patch, rt.lm.embed_tokens.embedding_dim, device=rt.device)
    engine.append_embeddings(embeds, 2, (seq, seq + 3), (seq / 2, seq / 2 + 1.5))


def _question_steps(rt: Runtime, heads: list) -> None:
    """Questions of every warmed length arriving together in batches of every warmed size (each a
    prefill graph of its own: 8 questions of 64 tokens captured while serving stalled everything
    for 9 s), their decode steps, and a question joining them."""
    for tokens in PREFILL_LENGTHS:
        question = _question_of(rt, tokens)
        for n in DECODE_BATCHES:
            _questions(rt, [heads[i % len(heads)] for i in range(n)], question)


def _questions(rt: Runtime, heads: list, question: str) -> None:
    """`len(heads)` questions prefilled, decoded together, then one more joining them."""
    params = GenerationParams(max_tokens=4)
    gens = [Generation(rt, head, question, params) for head in heads]
    for _ in range(2):
        Generation.step_batch(gens)  # the prefills, then a decode step of all
    gens.append(Generation(rt, heads[0], "Anything else?", params))
    while not all(g.done for g in gens):
        Generation.step_batch([g for g in gens if not g.done])
    for g in gens:
        g.future.result()  # a failed warm-up step is a failed start


def _question_of(rt: Runtime, tokens: int) -> str:
    """A question of about `tokens` tokens in the template (at most that many)."""
    words = ["Describe"]
    while len(question_suffix_ids(rt, " ".join([*words, "what"]))) <= tokens:
        words.append("what")
    return " ".join(words)
