"""Many caches reaching their budget together (cameras started together), in the engine alone.

8 streams' caches filled to just under a 32,768-token budget from made-up embeddings in 512-token
chunks, then encode steps of 8 real 448x448 chunks (4 frames each) until every cache has evicted
a quarter, then a few more. Prints, as JSON lines, each step's wall time (synchronised), how many
caches it re-laid out and the host time spent in `_relayout`. Run from the root of the code to
measure: `PYTHONPATH=. python3 scripts/probes/eviction_storm.py [warm] [profile]`. `warm`: the
worker's warm-up first; `profile`: a table of where the evicting step's time went (its wall time
then counts the profiler's too); `tiny-random cpu 2048` as the first arguments: a smoke run.
"""

import contextlib
import json
import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from common.engine.eviction import EvictionPolicy
from common.engine.grid import Grid, StreamSpec
from common.engine.kvcache import StreamCache
from common.engine.model import load_model
from common.engine.runtime import Runtime
from common.engine.stream_engine import ChunkWork, StreamEngine
from common.engine.warmup import warm_up
from common.logs import configure_logging

BUDGET = 32768
ACTIVITIES = {"cuda": [ProfilerActivity.CPU, ProfilerActivity.CUDA], "cpu": [ProfilerActivity.CPU]}
STREAMS = 8


def main() -> None:
    args = [a for a in sys.argv[1:] if a not in ("warm", "profile")]
    model, device, budget = (args[0], args[1], int(args[2])) if args else ("random-3b", "cuda", BUDGET)
    configure_logging("INFO")  # the engine's log lines on stderr: stdout is the JSON
    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rt = Runtime(load_model(model, device=device), pool_tokens=600_000 if device == "cuda" else None)
    if "warm" in sys.argv:
        print(json.dumps({"warm_up_s": round(warm_up(rt), 1)}), flush=True)
    relayout_s = [0.0]
    inner = StreamCache._relayout

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            relayout_s[0] += time.perf_counter() - t0

    StreamCache._relayout = timed
    grid = Grid(448, 448)
    policy = EvictionPolicy(max_cache_tokens=budget)
    engines = [StreamEngine(rt, StreamSpec(f"s{i}", 2.0, grid, 4), policy) for i in range(STREAMS)]
    tpp, seq = grid.tokens_per_patch, 0
    t0 = time.perf_counter()
    while engines[0].head.tokens + 4 * tpp < budget:
        for e in engines:
            embeds = torch.zeros(2 * tpp, rt.lm.embed_tokens.embedding_dim, device=rt.device)
            e.append_embeddings(embeds, 2, (seq, seq + 3), (seq / 2, seq / 2 + 1.5))
        seq += 4
    sync()
    print(json.dumps({"filled_s": round(time.perf_counter() - t0, 1), "tokens": engines[0].head.tokens}), flush=True)
    frames = list(np.random.default_rng(0).integers(0, 256, (4, 448, 448, 3), dtype=np.uint8))
    done_after = None
    for step in range(40):
        relayouts, relayout_s[0] = sum(rt.pool.relayouts.values()), 0.0
        t0 = time.perf_counter()
        times, seqs = [seq / 2 + i / 2 for i in range(4)], list(range(seq, seq + 4))
        evicting = "profile" in sys.argv and engines[0].head.tokens + 2 * tpp > budget
        with profile(activities=ACTIVITIES[device]) if evicting else contextlib.nullcontext() as prof:
            batch = [ChunkWork(e, e.prepare(frames, times, seqs)) for e in engines]
            ChunkWork.run_batch(batch)
            for e, j in zip(engines, batch, strict=True):
                e.finish(j.future.result())
            sync()
        if evicting:  # where the host spent the evicting step
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        seq += 4
        ms = (time.perf_counter() - t0) * 1000
        n = sum(rt.pool.relayouts.values()) - relayouts
        row = {"step": step, "ms": round(ms, 1), "relayouts": n, "relayout_host_ms": round(relayout_s[0] * 1000, 1)}
        print(json.dumps({**row, "tokens": [e.head.tokens for e in engines][:2]}), flush=True)
        if done_after is None and all(e.head.stats.evictions for e in engines):
            done_after = step
        if done_after is not None and step >= done_after + 4:
            break


if __name__ == "__main__":
    main()
