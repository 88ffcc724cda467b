"""How an encoder's chunks were batched over a pipeline run's window, from its worker's log.

A worker logs one "version published" line per chunk; the chunks of one encode step are
published together, within milliseconds, and the next step's come a step's time later. Lines
closer than `SAME_STEP_S` are taken as one step. Prints one JSON object per log: the steps of
the last `--window` seconds, split into full steps (`--max-chunks` chunks) and smaller ones,
with the seconds each kind took (from the previous step's publishing to its own) and the ms a
chunk that makes. A run whose encoder waits for chunks shows it as small steps taking long.

The logs are in `pipeline-logs.tgz`, as `scripts/gpu_run.sh pipeline` leaves it:

    tar xzf pipeline-logs.tgz && python scripts/probes/encode_steps.py [--window 150] pipeline-logs/*/worker-0.log
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from datetime import datetime
from pathlib import Path

SAME_STEP_S = 0.02


def publish_times(path: str) -> list[float]:
    times = []
    for line in Path(path).read_text().splitlines():
        if '"version published"' in line:
            times.append(datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00")).timestamp())
    return sorted(times)


def steps(times: list[float]) -> list[list[float]]:
    out = [[times[0]]]
    for t in times[1:]:
        if t - out[-1][-1] < SAME_STEP_S:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def summary(path: str, window_s: float, max_chunks: int) -> dict:
    times = publish_times(path)
    window = [s for s in steps(times) if s[0] > times[-1] - window_s]
    timed = [(b[0] - a[-1], len(b)) for a, b in itertools.pairwise(window)]

    def kind(sel: list[tuple[float, int]]) -> dict:
        seconds, chunks = sum(t for t, _ in sel), sum(n for _, n in sel)
        return {
            "steps": len(sel),
            "chunks": chunks,
            "seconds": round(seconds, 1),
            "ms_a_chunk": round(1000 * seconds / chunks, 1) if chunks else None,
            "ms_a_step_p50": round(1000 * statistics.median(t for t, _ in sel)) if sel else None,
        }

    return {
        "log": path,
        "window_s": window_s,
        "full": kind([x for x in timed if x[1] >= max_chunks]),
        "smaller": kind([x for x in timed if x[1] < max_chunks]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=150.0, help="the last this many seconds of each log")
    ap.add_argument("--max-chunks", type=int, default=8, help="the scheduler's max_chunks: a full step")
    ap.add_argument("logs", nargs="+")
    args = ap.parse_args()
    for path in args.logs:
        print(json.dumps(summary(path, args.window, args.max_chunks)))


if __name__ == "__main__":
    main()
