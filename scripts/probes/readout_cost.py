"""What handing each chunk's K/V and retrieval vector to the host costs an encode step.

`bench_engine.py` streams chunks with no sinks; the worker's engines have `on_segment` (the
chunk's K/V, 19 MB at 448², copied into page-locked memory for the segment writer) and
`on_features` (its retrieval vector). The pipeline's encode steps ran at 78 % of the engine's
rate (2026-11-29), and its GPU loop spent a quarter of its time in the publish phase. This
streams the same chunks (random embeddings, 4-frame 448² chunks, `STEPS` steps of 8 chunks over
16 streams at 32K cached tokens, evicting) two ways, each twice, alternating (a run's first steps
pay for first evictions and warm-up): no sinks; the worker's sinks, whose K/V a writer thread
copies away (as the shm store does) before dropping it. Each prints a JSON line: ms a step (host
until launched, and to the device's end), the GPU loop's host ms in each part of the publish
phase, where one step synchronised with the device (CUDA's sync debug mode), and torch's
page-locked allocator counters (allocations that had to pin fresh memory, and their time). Then
where a step of real frames (the vision tower too) and a lone 16-token answer wait for the device.

Run from the root of the code on a GPU: `PYTHONPATH=. python3 scripts/probes/readout_cost.py`;
`tiny-random cpu` as arguments: a smoke run on the CPU.
"""

import json
import queue
import sys
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from common.engine.answer import ask
from common.engine.eviction import EvictionPolicy
from common.engine.grid import Grid, StreamSpec
from common.engine.kvcache import StreamCache
from common.engine.model import load_model
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.stream_engine import Chunk, ChunkWork, StreamEngine

STREAMS, BATCH, STEPS, CHUNK_TOKENS = 16, 8, 40, 512


class Writer:
    """The segment writer's part: copy each K/V out of its page-locked buffer, then drop it."""

    def __init__(self) -> None:
        self.todo: queue.Queue[torch.Tensor | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (kv := self.todo.get()) is not None:
            np.array(kv.view(torch.uint8).numpy(), copy=True)

    def close(self) -> None:
        self.todo.put(None)
        self.thread.join()


def engines(rt: Runtime, budget: int, writer: Writer | None) -> list[StreamEngine]:
    sinks = {}
    if writer is not None:
        sinks = dict(on_segment=lambda _s, kv: writer.todo.put(kv), on_features=lambda _s, _v: None)
    policy = EvictionPolicy(max_cache_tokens=budget)
    out = [StreamEngine(rt, StreamSpec(f"cam{i}", 2.0, Grid(448, 448), 4), policy, **sinks) for i in range(STREAMS)]
    for group in (out[i : i + BATCH] for i in range(0, STREAMS, BATCH)):
        while group[0].head.tokens + CHUNK_TOKENS <= budget - CHUNK_TOKENS:
            step(rt, group, ThreadPoolExecutor(1))
    return out


def step(rt: Runtime, group: list[StreamEngine], finishing: ThreadPoolExecutor) -> float:
    """One encode step of a chunk per engine; the host's seconds until everything is launched."""
    dim = rt.lm.embed_tokens.embedding_dim
    work = []
    for e in group:
        seq = e.head.last_frame_seq + 1
        embeds = torch.randn(CHUNK_TOKENS, dim, device=rt.device, dtype=rt.lm.dtype) * 0.02
        work.append(ChunkWork(e, Chunk((2, 0, 0), (seq, seq + 3), (seq / 2, seq / 2 + 1.5), embeds=embeds)))
    t0 = time.perf_counter()
    ChunkWork.run_batch(work)
    launched = time.perf_counter() - t0
    for w in work:  # the stream threads' part
        finishing.submit(w.engine.finish, w.future.result())
    return launched


def host_stats() -> dict:
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.host_memory_stats()
    return {k: stats.get(k, 0) for k in ("num_host_alloc", "num_host_free", "host_alloc_time.total")}


PARTS = [
    (ChunkWork, "_output"),
    (StreamEngine, "_read_out"),
    (StreamEngine, "_features"),
    (StreamEngine, "_appended"),
    (StreamCache, "publish_chunk"),
]


@contextmanager
def timed_parts() -> Iterator[dict[str, float]]:
    """Host seconds spent in each of `PARTS` while the block runs."""
    spent: dict[str, float] = {}
    originals = [(cls, name, getattr(cls, name)) for cls, name in PARTS]

    def timer(name: str, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

        return timed

    for cls, name, fn in originals:
        setattr(cls, name, timer(name, fn))
    try:
        yield spent
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)


@contextmanager
def syncs_seen() -> Iterator[Counter]:
    """Where in the project's code the host synchronised with the device (CUDA sync debug mode)."""
    seen: Counter = Counter()
    if not torch.cuda.is_available():
        yield seen
        return
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if "/common/" in f.filename]
        seen[" < ".join(f"{f.filename.split('/common/')[-1]}:{f.lineno}" for f in reversed(frames[-4:]))] += 1

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            yield seen
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown


def measure(rt: Runtime, label: str, streams: list[StreamEngine]) -> None:
    finishing = ThreadPoolExecutor(8)
    with syncs_seen() as syncs:
        step(rt, streams[:BATCH], finishing)
    before = host_stats()
    sync()
    t0 = time.perf_counter()
    with timed_parts() as spent:
        launched = sum(step(rt, streams[(i * BATCH) % STREAMS :][:BATCH], finishing) for i in range(STEPS))
    sync()
    wall = time.perf_counter() - t0
    finishing.shutdown()
    after = host_stats()
    row = {
        "sinks": label,
        "ms_a_step": round(1000 * wall / STEPS, 2),
        "host_launched_ms_a_step": round(1000 * launched / STEPS, 2),
        "host_ms_a_step_in": {k: round(1000 * v / STEPS, 2) for k, v in spent.items()},
        "syncs_in_one_step": dict(syncs),
        "chunks_per_s": round(STEPS * BATCH / wall, 1),
        "host_alloc": {k: after[k] - before.get(k, 0) for k in after},
        "evictions": sum(e.head.stats.evictions for e in streams),
    }
    print(json.dumps(row), flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    model, device = (sys.argv[1], sys.argv[2]) if len(sys.argv) > 2 else ("random-3b", "cuda")
    rt = Runtime(load_model(model, device=device))
    budget = 32768 if device == "cuda" else 4 * CHUNK_TOKENS
    plain = engines(rt, budget, None)
    writer = Writer()
    sinking = engines(rt, budget, writer)
    for label, streams in (
        ("none", plain),
        ("worker's", sinking),
        ("none, again", plain),
        ("worker's, again", sinking),
    ):
        measure(rt, label, streams)
    print(json.dumps({"syncs_in_a_step_of_frames": frames_step_syncs(rt, sinking[:BATCH])}), flush=True)
    print(json.dumps({"syncs_in_an_answer": answer_syncs(rt, sinking[0])}), flush=True)
    writer.close()


def frames_step_syncs(rt: Runtime, group: list[StreamEngine]) -> dict[str, int]:
    """Where a step of real frames (vision, inputs, plan, prefill, publish) waits for the device."""
    frames = list(np.random.default_rng(0).integers(0, 256, (4, 448, 448, 3), dtype=np.uint8))
    work = []
    for e in group:
        seq = e.head.last_frame_seq + 1
        work.append(ChunkWork(e, e.prepare(frames, [(seq + k) / 2 for k in range(4)], range(seq, seq + 4))))
    ChunkWork.run_batch(work)  # the first step of a composition may capture or compile: not this one
    for w in work:
        w.engine.finish(w.future.result())
    work = [ChunkWork(w.engine, w.engine.prepare(frames, None, None)) for w in work]
    with syncs_seen() as syncs:
        ChunkWork.run_batch(work)
    for w in work:
        w.engine.finish(w.future.result())
    return dict(syncs)


def answer_syncs(rt: Runtime, engine: StreamEngine) -> dict[str, int]:
    """Where a 16-token answer waits for the device (a decode step's tokens are read each step)."""
    params = GenerationParams(max_tokens=16)
    ask(rt, engine.head, "What happened?", params)
    with syncs_seen() as syncs:
        ask(rt, engine.head, "What happened?", params)
    return dict(syncs)


if __name__ == "__main__":
    main()
