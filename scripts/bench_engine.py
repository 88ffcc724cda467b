"""Engine benchmark: prints one JSON object. Run on a GPU with random-3b (real 3B compute).

    python scripts/bench_engine.py --model random-3b --sizes 8192,32768,100000

Measures: vision ms per 4-frame chunk (448², 896²); chunk prefill ms, question first-token
latency and decode tokens/s at each cache size; the stateless baseline (transformers'
own forward re-prefilling the whole context for each question); GPU memory over a long
stream with eviction.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime

import numpy as np
import torch

from common.answer import GenerationParams, ask
from common.engine import Runtime, StreamEngine, StreamSpec
from common.eviction import EvictionPolicy
from common.frames import Grid, frames_to_pixels
from common.model import load_model

QUESTION = "What is he doing?"  # 32 tokens with the question template, as in the reference numbers


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat: int = 5, warmup: int = 2) -> float:
    """Median milliseconds of `fn()`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def bench_vision(rt: Runtime, side: int) -> dict:
    grid = Grid(side, side)
    frames = np.random.default_rng(0).integers(0, 256, (4, side, side, 3), dtype=np.uint8)
    pixels, grid_thw = frames_to_pixels(frames, grid)
    ms = timed(lambda: rt.vision(pixels, grid_thw))
    return {"side": side, "tokens": grid.tokens_per_patch * 2, "vision_ms": round(ms, 1)}


def filled_engine(rt: Runtime, n_tokens: int, slab: int = 4096) -> StreamEngine:
    """A 448² stream whose cache holds ~n_tokens video tokens, prefilled in slabs of random
    embeddings (the LM cost of a cache depends on its size, not its content)."""
    engine = StreamEngine(rt, StreamSpec("bench", 2.0, Grid(448, 448), 4))
    per_patch = 256
    while (room := (n_tokens - engine.head.tokens) // per_patch * per_patch) > 0:
        n_patches = min(slab, room) // per_patch
        embeds = torch.randn(n_patches * per_patch, rt.lm.embed_tokens.embedding_dim, device=rt.lm.device,
                             dtype=rt.lm.dtype) * 0.02  # fmt: skip
        engine.append_embeddings(embeds, n_patches, (0, 0), (0.0, 0.0))
    return engine


def bench_cache_size(rt: Runtime, n_tokens: int, decode_tokens: int) -> dict:
    engine = filled_engine(rt, n_tokens)
    chunk = torch.randn(512, rt.lm.embed_tokens.embedding_dim, device=rt.lm.device, dtype=rt.lm.dtype) * 0.02
    base = engine.head

    def prefill_chunk() -> None:
        engine.append_embeddings(chunk, 2, (0, 0), (0.0, 0.0))
        engine.cache.head = base  # roll back so every repeat sees the same cache size

    prefill_ms = timed(prefill_chunk)
    first = [ask(rt, base, QUESTION, GenerationParams(max_tokens=1)).first_token_s * 1000 for _ in range(7)][2:]
    decode = ask(rt, base, QUESTION, GenerationParams(max_tokens=decode_tokens))
    return {
        "cache_tokens": base.tokens,
        "chunk_prefill_ms": round(prefill_ms, 1),
        "first_token_ms": round(statistics.median(first), 1),
        "decode_tok_s": round(decode.tokens_per_s, 1),
        "decoded_tokens": len(decode.token_ids),
        "question_tokens": len(rt.encode(QUESTION)),
        "stateless_first_token_ms": round(stateless_first_token_ms(rt, base.tokens), 1),
    }


@torch.inference_mode()
def stateless_first_token_ms(rt: Runtime, n_tokens: int) -> float:
    """Baseline without a persistent cache: transformers re-prefills context + question."""
    text = rt.loaded.model.model.language_model
    n = n_tokens + len(rt.encode(QUESTION)) + 20
    embeds = torch.randn(1, n, text.config.hidden_size, device=rt.lm.device, dtype=rt.lm.dtype) * 0.02
    pos = torch.arange(n, device=rt.lm.device).view(1, 1, n).expand(3, 1, n)

    def run() -> None:
        hidden = text(inputs_embeds=embeds, position_ids=pos, use_cache=False).last_hidden_state
        rt.loaded.model.lm_head(hidden[:, -1])

    return timed(run, repeat=3, warmup=1)


def bench_long_stream(rt: Runtime, chunks: int, budget: int) -> dict:
    engine = StreamEngine(rt, StreamSpec("long", 2.0, Grid(448, 448), 4), EvictionPolicy(max_cache_tokens=budget))
    chunk = torch.randn(512, rt.lm.embed_tokens.embedding_dim, device=rt.lm.device, dtype=rt.lm.dtype) * 0.02
    samples = []
    for i in range(chunks):
        v = engine.append_embeddings(chunk, 2, (i, i), (float(i), float(i)))
        if i % max(1, chunks // 20) == 0 and torch.cuda.is_available():
            samples.append({"chunk": i, "cache_tokens": v.tokens, "gpu_mib": torch.cuda.memory_allocated() >> 20})
    return {"budget_tokens": budget, "chunks": chunks, "text_start_final": engine.head.text_start,
            "evictions": engine.head.stats.evictions, "memory": samples}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random-3b")
    p.add_argument("--sizes", default="8192,32768,100000")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--long-chunks", type=int, default=400)
    p.add_argument("--long-budget", type=int, default=32768)
    args = p.parse_args()
    rt = Runtime(load_model(args.model))
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": args.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "dtype": str(rt.lm.dtype),
        "vision": [bench_vision(rt, s) for s in (448, 896)],
        "cache": [bench_cache_size(rt, int(n), args.decode_tokens) for n in args.sizes.split(",")],
        "long_stream": bench_long_stream(rt, args.long_chunks, args.long_budget),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
