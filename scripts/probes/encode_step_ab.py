"""The encode-step A/B of 2026-11-25 (encode-step-ab-h100-2026-11-25.txt), tidied from the script
as it was run (the same steps; its first two runs printed the first two fields only).

One encode step of 8 streams' chunks (vision + prefill, 4 frames of 448x448 each) over caches of
25-31K tokens made from zeros, timed over 8 steps after 3, then one step profiled. Run from the
root of the code to measure (`PYTHONPATH=. python3 scripts/probes/encode_step_ab.py [warm]`; `warm`:
after the worker's warm-up); `MODEL DEVICE` as the first two arguments (default random-3b cuda).
"""

import json
import sys
import time

import numpy as np
import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from common.engine.eviction import EvictionPolicy
from common.engine.grid import Grid, StreamSpec
from common.engine.model import load_model
from common.engine.runtime import Runtime
from common.engine.stream_engine import ChunkWork, StreamEngine
from common.engine.warmup import warm_up


def main() -> None:
    warm = "warm" in sys.argv
    args = [a for a in sys.argv[1:] if a != "warm"]
    model, device = args[:2] if len(args) >= 2 else ("random-3b", "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.set_num_threads(1)
    rt = Runtime(load_model(model, device=device), pool_tokens=600_000)
    if warm:
        print("warm-up s", warm_up(rt), file=sys.stderr)
    grid = Grid(448, 448)
    frames = list(np.random.default_rng(0).integers(0, 256, (4, 448, 448, 3), dtype=np.uint8))
    policy = EvictionPolicy(max_cache_tokens=40000)
    engines = [StreamEngine(rt, StreamSpec(f"s{i}", 2.0, grid, 4), policy) for i in range(8)]
    patches = (25000 if device == "cuda" else 600) // grid.tokens_per_patch
    for e in engines:
        embeds = torch.zeros(patches * grid.tokens_per_patch, rt.lm.embed_tokens.embedding_dim, device=rt.device)
        e.append_embeddings(embeds, patches, (0, 2 * patches - 1), (0.0, float(patches)))
    seq = [2 * patches]

    def step() -> None:
        s = seq[0]
        seq[0] += 4
        times, seqs = [float(s + i) for i in range(4)], list(range(s, s + 4))
        batch = [ChunkWork(e, e.prepare(frames, times, seqs)) for e in engines]
        ChunkWork.run_batch(batch)
        for e, j in zip(engines, batch, strict=True):
            e.finish(j.future.result())

    for _ in range(3):
        step()
    sync()
    n, t0 = 8, time.perf_counter()
    for _ in range(n):
        step()
    sync()
    ms = (time.perf_counter() - t0) / n * 1000
    with profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
        step()
        sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70), file=sys.stderr)
    reserved = torch.cuda.memory_reserved() / 2**30 if device == "cuda" else 0
    graphs = len(rt.step_graphs.graphs) if rt.step_graphs else 0
    result = {"ms_per_step_8_chunks": round(ms, 1), "cache_tokens": engines[0].head.tokens, "warm": warm}
    print(json.dumps({**result, "frames": dict(counters["frames"]), "graphs": graphs, "mem_reserved_gib": reserved}))


if __name__ == "__main__":
    main()
