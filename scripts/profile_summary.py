"""Where a GPU scheduler step's time went, from a trace `gpu_profile_dir` wrote (SIGUSR2; or
bench_pipeline.py --profile): one JSON object per step kind (encode, decode, task).

For each kind, means per step: wall time; device busy time (the union of kernel, copy and set
intervals that fall in the step, so overlapping decode and encode kernels count once); the
device's idle share of the step (host-bound when high); time the host sat in CUDA synchronising
calls; kernels launched; and the kernels that took the most device time in all steps of that kind.

    python scripts/profile_summary.py traces/gpu-steps-20261124-120000.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

KINDS = ("encode", "decode", "task")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def load(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return json.loads(data)["traceEvents"]


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") in KINDS]
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("name", "").startswith(SYNC_CALLS)]
    per_kind: dict[str, dict[str, Any]] = defaultdict(lambda: {"steps": 0, "wall": 0.0, "busy": 0.0, "sync": 0.0})
    top: dict[str, Counter[str]] = defaultdict(Counter)
    launches: Counter[str] = Counter()
    for step in steps:
        start, stop = step["ts"], step["ts"] + step["dur"]
        inside = [e for e in device if start <= e["ts"] < stop]
        acc = per_kind[step["name"]]
        acc["steps"] += 1
        acc["wall"] += step["dur"]
        acc["busy"] += union_us([(e["ts"], min(stop, e["ts"] + e["dur"])) for e in inside])
        acc["sync"] += sum(e["dur"] for e in syncs if start <= e["ts"] < stop)
        launches[step["name"]] += sum(e.get("cat") == "kernel" for e in inside)
        for e in inside:
            top[step["name"]][e["name"][:80]] += e["dur"]
    out = {}
    for kind, acc in per_kind.items():
        n = acc["steps"]
        out[kind] = {
            "steps": n,
            "wall_ms": round(acc["wall"] / n / 1000, 2),
            "device_busy_ms": round(acc["busy"] / n / 1000, 2),
            "device_idle_share": round(1 - acc["busy"] / acc["wall"], 3) if acc["wall"] else None,
            "host_sync_ms": round(acc["sync"] / n / 1000, 2),
            "kernels": round(launches[kind] / n, 1),
            "top_kernels_ms": {name: round(us / n / 1000, 3) for name, us in top[kind].most_common(8)},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path, help="a gpu-steps-*.json.gz")
    ns = p.parse_args(argv)
    print(json.dumps({"trace": str(ns.trace), **summarize(load(ns.trace))}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
