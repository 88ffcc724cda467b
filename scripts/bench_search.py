"""How long a search of the cameras' past takes in the index process, alone (issue 39 point 5: 24 h
of 64 cameras within 200 ms): the time from the worker's call to its hits, the question's vector
given (on a worker it is a forward on the GPU loop, kept by text after the first).

    python -m scripts.bench_search [--cameras 64] [--hours 24] [--searches 40] [--dir DIR]

Each camera's index is history_fixture's (random unit vectors of the model's real size, one camera's
graph built and copied to the others), under DIR (default: a temporary directory; given, an index
left there by an earlier run is used again). Then one `IndexProcess` (qa_worker/index_process.py)
as a worker starts it: spawned and every index opened (`start_s`), a first search (`first_s`);
then `--searches` searches of all cameras over the whole past and as many over its last hour,
each with another random question vector. Prints one JSON object: the machine, the fixture and the times (seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qa_worker.index_process import IndexProcess
from scripts.history_fixture import Past, feature_shape, prefill, random_vectors

FPS, CHUNK_FRAMES, LIMIT = 2.0, 4, 10


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50": round(statistics.median(ordered), 4),
        "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 4),
        "max": round(ordered[-1], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cameras", type=int, default=64)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--searches", type=int, default=40)
    parser.add_argument("--model", default="random-3b")
    parser.add_argument("--dir", help="where the indexes are (kept); default: a temporary directory")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-search-"))
    cams = [f"cam{i:03d}" for i in range(args.cameras)]
    now = time.time()
    past = Past.ending(now, FPS, CHUNK_FRAMES, log_hours=0.0, index_hours=args.hours)
    fixture = None
    if not all((root / cam).is_dir() for cam in cams):
        print(f"building {args.cameras} cameras' indexes of {args.hours} h under {root}", file=sys.stderr)
        fixture = prefill(root, cams, video="", model=args.model, past=past)
    layers, dim = feature_shape(args.model)
    vectors = random_vectors(2 * args.searches + 1, len(layers), dim, seed=1)
    process = IndexProcess(str(root))
    try:
        t0 = time.perf_counter()
        model, layers = next(iter(process.kinds(cams).values()))  # every camera's: one copied graph
        start = time.perf_counter() - t0  # the process spawned, every index opened

        def search(i: int, since: float) -> None:
            process.moments(cams, model, {layers: vectors[i]}, since, float("inf"), LIMIT)

        first = timed(lambda: search(0, float("-inf")))
        whole = [timed(lambda i=i: search(i, float("-inf"))) for i in range(1, args.searches + 1)]
        hour = [timed(lambda i=i: search(args.searches + i, now - 3600)) for i in range(1, args.searches + 1)]
    finally:
        process.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "commit": commit,
                "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
                "cameras": args.cameras,
                "hours": args.hours,
                "chunks_per_camera": past.index_chunks,
                "vector": f"{dim} float16 ({len(layers)} layers)",
                "fixture": fixture,
                "limit": LIMIT,
                "start_s": round(start, 4),
                "first_s": round(first, 4),
                "whole_past_s": summary(whole),
                "last_hour_s": summary(hour),
            }
        )
    )


if __name__ == "__main__":
    main()
