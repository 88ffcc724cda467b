"""Where a lone question's decode step goes at a long cache: prints JSON.

Per cache size and split-KV factor: the step as the engine runs it (`Generation.step_batch`, host
planning and a graph replay and the token read back), the graph replayed alone back to back (the
device's time for a step, no host work between), the host's share (padding, plan, copies), and
the kernels of one replay by time. A step slower than its replay alone is waiting on the host.

    PYTHONPATH=. python3 scripts/probes/decode_step_probe.py --sizes 32768,100000 --splits 0,8,16,32,64
(split 0: the engine's own choice). `--eager-ops`: also one step launched eagerly, its GPU work by
the op that launched it (which op each of the graph's kernels comes from).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from common.engine.answer import Generation
from common.engine.lm import LanguageModel
from common.engine.model import load_model
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.logs import configure_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, wherever it is run from
from bench_engine import QUESTION, filled_engine, free_gpu


def steps_ms(rt: Runtime, version, n: int) -> float:
    """Mean wall ms of a decode step, the question prefilled first and not counted."""
    work = Generation(rt, version, QUESTION, GenerationParams(max_tokens=n + 2))
    Generation.step_batch([work])  # prefill
    Generation.step_batch([work])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        Generation.step_batch([work])
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1000


def decode_graph(rt: Runtime):
    return next(g for key, g in rt.step_graphs.graphs.items() if key[0] == (1,))


def replay_ms(graph, n: int = 100) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.graph.replay()
    start.record()
    for _ in range(n):
        graph.graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / n


def host_ms(rt: Runtime, version, n: int = 50) -> dict:
    """The host's part of a step, timed apart: padding and planning, then the copies into the graph."""
    work = Generation(rt, version, QUESTION, GenerationParams(max_tokens=4))
    Generation.step_batch([work])
    graphs, lm = rt.step_graphs, rt.lm
    items = [work.item()]
    t0 = time.perf_counter()
    for _ in range(n):
        tokens, positions, padded, last = graphs.padded(work.pending, [work.pos], items)
        split = lm.split_for(len(padded), 1, version.tokens)
        plan = lm.plan(padded, split, device=False, max_k_floor=(graphs.OWN_TOKENS, -(-graphs.base_tokens // split)))
    t1 = time.perf_counter()
    graph = decode_graph(rt)
    for _ in range(n):
        graph.io.copy_(torch.tensor([tokens, positions, positions, positions]), non_blocking=True)
        graph.last.copy_(torch.tensor(last), non_blocking=True)
        graph.plan.longs.copy_(plan.longs, non_blocking=True)
        graph.plan.ints.copy_(plan.ints, non_blocking=True)
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    work.scratch = None
    return {"plan_ms": round((t1 - t0) / n * 1000, 3), "copies_ms": round((t2 - t1) / n * 1000, 3)}


def kernels(graph, n: int = 5) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.graph.replay()
        torch.cuda.synchronize()
    spans, by_name = [], defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((e.time_range.start, e.time_range.end))
            by_name[e.name[:90]][0] += 1
            by_name[e.name[:90]][1] += e.time_range.elapsed_us()
    spans.sort()
    busy = sum(b - a for a, b in spans)
    span = spans[-1][1] - spans[0][0]
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:14]
    return {
        "kernels_per_step": len(spans) // n,
        "busy_ms_per_step": round(busy / n / 1000, 3),
        "span_ms_per_step": round(span / n / 1000, 3),
        "top": [{"name": k, "count": c // n, "us_per_step": round(t / n, 1)} for k, (c, t) in top],
    }


def eager_ops(rt: Runtime, version) -> list[dict]:
    """One decode step launched eagerly (no graph): device time and count by op."""
    from torch.profiler import ProfilerActivity, profile

    from common.engine import answer

    answer.CUDA_GRAPHS = False
    try:
        work = Generation(rt, version, QUESTION, GenerationParams(max_tokens=8))
        for _ in range(3):
            Generation.step_batch([work])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            Generation.step_batch([work])
            torch.cuda.synchronize()
    finally:
        answer.CUDA_GRAPHS = True
    rows = [
        {"op": e.key, "count": e.count, "device_us": round(e.self_device_time_total, 1)}
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r["count"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random-3b")
    p.add_argument("--sizes", default="32768,100000")
    p.add_argument("--splits", default="0,8,16,32,64")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--eager-ops", action="store_true")
    args = p.parse_args()
    configure_logging("INFO")  # the engine's log lines (graph captures) on stderr: stdout is the JSON
    rt = Runtime(load_model(args.model, device="cuda"), pool_tokens=400_000)
    own_split = LanguageModel.split_for
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for size in (int(s) for s in args.sizes.split(",")):
        version = filled_engine(rt, size).head
        for split in (int(s) for s in args.splits.split(",")):
            LanguageModel.split_for = own_split if split == 0 else (lambda self, *a, s=split, **k: s)
            rt.step_graphs = None  # graphs of this split
            steps_ms(rt, version, 4)
            row = {"cache_tokens": version.tokens, "split": split or own_split(rt.lm, 1, 1, version.tokens)}
            row["step_ms"] = round(steps_ms(rt, version, args.steps), 3)
            graph = decode_graph(rt)
            row["replay_ms"] = round(replay_ms(graph), 3)
            row.update(host_ms(rt, version))
            row.update(kernels(graph))
            print(json.dumps(row), file=sys.stderr, flush=True)
            out["rows"].append(row)
        LanguageModel.split_for = own_split
        if args.eager_ops:
            out.setdefault("eager_ops", {})[version.tokens] = eager_ops(rt, version)
        rt.step_graphs = None
        del version
        free_gpu()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
