"""Table and plot of bench_pipeline.py results: cameras vs dropped frames and question latency.

    python scripts/plot_pipeline.py pipeline-h200.json                      # prints a markdown table
    python scripts/plot_pipeline.py pipeline-h200.json --png pipeline.png   # and draws the plot

Reads the --out file of bench_pipeline.py, or its stdout (one JSON line per run); several files
are merged, so a sweep split over several calls makes one table. With `--series`, each file is
its own line in the plot, named by the file (before and after a change, say). The plot needs
matplotlib (`pip install matplotlib`: a tool for the docs, not a dependency of the services).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

Run = dict[str, Any]


def load_runs(paths: list[str]) -> list[Run]:
    """Every measured run in the files, by camera count (failed runs and summary lines left out)."""
    runs: list[Run] = []
    for path in paths:
        text = Path(path).read_text()
        try:
            runs += json.loads(text)["runs"]
        except (json.JSONDecodeError, KeyError, TypeError):  # stdout: one JSON object per line
            runs += [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return sorted((r for r in runs if "frames" in r), key=lambda r: (r["cameras"], r["askers"]))


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f}"


KEPT_UP = {True: "yes", False: "no", None: "–"}  # –: a run from before bench_pipeline reported it


def table(runs: list[Run]) -> str:
    rows = [
        "| cameras | askers | frames dropped | encoded per camera min / max | encoder lag p50 / max | answers/s "
        "| client latency p50 / p95 | server first token p50 / p95 | errors | kept up |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        f, lag, client, first = r["frames"], r["encoder_lag_s"], r["client_latency_s"], r["server_first_token_s"]
        dropped = "–" if f["dropped_fraction"] is None else f"{f['dropped_fraction']:.0%} ({f['dropped']['total']})"
        rows.append(
            f"| {r['cameras']} | {r['askers']} | {dropped} | {f['encoded']['min']} / {f['encoded']['max']} "
            f"| {_s(lag['p50'])} / {_s(lag['max'])} s | {r['answers_per_s']:.2f} "
            f"| {_s(client['p50'])} / {_s(client['p95'])} s | {_ms(first['p50'])} / {_ms(first['p95'])} ms "
            f"| {r['errors']} | {KEPT_UP.get(r.get('kept_up'))} |"
        )
    return "\n".join(rows)


def not_encoded(run: Run) -> float:
    """The share of the window's published frames not encoded in it: dropped, or waiting in a
    backlog (a run can drop nothing in its window and still not keep up)."""
    published = run["frames"]["published"]["total"]
    return 1 - run["frames"]["encoded"]["total"] / published if published else 0.0


def plot(series: dict[str, list[Run]], dst: str) -> None:
    """Drops and latency against cameras; one set of lines per series (an empty name: only one)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the plot needs matplotlib: pip install matplotlib (the table above needs nothing)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the headless backend

    fig, (drops, latency) = plt.subplots(2, 1, sharex=True, figsize=(6.4, 6.0), dpi=120)
    markers = iter("os^vD*")
    for name, runs in series.items():
        cams, mark, tag = [r["cameras"] for r in runs], next(markers), f"{name}: " if name else ""
        dropped = [100 * (r["frames"]["dropped_fraction"] or 0) for r in runs]
        drops.plot(cams, dropped, f"{mark}-", label=f"{tag}dropped")
        waiting = [100 * not_encoded(r) for r in runs]
        drops.plot(cams, waiting, f"{mark}:", label=f"{tag}not encoded (dropped or waiting)")
        for key, label, color in (
            ("client_latency_s", "client latency", "tab:blue"),
            ("server_first_token_s", "server first token", "tab:green"),
        ):
            for q, style in (("p50", "--"), ("p95", "-")):
                values = [r[key][q] for r in runs]
                latency.plot(cams, values, f"{mark}{style}", color=color, label=f"{tag}{label} {q}")
    drops.set_ylabel("of the frames published (%)")
    drops.legend(fontsize=7)
    every = sorted({r["cameras"] for runs in series.values() for r in runs})
    runs = [r for rs in series.values() for r in rs]
    latency.set_yscale("log")
    latency.set_ylabel("seconds (log)")
    latency.set_xlabel(f"live {runs[0]['fps']:g}-fps cameras")
    latency.set_xscale("log", base=2)
    latency.set_xticks(every, [str(c) for c in every])
    latency.legend(fontsize=7)
    first = runs[0]
    drops.set_title(
        f"{first['model']} on {first['device']}, {first['askers']} askers, {first['max_tokens']}-token answers"
    )
    for ax in (drops, latency):
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(dst)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("results", nargs="+", help="bench_pipeline.py --out files or captured stdout")
    p.add_argument("--png", help="draw the plot into this file")
    p.add_argument("--series", action="store_true", help="in the plot, each file is a series named by the file")
    ns = p.parse_args(argv)
    runs = load_runs(ns.results)
    if not runs:
        raise SystemExit(f"no measured runs in {ns.results}")
    print(table(runs))
    clean = [r["cameras"] for r in runs if r["frames"]["dropped"]["total"] == 0]
    kept = [r["cameras"] for r in runs if r.get("kept_up")]
    print(f"\nmost cameras with zero dropped frames: {max(clean) if clean else 'none'}")
    print(f"most cameras the encoder kept up with (no drops, no growing backlog): {max(kept) if kept else 'none'}")
    if ns.png:
        plot({Path(f).stem: load_runs([f]) for f in ns.results} if ns.series else {"": runs}, ns.png)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
