"""Encoder lag and frames dropped over a pipeline run's measured window, one line per run.

Draws two panels sharing the x axis (seconds into the measured window): the encoder lag (s) on
top and the frames dropped so far below, one line per log, labelled by its camera count or by
the label given with it (`LABEL=LOG`).
The logs are bench_pipeline.py's progress (its stderr; `scripts/gpu_run.sh pipeline` keeps it
as pipeline.log); only measured-window lines such as
`[00:42:08] 64 cameras: 16/150 s, 152 asked, 0 errors, 0 frames dropped, encoder lag 4.8 s`
are read (warm-up and other lines are skipped).

Needs matplotlib, a tool for the docs and not a dependency of the project:

    python scripts/probes/plot_lag.py [--title TITLE] OUT.png [LABEL=]LOG [[LABEL=]LOG ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

TITLE = "Encoder lag while 8 askers ask, H200, random-3b: 64 cameras fall behind, 56 keep up (150 s windows)"
LINE = re.compile(
    r"(?P<cameras>\d+) cameras: (?P<t>[\d.]+)/[\d.]+ s, .*?"
    r"(?P<dropped>\d+) frames dropped, encoder lag (?P<lag>[\d.]+) s"
)

Point = tuple[float, float, int]  # (seconds into the window, encoder lag s, frames dropped so far)


def parse(path: str) -> tuple[int, list[Point]]:
    """The log's camera count and its measured-window points, in order."""
    cameras = 0
    points: list[Point] = []
    for line in Path(path).read_text().splitlines():
        if m := LINE.search(line):
            cameras = int(m["cameras"])
            points.append((float(m["t"]), float(m["lag"]), int(m["dropped"])))
    if not points:
        raise SystemExit(f"{path}: no measured-window progress lines")
    return cameras, points


def plot_run(lag_ax: Axes, drop_ax: Axes, label: str, points: list[Point]) -> None:
    """One run's line on each panel."""
    t, lag, dropped = zip(*points, strict=True)
    lag_ax.plot(t, lag, marker=".", label=label)
    drop_ax.plot(t, dropped, marker=".", label=label)


def draw(out: str, logs: list[str], title: str = TITLE) -> None:
    """Both panels for all logs, saved to out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lag_ax, drop_ax) = plt.subplots(2, 1, sharex=True, figsize=(8, 5), dpi=120)
    for log in logs:
        label, _, path = log.rpartition("=")
        cameras, points = parse(path)
        plot_run(lag_ax, drop_ax, label or f"{cameras} cameras", points)
    lag_ax.set_ylabel("encoder lag (s)")
    drop_ax.set_ylabel("frames dropped (cumulative)")
    drop_ax.set_xlabel("seconds into the measured window")
    lag_ax.legend(loc="upper left")
    drop_ax.legend(loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    args, title = sys.argv[1:], TITLE
    if args[:1] == ["--title"] and len(args) > 1:
        args, title = args[2:], args[1]
    if len(args) < 2:
        raise SystemExit("usage: python scripts/probes/plot_lag.py [--title TITLE] OUT.png [LABEL=]LOG ...")
    draw(args[0], args[1:], title)


if __name__ == "__main__":
    main()
