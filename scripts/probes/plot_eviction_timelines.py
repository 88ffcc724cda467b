"""The plot of pipeline-h200-2026-11-25-64-eviction-timelines.txt: versions published and caches
re-laid out per second around 64 cameras' first evictions, one panel per run.

    python scripts/probes/plot_eviction_timelines.py docs/bench/pipeline-h200-2026-11-25-64-eviction-timelines.txt \
        docs/bench/pipeline-h200-2026-11-25-64-eviction-storms.png

Needs matplotlib (a tool for the docs, not a dependency of the services).
"""

from __future__ import annotations

import sys
from pathlib import Path

LIVE = 32  # versions a second that 64 cameras at 2 fps need (4 frames a chunk)


def runs(text: str) -> list[tuple[str, list[tuple[int, int, int]]]]:
    """(title, [(second, versions, relayouts)]) per run, seconds from the run's first row."""
    out: list[tuple[str, list[tuple[int, int, int]]]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            out.append((line[3:], []))
        elif line and not line.startswith("#") and out:
            clock, versions, relayouts, _ = line.split()
            h, m, s = (int(x) for x in clock.split(":"))
            out[-1][1].append((h * 3600 + m * 60 + s, int(versions), int(relayouts)))
    return [(title, [(t - rows[0][0], v, r) for t, v, r in rows]) for title, rows in out]


def main() -> None:
    import matplotlib  # here, not at the top: the runs' parsing is importable without it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the headless backend

    source, png = Path(sys.argv[1]), Path(sys.argv[2])
    panels = runs(source.read_text())
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.6 * len(panels)), sharex=True)
    for ax, (title, rows) in zip(axes, panels, strict=True):
        t = [r[0] for r in rows]
        ax.bar(t, [r[1] for r in rows], width=0.8, color="tab:blue", label="versions published")
        ax.plot(t, [r[2] for r in rows], "o-", color="tab:red", markersize=3, label="caches re-laid out")
        ax.axhline(LIVE, color="grey", linestyle="--", linewidth=1, label="needed to stay live")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("per second")
        ax.set_ylim(0, 55)
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("seconds, from 8 s before the first re-layout")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
