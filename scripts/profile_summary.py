"""Where a GPU scheduler step's time went, from a trace `gpu_profile_dir` wrote (SIGUSR2; or
bench_pipeline.py --profile): one JSON object per step kind (encode, decode, task).

For each kind, means per step: wall time; device busy time (the union of kernel, copy and set
intervals that fall in the step, so overlapping decode and encode kernels count once); the
device's idle share of the step (host-bound when high); time the host sat in CUDA synchronising
calls; kernels launched; the kernels that took the most device time in all steps of that kind;
and where the device's idle time lies (`idle_ms`): before the step's first device work, after its
last, and between, the last split by what the step's thread was in when each gap began: the
innermost op around that moment (`(python)` when in none: the host was between torch calls), and
the innermost phase of the step (`common/engine/profiling.phase`: vision, plan, prefill, publish,
a decode step's launch or completion). And where the device's busy time came from
(`device_ms`): each kernel's and copy's time by the phase, and by the phase and innermost op, its
launch was made in (a CUDA graph's kernels: its replay's).

    python scripts/profile_summary.py traces/gpu-steps-20261124-120000.json.gz
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from common.engine.scheduler import STEP_KINDS

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
INNERMOST_SCAN = 2000  # host ranges looked back through for the one around a moment
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "user_annotation")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # Triton launches through the driver API
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


def gaps(busy: list[tuple[float, float]], start: float, stop: float) -> list[tuple[float, float]]:
    """The intervals of [start, stop] that no interval of `busy` covers."""
    out, at = [], start
    for b0, b1 in sorted(busy):
        if b0 > at:
            out.append((at, min(b0, stop)))
        at = max(at, b1)
        if at >= stop:
            break
    if at < stop:
        out.append((at, stop))
    return [(a, b) for a, b in out if b > a]


def innermost(ops: list[dict[str, Any]], starts: list[float], t: float, outside: str = "(python)") -> str:
    """The name of the innermost of `ops` (sorted by start, `starts` their starts) running at `t`:
    of nested ranges, the one that started last; `outside` when none is."""
    for e in reversed(ops[max(0, bisect.bisect_right(starts, t) - INNERMOST_SCAN) : bisect.bisect_right(starts, t)]):
        if t < e["ts"] + e["dur"]:
            return e["name"][:60]
    return outside


def idle(step: dict[str, Any], busy: list[tuple[float, float]], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """One step's idle device time (us): before its first device work, after its last, and the
    gaps between by the op, and by the phase (profiling.phase), its thread was in when each began."""
    start, stop = step["ts"], step["ts"] + step["dur"]
    holes = gaps(busy, start, stop)
    phases = [e for e in ops if e.get("cat") == "user_annotation" and e["name"] not in STEP_KINDS]
    starts, phase_starts = [e["ts"] for e in ops], [e["ts"] for e in phases]
    out: dict[str, Any] = {"before_first": 0.0, "after_last": 0.0, "between": Counter(), "by_phase": Counter()}
    if not busy:
        out["before_first"] = stop - start
        return out
    for a, b in holes:
        if a == start:
            out["before_first"] += b - a
        elif b == stop:
            out["after_last"] += b - a
        else:
            out["between"][innermost(ops, starts, a)] += b - a
            out["by_phase"][innermost(phases, phase_starts, a, outside="(no phase)")] += b - a
    return out


def launched_in(
    inside: list[dict[str, Any]], launches: dict[int, dict[str, Any]], ops: list[dict[str, Any]]
) -> tuple[Counter[str], Counter[str]]:
    """Device time (us) of `inside` by the phase, and by "phase / op", that its launch was made in
    on the step's thread (`ops`); work whose launch is not in the trace counts as "(unknown)"."""
    calls = [e for e in ops if e.get("cat") not in LAUNCH_CATEGORIES]
    phases = [e for e in calls if e.get("cat") == "user_annotation" and e["name"] not in STEP_KINDS]
    starts, phase_starts = [e["ts"] for e in calls], [e["ts"] for e in phases]
    by_phase: Counter[str] = Counter()
    by_op: Counter[str] = Counter()
    for e in inside:
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is None:
            phase = op = "(unknown)"
        else:
            phase = innermost(phases, phase_starts, launch["ts"], outside="(no phase)")
            op = innermost(calls, starts, launch["ts"])
        by_phase[phase] += e["dur"]
        by_op[f"{phase} / {op}"] += e["dur"]
    return by_phase, by_op


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") in STEP_KINDS]
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    launch_of = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("name", "").startswith(SYNC_CALLS)]
    host = sorted((e for e in events if e.get("cat") in HOST_CATEGORIES and "dur" in e), key=lambda e: e["ts"])
    host_starts = [e["ts"] for e in host]
    per_kind: dict[str, dict[str, Any]] = defaultdict(
        lambda: {
            "steps": 0,
            "wall": 0.0,
            "busy": 0.0,
            "sync": 0.0,
            "before": 0.0,
            "after": 0.0,
            "between": Counter(),
            "by_phase": Counter(),
            "device_by_phase": Counter(),
            "device_by_op": Counter(),
        }
    )
    top: dict[str, Counter[str]] = defaultdict(Counter)
    launches: Counter[str] = Counter()
    for step in steps:
        start, stop = step["ts"], step["ts"] + step["dur"]
        inside = [e for e in device if start <= e["ts"] < stop]
        acc = per_kind[step["name"]]
        acc["steps"] += 1
        acc["wall"] += step["dur"]
        busy = [(e["ts"], min(stop, e["ts"] + e["dur"])) for e in inside]
        acc["busy"] += union_us(busy)
        during = host[bisect.bisect_left(host_starts, start) : bisect.bisect_left(host_starts, stop)]
        ops = [e for e in during if e["tid"] == step["tid"] and e is not step]
        gapped = idle(step, busy, ops)
        acc["before"] += gapped["before_first"]
        acc["after"] += gapped["after_last"]
        acc["between"] += gapped["between"]
        acc["by_phase"] += gapped["by_phase"]
        by_phase, by_op = launched_in(inside, launch_of, ops)
        acc["device_by_phase"] += by_phase
        acc["device_by_op"] += by_op
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
            "idle_ms": {
                "before_first": round(acc["before"] / n / 1000, 2),
                "after_last": round(acc["after"] / n / 1000, 2),
                "between": round(sum(acc["between"].values()) / n / 1000, 2),
                "between_by_op": {op: round(us / n / 1000, 2) for op, us in acc["between"].most_common(10)},
                "between_by_phase": {ph: round(us / n / 1000, 2) for ph, us in acc["by_phase"].most_common(10)},
            },
            "device_ms": {
                "by_phase": {ph: round(us / n / 1000, 2) for ph, us in acc["device_by_phase"].most_common()},
                "by_phase_op": {op: round(us / n / 1000, 2) for op, us in acc["device_by_op"].most_common(20)},
            },
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
