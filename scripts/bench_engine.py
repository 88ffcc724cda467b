"""Engine benchmark: prints one JSON object. Run on a GPU with random-3b (real 3B compute).

    python scripts/bench_engine.py --model random-3b --sizes 8192,32768,100000
    python scripts/bench_engine.py --model tiny-random --device cpu --sizes 1024 --long-chunks 20 \
        --vision-batches 1,4 --batch-streams 1,2 --batch-questions 1,2 --batch-cache-tokens 1024  # CPU smoke run

Measures: vision ms per 4-frame chunk (448², 896²) and per chunk when 1, 16 or 64 chunks share
one forward (against transformers' own tower); chunk prefill ms, question first-token
latency and decode tokens/s at each cache size; the stateless baseline (transformers'
own forward re-prefilling the whole context for each question); GPU memory over a long
stream with eviction.

    python scripts/bench_engine.py --model random-3b --eviction-cost
    python scripts/bench_engine.py --model tiny-random --device cpu --eviction-cost \
        --eviction-budget 1024 --eviction-side 112  # CPU smoke run

measures only what exact eviction costs against rebase: ms per chunk amortized over several
evictions at a 32K budget with 448² frames, and the memory of the kept vision embeddings.

    python scripts/bench_engine.py --model random-3b --gemm-dtype fp8  # any run above, FP8 products
    python scripts/bench_engine.py --model Qwen/Qwen2.5-VL-3B-Instruct --fp8-logits
    python scripts/bench_engine.py --model tiny-random --device cpu --fp8-logits --fp8-side 56  # CPU smoke run

`--fp8-logits` measures only what FP8 products (`gemm_dtype: fp8`) do to the answers: the
first-token logits of a question on a few cached windows (streams of rendered scenes), with FP8
against bf16: their largest and mean absolute difference and how often the top token agrees.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime

import numpy as np
import torch

from apps.samplevideo import render_scene
from common.engine.answer import Generation, ask, question_suffix_ids
from common.engine.eviction import EvictionPolicy
from common.engine.frames import frames_to_pixels
from common.engine.grid import Grid, StreamSpec
from common.engine.model import load_model
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.scheduler import SchedulePolicy, Scheduler
from common.engine.stream_engine import Chunk, ChunkWork, StreamEngine
from common.engine.vision import VisionTower
from common.engine.work import run_ahead
from common.logs import configure_logging

QUESTION = "What is he doing?"  # 31 tokens with the question template (byte tokenizer of random-3b)


def log(msg: str) -> None:
    """Progress on stderr, so a run cut short still shows how far it got."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gpu_info() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    out = {"side": side, "tokens": grid.tokens_per_patch * 2, "vision_ms": round(ms, 1)}
    log(f"vision {out}")
    return out


def bench_vision_batched(rt: Runtime, counts: tuple[int, ...] = (1, 16, 64), side: int = 448) -> dict:
    """Per-chunk vision time when `n` 4-frame chunks go through one forward, for our tower eager
    and as the runtime runs it (compiled on a GPU), against transformers' tower on one chunk; the
    16-chunk batch profiled. Pixels start on the device: this is the tower, not the host copy."""
    grid = Grid(side, side)
    frames = np.random.default_rng(0).integers(0, 256, (4, side, side, 3), dtype=np.uint8)
    pixels, grid_thw = frames_to_pixels(frames, grid)
    pixels = pixels.to(rt.device)
    visual = rt.loaded.model.model.visual
    grid_tensor = torch.tensor([grid_thw], device=rt.device)

    @torch.inference_mode()
    def transformers_tower() -> None:
        visual(pixels.to(visual.dtype), grid_thw=grid_tensor)

    out: dict = {
        "side": side,
        "frames_per_chunk": 4,
        "tokens_per_chunk": grid.tokens_per_patch * 2,
        "transformers_ms_per_chunk": round(timed(transformers_tower), 2),
    }
    towers = {"eager": VisionTower(rt.loaded), "runtime": rt.vision_tower}  # the runtime's: compiled on a GPU
    for name, tower in towers.items():
        rows = []
        for n in counts:
            ms = timed(lambda n=n, tower=tower: tower([(pixels, grid_thw)] * n), repeat=3, warmup=1)
            rows.append({"chunks": n, "batch_ms": round(ms, 1), "ms_per_chunk": round(ms / n, 2)})
            if n == 16:
                batch = [(pixels, grid_thw)] * 16
                rows[-1]["profile"] = profiled(lambda tower=tower, batch=batch: tower(batch), table=name != "eager")
            log(f"vision {name} {rows[-1]}")
        out[name] = rows
    del towers
    free_gpu()
    return out


def filled_engine(rt: Runtime, n_tokens: int) -> StreamEngine:
    return filled_engines(rt, 1, n_tokens)[0]


def filled_engines(
    rt: Runtime, n: int, n_tokens: int, budget: int | None = None, slab: int = 4096, batch: int = 8
) -> list[StreamEngine]:
    """`n` 448² streams whose caches hold ~n_tokens video tokens each, prefilled in slabs of random
    embeddings (the LM cost of a cache depends on its size, not its content), `batch` streams a
    forward. `budget`: each stream's eviction budget (its region is then sized for exactly that)."""
    policy = EvictionPolicy(max_cache_tokens=budget) if budget else None
    engines = [StreamEngine(rt, StreamSpec(f"bench{i}", 2.0, Grid(448, 448), 4), policy) for i in range(n)]
    per_patch, dim = 256, rt.lm.embed_tokens.embedding_dim
    for group in (engines[i : i + batch] for i in range(0, n, batch)):
        while room := [
            (e, (n_tokens - e.head.tokens) // per_patch) for e in group if n_tokens - e.head.tokens >= per_patch
        ]:
            chunk_work = []
            for e, patches in room:
                patches = min(slab // per_patch, patches)
                embeds = torch.randn(patches * per_patch, dim, device=rt.lm.device, dtype=rt.lm.dtype) * 0.02
                chunk_work.append(ChunkWork(e, embeds_chunk(e, embeds, patches)))
            ChunkWork.run_batch(chunk_work)
            for work in chunk_work:
                work.engine.finish(work.future.result())
    return engines


def embeds_chunk(engine: StreamEngine, embeds: torch.Tensor, n_patches: int) -> Chunk:
    """A chunk of already-made video tokens; its frame seq is the stream's next, so chunk ids stay
    unique (eviction tells chunks apart by id)."""
    seq = engine.head.last_frame_seq + 1
    return Chunk((n_patches, 0, 0), (seq, seq), (float(seq), float(seq)), embeds=embeds)


def bench_cache_size(rt: Runtime, n_tokens: int, decode_tokens: int, profile: bool = False) -> dict:
    out = engine_side(rt, n_tokens, decode_tokens, profile)
    free_gpu()  # the engine's arena is gone before the baseline runs
    out["stateless_first_token_ms"] = round(stateless_first_token_ms(rt, out["cache_tokens"]), 1)
    out["speedup"] = round(out["stateless_first_token_ms"] / out["first_token_ms"], 1)
    log(f"cache {out}")
    free_gpu()
    return out


def engine_side(rt: Runtime, n_tokens: int, decode_tokens: int, profile: bool = False) -> dict:
    engine = filled_engine(rt, n_tokens)
    chunk = torch.randn(512, rt.lm.embed_tokens.embedding_dim, device=rt.lm.device, dtype=rt.lm.dtype) * 0.02
    base = engine.head

    def prefill_chunk() -> None:
        seq = base.last_frame_seq + 1
        engine.append_embeddings(chunk, 2, (seq, seq), (0.0, 0.0))
        engine.cache.rewind(base)  # so every repeat sees the same cache size

    prefill_ms = timed(prefill_chunk)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    first = [ask(rt, base, QUESTION, GenerationParams(max_tokens=1)).first_token_s * 1000 for _ in range(7)][2:]
    ask(rt, base, QUESTION, GenerationParams(max_tokens=8))  # warm-up: decode graphs captured (and compiled)
    decode = ask(rt, base, QUESTION, GenerationParams(max_tokens=decode_tokens))
    if profile:
        profile_question(rt, base)
    return {
        "cache_tokens": base.tokens,
        "chunk_prefill_ms": round(prefill_ms, 1),
        "first_token_ms": round(statistics.median(first), 1),
        "decode_tok_s": round(decode.tokens_per_s, 1),
        "decoded_tokens": len(decode.token_ids),
        "question_tokens": len(question_suffix_ids(rt, QUESTION)),
        "question_peak_gpu_mib": torch.cuda.max_memory_allocated() >> 20 if torch.cuda.is_available() else None,
    }


def profile_steps(rt: Runtime, versions: list, label: str, steps: int = 8) -> dict:
    """One question per version advanced together: the first step (every question's prefill),
    then `steps` decode steps, under torch.profiler (see `profiled`)."""
    questions = [Generation(rt, v, QUESTION, GenerationParams(max_tokens=steps + 4)) for v in versions]
    out = {"label": label, "questions": len(questions)}
    out["prefill"] = profiled(lambda: Generation.step_batch(questions))
    out["decode"] = profiled(lambda: Generation.step_batch(questions), steps, table=True)
    log(f"steps {out}")
    return out


def profiled(fn, n: int = 1, table: bool = False) -> dict:
    """`fn()` n times under torch.profiler. Per call: wall time, GPU busy time by kind (flash
    attention, matrix products, compiled Triton kernels, everything else), GPU kernels launched,
    host syncs, memcpy calls and graph launches; with `table`, the top ops on stderr."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        wall = (time.perf_counter() - t0) / n
    kinds: dict[str, float] = {}
    kernels = syncs = copies = graphs = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            kind = kernel_kind(e.name.lower())
            kinds[kind] = kinds.get(kind, 0.0) + e.time_range.elapsed_us()
        elif e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            syncs += 1
        elif e.name.startswith("cudaMemcpy"):
            copies += 1
        elif e.name == "cudaGraphLaunch":
            graphs += 1
    if table:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30), file=sys.stderr, flush=True)
    return {
        "wall_ms": round(wall * 1000, 3),
        "gpu_ms": {k: round(v / 1000 / n, 3) for k, v in sorted(kinds.items())},
        "gpu_busy_ms": round(sum(kinds.values()) / 1000 / n, 3),
        "kernels": kernels // n,
        "host_syncs": syncs / n,
        "memcpy_calls": copies / n,
        "graph_launches": graphs / n,
    }


def kernel_kind(name: str) -> str:
    if "flash" in name or "fmha" in name or "sdpa" in name:
        return "attention"
    if any(k in name for k in GEMM_NAMES):
        return "gemm"
    if "memcpy" in name or "memset" in name:
        return "copy"
    return "triton" if name.startswith("triton") else "other"


GEMM_NAMES = ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas")


def profile_question(rt: Runtime, version) -> None:
    """Where a question's time goes (question prefill + 9 one-token forwards): top ops on stderr."""
    try:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            ask(rt, version, QUESTION, GenerationParams(max_tokens=9))
        key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=18), file=sys.stderr, flush=True)
    except Exception as e:  # diagnostics only: never fail the benchmark
        log(f"profiler failed: {e!r}")


@torch.inference_mode()
def stateless_first_token_ms(rt: Runtime, n_tokens: int) -> float:
    """Baseline without a persistent cache: transformers re-prefills context + question."""
    text = rt.loaded.model.model.language_model
    n = n_tokens + len(question_suffix_ids(rt, QUESTION))
    embeds = torch.randn(1, n, text.config.hidden_size, device=rt.lm.device, dtype=rt.lm.dtype) * 0.02
    pos = torch.arange(n, device=rt.lm.device).view(1, 1, n).expand(3, 1, n)

    def run() -> None:
        hidden = text(inputs_embeds=embeds, position_ids=pos, use_cache=False).last_hidden_state
        rt.loaded.model.lm_head(hidden[:, -1])

    return timed(run, repeat=3, warmup=1)


def bench_long_stream(rt: Runtime, chunks: int, budget: int) -> dict:
    free_gpu()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    baseline_mib = torch.cuda.memory_allocated() >> 20 if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    engine = StreamEngine(rt, StreamSpec("long", 2.0, Grid(448, 448), 4), EvictionPolicy(max_cache_tokens=budget))
    chunk = torch.randn(512, rt.lm.embed_tokens.embedding_dim, device=rt.lm.device, dtype=rt.lm.dtype) * 0.02
    samples = []
    for i in range(chunks):
        v = engine.append_embeddings(chunk, 2, (i, i), (float(i), float(i)))
        if i % max(1, chunks // 20) == 0 and torch.cuda.is_available():
            samples.append(
                {
                    "chunk": i,
                    "cache_tokens": v.tokens,
                    "gpu_mib": torch.cuda.memory_allocated() >> 20,
                    "reserved_mib": torch.cuda.memory_reserved() >> 20,
                }
            )
    sync()
    head = engine.head
    cuda = torch.cuda.is_available()
    out = {
        "budget_tokens": budget,
        "chunks": chunks,
        "chunk_tokens": 512,
        "cache_tokens_final": head.tokens,
        "text_start_final": head.text_start,
        "evictions": head.stats.evictions,
        "chunks_evicted": head.stats.chunks_evicted,
        "mean_chunk_ms": round((time.perf_counter() - t0) * 1000 / chunks, 1),
        "baseline_gpu_mib": baseline_mib,
        "peak_gpu_mib": torch.cuda.max_memory_allocated() >> 20 if cuda else None,
        "memory": samples,
    }
    log(f"long stream {dict((k, v) for k, v in out.items() if k != 'memory')}")
    return out


def bench_batched(
    rt: Runtime, streams: list[int], questions: list[int], cache_tokens: int, engines: list[StreamEngine] | None = None
) -> dict:
    """The scheduler's batches: per-chunk vision and prefill time with one chunk from each of N
    streams in one batch (every stream at `cache_tokens`, its region sized for it and the chunk),
    the 16-stream batch profiled; and decode with C questions on C different streams advanced
    together. Frames are turned into pixels before the clock starts (the encoder does that in its
    own threads, not in the GPU loop)."""
    chunk_tokens = 512
    if engines is None:
        free_gpu()
        engines = filled_engines(rt, max(*streams, *questions), cache_tokens, budget=cache_tokens + chunk_tokens)
    log(f"{len(engines)} streams filled to {engines[0].head.tokens} tokens")
    frames = list(np.random.default_rng(0).integers(0, 256, (4, 448, 448, 3), dtype=np.uint8))
    out: dict = {"cache_tokens": engines[0].head.tokens, "chunks": [], "decode": []}
    dim = rt.lm.embed_tokens.embedding_dim
    prefill_input = torch.randn(chunk_tokens, dim, device=rt.lm.device, dtype=rt.lm.dtype) * 0.02
    prepared = {id(e): e.prepare(frames) for e in engines[: max(streams)]}
    for n in streams:
        batch = engines[:n]
        heads = [e.head for e in batch]

        def encode(with_vision: bool, batch=batch, heads=heads) -> None:
            chunk_work = []
            for e in batch:
                chunk = replace(prepared[id(e)])
                if not with_vision:
                    chunk.video, chunk.embeds = None, prefill_input
                chunk_work.append(ChunkWork(e, chunk))
            ChunkWork.run_batch(chunk_work)
            for work in chunk_work:
                work.future.result()  # a batch that failed must not pass for a fast one
            for e, head in zip(batch, heads, strict=True):
                e.cache.rewind(head)  # every repeat sees the same cache sizes

        both = timed(lambda: encode(True), repeat=3, warmup=1)
        prefill = timed(lambda: encode(False), repeat=3, warmup=1)
        row: dict = {"streams": n, "chunk_ms": round(both / n, 2), "prefill_ms": round(prefill / n, 2)}
        row["vision_ms"] = round((both - prefill) / n, 2)
        if n == 16:
            row["prefill_profile"] = profiled(lambda: encode(False), table=True)
            row["chunk_profile"] = profiled(lambda: encode(True))
        if rt.lm.cudnn:  # the same batches with the whole cache read through flash
            rt.lm.cudnn = False
            row["prefill_ms_flash_only"] = round(timed(lambda: encode(False), repeat=3, warmup=1) / n, 2)
            rt.lm.cudnn = True
        out["chunks"].append(row)
        log(f"batched chunks {row}")
    for c in questions:
        batched_decode(rt, [e.head for e in engines[:c]], tokens=8)  # warm-up: graphs for this batch size
        out["decode"].append(batched_decode(rt, [e.head for e in engines[:c]]))
    return out


def bench_fit(
    rt: Runtime, n_streams: int, cache_tokens: int, streams: list[int], questions: list[int], evict_batch: int
) -> dict:
    """Issue 10's "100 streams x 32K cached tokens fit": `n_streams` streams, each with an eviction
    budget of `cache_tokens` + one chunk and filled to `cache_tokens`, all in the pool at once;
    on them the batched chunk and decode runs of `bench_batched`; then every stream streams two
    more chunks, `evict_batch` streams a batch (as the scheduler takes them), so every stream
    evicts once. The pool's exact accounting and the GPU's memory after each phase; the pool must
    not have grown (PoolFull raises if it had to and could not)."""
    free_gpu()
    chunk_tokens = 512
    t0 = time.perf_counter()
    engines = filled_engines(rt, n_streams, cache_tokens, budget=cache_tokens + chunk_tokens)
    out: dict = {"streams": n_streams, "fill_s": round(time.perf_counter() - t0, 1)}
    out["filled"] = pool_report(rt, engines)
    log(f"fit: filled {out['filled']}")
    out["batched"] = bench_batched(rt, streams, questions, cache_tokens, engines)
    out["after_batched"] = pool_report(rt, engines)
    dim = rt.lm.embed_tokens.embedding_dim
    t0 = time.perf_counter()
    for _ in range(2):
        for i in range(0, n_streams, evict_batch):
            batch = [
                ChunkWork(
                    e, embeds_chunk(e, torch.randn(chunk_tokens, dim, device=rt.device, dtype=rt.lm.dtype) * 0.02, 2)
                )
                for e in engines[i : i + evict_batch]
            ]
            ChunkWork.run_batch(batch)
            for work in batch:
                work.engine.finish(work.future.result())
    sync()
    out["streamed_chunks_per_s"] = round(2 * n_streams / (time.perf_counter() - t0), 1)
    out["evictions"] = sum(e.head.stats.evictions for e in engines)
    out["after_streaming"] = pool_report(rt, engines)
    log(f"fit: streamed {out['after_streaming']}, {out['evictions']} evictions")
    del engines
    free_gpu()
    return out


def pool_report(rt: Runtime, engines: list[StreamEngine]) -> dict:
    """The pool's accounting (exact, in whole pages) and the GPU's memory."""
    pool = rt.pool
    gib = 1 << 30
    out = {
        "slabs": len(pool.slabs),
        "capacity_tokens": pool.capacity_tokens,
        "used_tokens": pool.used_tokens,
        "peak_used_tokens": pool.peak_tokens,
        "bytes_per_token": pool.bytes_per_token,
        "capacity_gib": round(pool.capacity_tokens * pool.bytes_per_token / gib, 2),
        "cached_tokens": sum(e.head.tokens for e in engines),
        "page_tokens": pool.page_tokens,
        "version_extents": sorted({len(e.head.view.extents) for e in engines}),
    }
    if rt.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(rt.device)
        out |= {
            "gpu_total_gib": round(total / gib, 2),
            "gpu_free_gib": round(free / gib, 2),
            "allocated_gib": round(torch.cuda.memory_allocated(rt.device) / gib, 2),
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated(rt.device) / gib, 2),
        }
    return out


def batched_decode(rt: Runtime, versions: list, tokens: int = 64) -> dict:
    """One question per version, all advanced together until each has `tokens` tokens (stepped
    here, or through the scheduler installed as the runtime's executor)."""
    questions = [Generation(rt, v, QUESTION, GenerationParams(max_tokens=tokens)) for v in versions]
    sync()
    t0 = time.perf_counter()
    if isinstance(rt.executor, Scheduler):
        for future in [rt.executor.submit(j) for j in questions]:
            future.result()
    else:
        active = list(questions)
        while active:  # as the scheduler runs them with nothing else to do: steps queued ahead
            run_ahead(Generation.launch_batch(active))
            active = [j for j in active if not j.done]
    sync()
    seconds = time.perf_counter() - t0
    total = sum(len(j.future.result().token_ids) for j in questions)
    firsts = [j.future.result().first_token_s * 1000 for j in questions]
    row = {
        "questions": len(questions),
        "aggregate_tok_s": round(total / seconds, 1),
        "per_question_tok_s": round(total / seconds / len(questions), 1),
        "first_token_ms_max": round(max(firsts), 1),
    }
    log(f"batched decode {row}")
    return row


def bench_questions(rt: Runtime, sizes: list[int], questions: list[int], cache_tokens: int, tokens: int) -> dict:
    """Only the question path: a lone question at each cache size (first token, decode tok/s),
    questions batched on different streams at `cache_tokens`, and a profile of each."""
    out: dict = {"lone": [], "batched": [], "profiles": []}
    for n in sizes:
        version = filled_engine(rt, n).head
        first = [ask(rt, version, QUESTION, GenerationParams(max_tokens=1)).first_token_s * 1000 for _ in range(7)][2:]
        decode = ask(rt, version, QUESTION, GenerationParams(max_tokens=tokens))
        decode = ask(rt, version, QUESTION, GenerationParams(max_tokens=tokens))  # graphs captured by the first
        row = {"cache_tokens": version.tokens, "first_token_ms": round(statistics.median(first), 1)}
        row["decode_tok_s"] = round(decode.tokens_per_s, 1)
        out["lone"].append(row)
        log(f"lone question {row}")
        out["profiles"].append(profile_steps(rt, [version], f"lone at {version.tokens}"))
        del version
        free_gpu()
    versions = [filled_engine(rt, cache_tokens).head for _ in range(max(questions))]
    for c in questions:
        batched_decode(rt, versions[:c], tokens=8)  # warm-up: graphs for this batch size
        out["batched"].append(batched_decode(rt, versions[:c], tokens))
        out["profiles"].append(profile_steps(rt, versions[:c], f"{c} questions at {versions[0].tokens}"))
    del versions
    free_gpu()
    return out


def bench_eviction_cost(rt: Runtime, budget: int, side: int, cycles: int) -> dict:
    """Per policy: a stream of 4-frame chunks (random embeddings: LM cost depends on sizes, not
    content) run until `cycles` evictions after the first; amortized ms per chunk over the chunks
    after the first eviction (steady state: each eviction's work spread over the chunks until the
    next)."""
    return {mode: _eviction_run(rt, mode, budget, side, cycles) for mode in ("rebase", "exact")}


def _eviction_run(rt: Runtime, mode: str, budget: int, side: int, cycles: int) -> dict:
    free_gpu()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    policy = EvictionPolicy(max_cache_tokens=budget, mode=mode)  # type: ignore[arg-type]
    engine = StreamEngine(rt, StreamSpec("evict", 2.0, Grid(side, side), 4), policy)
    tokens = 2 * Grid(side, side).tokens_per_patch
    chunk = torch.randn(tokens, rt.lm.embed_tokens.embedding_dim, device=rt.lm.device, dtype=rt.lm.dtype) * 0.02
    steady: list[tuple[float, bool]] = []  # (ms, whether it evicted) after the first eviction
    i = 0
    while engine.head.stats.evictions <= cycles:
        evictions = engine.head.stats.evictions
        sync()
        t0 = time.perf_counter()
        engine.append_embeddings(chunk, 2, (4 * i, 4 * i + 3), (2.0 * i, 2.0 * i + 1.5))
        sync()
        ms, i = (time.perf_counter() - t0) * 1000, i + 1
        if evictions:
            steady.append((ms, engine.head.stats.evictions > evictions))
    embeds = engine.cache.embeds.values()
    out = {
        "budget_tokens": budget,
        "side": side,
        "chunk_tokens": tokens,
        "chunks": i,
        "evictions": engine.head.stats.evictions,
        "measured_chunks": len(steady),
        "amortized_chunk_ms": round(statistics.mean(ms for ms, _ in steady), 2),
        "evicting_chunk_ms": round(statistics.median(ms for ms, evicted in steady if evicted), 1),
        "ordinary_chunk_ms": round(statistics.median(ms for ms, evicted in steady if not evicted), 2),
        "kept_embeds_mib": round(sum(e.numel() * e.element_size() for e in embeds) / 2**20, 3),
        "peak_gpu_mib": torch.cuda.max_memory_allocated() >> 20 if torch.cuda.is_available() else None,
    }
    log(f"eviction {mode} {out}")
    return out


def fp8_logit_effect(args: argparse.Namespace) -> dict:
    """First-token logits on the same cached windows with bf16 products, then FP8 (the models one
    after the other: each takes a pool of its own)."""
    logits = {}
    for gemm in ("bf16", "fp8"):
        loaded = load_model(args.model, device=args.device, gemm_dtype=gemm)
        rt = Runtime(loaded, pool_tokens=args.pool_tokens or 1 << 16, compile_vision=not args.eager_vision)
        logits[gemm] = [window_logits(rt, w, args.fp8_chunks, args.fp8_side) for w in range(args.fp8_windows)]
        del loaded, rt
        free_gpu()
    diffs = [(fp8 - bf16).abs() for bf16, fp8 in zip(logits["bf16"], logits["fp8"], strict=True)]
    out = {
        "windows": args.fp8_windows,
        "window_frames": 4 * args.fp8_chunks,
        "side": args.fp8_side,
        "max_abs_logit_bf16": round(max(float(b.abs().max()) for b in logits["bf16"]), 3),
        "max_abs_diff": round(max(float(d.max()) for d in diffs), 4),
        "mean_abs_diff": round(statistics.mean(float(d.mean()) for d in diffs), 4),
        "top1_agreement": sum(int(b.argmax() == f.argmax()) for b, f in zip(logits["bf16"], logits["fp8"], strict=True))
        / args.fp8_windows,
    }
    log(f"fp8 logits {out}")
    return out


def window_logits(rt: Runtime, window: int, chunks: int, side: int) -> torch.Tensor:
    """A question's first-token logits (fp32, host) on a stream of `chunks` 4-frame chunks of
    rendered scenes, a new scene every chunk (window `w` has its own)."""
    engine = StreamEngine(rt, StreamSpec(f"fp8-{window}", 2.0, Grid(side, side), 4))
    for c in range(chunks):
        engine.append([render_scene(100 * window + c, width=side, height=side)] * 4)
    answer = ask(rt, engine.head, QUESTION, GenerationParams(max_tokens=1), keep_logits=True)
    return answer.first_logits.float().cpu()


def run_info(rt: Runtime, model: str) -> dict:
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": model,
        "device": torch.cuda.get_device_name() if rt.device.type == "cuda" else platform.processor(),
        "nvidia_smi": gpu_info() if rt.device.type == "cuda" else "",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "dtype": str(rt.lm.dtype),
        "gemm_dtype": rt.loaded.gemm_dtype,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random-3b")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    p.add_argument("--eager-vision", action="store_true", help="no torch.compile of the vision blocks (GPU)")
    p.add_argument("--vision-batches", default="1,16,64", help="chunks per vision forward to time")
    p.add_argument("--sizes", default="8192,32768,100000")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--long-chunks", type=int, default=400)
    p.add_argument("--long-budget", type=int, default=32768)
    p.add_argument("--profile", action="store_true", help="profile one question at the largest cache size")
    p.add_argument("--batch-streams", default="1,16,64", help="chunks batched from this many streams")
    p.add_argument("--batch-questions", default="1,8,32", help="questions decoded together")
    p.add_argument("--batch-cache-tokens", type=int, default=32768)
    p.add_argument("--pool-tokens", type=int, default=None, help="KV pool size (default: the free GPU memory)")
    p.add_argument("--questions-only", action="store_true", help="only: the question path, profiled")
    p.add_argument(
        "--question-executor",
        choices=("inline", "scheduler"),
        default="inline",
        help="the question path's questions (profiles aside) stepped here, or through a Scheduler",
    )
    p.add_argument(
        "--chunks-only", action="store_true", help="only: vision batches and, on --fit-streams streams, the chunk path"
    )
    p.add_argument("--fit-streams", type=int, default=100, help="streams at --batch-cache-tokens held at once")
    p.add_argument("--evict-batch", type=int, default=4, help="chunks a batch while every stream evicts")
    p.add_argument("--eviction-cost", action="store_true", help="only: exact vs rebase eviction, per chunk")
    p.add_argument("--eviction-budget", type=int, default=32768)
    p.add_argument("--eviction-side", type=int, default=448)
    p.add_argument("--eviction-cycles", type=int, default=4, help="evictions measured after the first")
    p.add_argument("--gemm-dtype", choices=("bf16", "fp8"), default="bf16", help="the dense layers' products")
    p.add_argument("--fp8-logits", action="store_true", help="only: first-token logits with FP8 against bf16")
    p.add_argument("--fp8-windows", type=int, default=4, help="cached windows compared")
    p.add_argument("--fp8-chunks", type=int, default=8, help="4-frame chunks a window")
    p.add_argument("--fp8-side", type=int, default=448, help="frame side in pixels")
    args = p.parse_args()
    configure_logging("INFO")  # the engine's log lines (graph captures, re-layouts) on stderr: stdout is the JSON
    if args.fp8_logits:
        on_gpu = torch.cuda.is_available() and args.device != "cpu"
        info = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "model": args.model,
            "device": torch.cuda.get_device_name() if on_gpu else platform.processor(),
            "torch": torch.__version__,
        }
        print(json.dumps({**info, "fp8_logits": fp8_logit_effect(args)}, indent=1))
        return
    sizes = [int(n) for n in args.sizes.split(",")]
    t0 = time.perf_counter()
    rt = Runtime(
        load_model(args.model, device=args.device, gemm_dtype=args.gemm_dtype),
        pool_tokens=args.pool_tokens,
        compile_vision=not args.eager_vision,
    )
    log(f"loaded {args.model} in {time.perf_counter() - t0:.1f}s")
    if args.eviction_cost:
        cost = bench_eviction_cost(rt, args.eviction_budget, args.eviction_side, args.eviction_cycles)
        print(json.dumps({**run_info(rt, args.model), "eviction_cost": cost}, indent=1))
        return
    questions = [int(n) for n in args.batch_questions.split(",")]
    if args.questions_only:
        if args.question_executor != "inline":
            rt.executor = Scheduler(SchedulePolicy()).start()
        q = bench_questions(rt, sizes, questions, args.batch_cache_tokens, args.decode_tokens)
        print(
            json.dumps(
                {**run_info(rt, args.model), "question_executor": args.question_executor, "questions": q}, indent=1
            )
        )
        return
    streams = [int(n) for n in args.batch_streams.split(",")]
    vision_counts = tuple(int(n) for n in args.vision_batches.split(","))
    if args.chunks_only:
        result = {**run_info(rt, args.model), "vision_batched": bench_vision_batched(rt, vision_counts)}
        result["fit"] = bench_fit(rt, args.fit_streams, args.batch_cache_tokens, streams, questions, args.evict_batch)
        print(json.dumps(result, indent=1))
        return
    result = {
        **run_info(rt, args.model),
        "vision": [bench_vision(rt, s) for s in (448, 896)],
        "vision_compiled": rt.vision_tower.compiled,
        "vision_batched": bench_vision_batched(rt, vision_counts),
        "cache": [bench_cache_size(rt, n, args.decode_tokens, args.profile and n == sizes[-1]) for n in sizes],
        "long_stream": bench_long_stream(rt, args.long_chunks, args.long_budget),
        "batched": bench_batched(rt, streams, questions, args.batch_cache_tokens),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
