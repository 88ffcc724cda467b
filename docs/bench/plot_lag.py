"""Encoder lag and frames dropped over a pipeline run's measured window, one line per run.

Reads bench_pipeline.py's progress (its stderr; `scripts/gpu_run.sh pipeline` keeps it as
pipeline.log), lines such as
`[00:42:08] 64 cameras: 16/150 s, 152 asked, 0 errors, 0 frames dropped, encoder lag 4.8 s`.
Needs matplotlib (a tool for the docs, not a dependency of the services):

    python docs/bench/plot_lag.py OUT.png LOG [LOG ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

LINE = re.compile(
    r"(?P<cameras>\d+) cameras: (?P<t>[\d.]+)/[\d.]+ s, .*?"
    r"(?P<dropped>\d+) frames dropped, encoder lag (?P<lag>[\d.]+) s"
)


def parse(path: str) -> tuple[int, list[tuple[float, float, int]]]:
    """(cameras, [(seconds into the window, encoder lag s, frames dropped so far)])."""
    points, cameras = [], 0
    for line in Path(path).read_text().splitlines():
        if m := LINE.search(line):
            cameras = int(m["cameras"])
            points.append((float(m["t"]), float(m["lag"]), int(m["dropped"])))
    return cameras, points


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, logs = sys.argv[1], sys.argv[2:]
    fig, (lag_ax, drop_ax) = plt.subplots(2, 1, sharex=True, figsize=(8, 5), dpi=120)
    for log in logs:
        cameras, points = parse(log)
        t, lag, dropped = zip(*points, strict=True)
        lag_ax.plot(t, lag, marker=".", label=f"{cameras} cameras")
        drop_ax.plot(t, dropped, marker=".", label=f"{cameras} cameras")
    lag_ax.set_ylabel("encoder lag (s)")
    drop_ax.set_ylabel("frames dropped (cumulative)")
    drop_ax.set_xlabel("seconds into the measured window")
    lag_ax.legend()
    fig.suptitle("Encoder lag while 8 askers ask, H200, random-3b: 64 cameras fall behind, 56 keep up", fontsize=10)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main()
