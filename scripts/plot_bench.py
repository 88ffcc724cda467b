"""Draw docs/bench/*.png from a bench_engine.py JSON result.

pip install matplotlib   # a tool for the docs, not a dependency of the services
python scripts/plot_bench.py docs/bench/engine-h200-2026-11-21.json docs/bench/first-token.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the headless backend


def main(src: str, dst: str) -> None:
    result = json.loads(Path(src).read_text())
    cache = result["cache"]
    sizes = [c["cache_tokens"] / 1000 for c in cache]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    ax.plot(sizes, [c["stateless_first_token_ms"] for c in cache], "o-", label="stateless: re-prefill the video")
    ax.plot(sizes, [c["first_token_ms"] for c in cache], "o-", label="streamvqa: question on the cached video")
    ax.set_yscale("log")
    ax.set_xlabel("video tokens already seen (thousands)")
    ax.set_ylabel("time to first answer token (ms, log)")
    ax.set_title(f"{result['model']} on {result['device']}, {result['dtype'].removeprefix('torch.')}")
    for c, x in zip(cache, sizes, strict=True):
        ax.annotate(
            f"{c['first_token_ms']:.0f} ms",
            (x, c["first_token_ms"]),
            textcoords="offset points",
            xytext=(0, -14),
            ha="center",
            fontsize=8,
        )
        ax.annotate(
            f"{c['stateless_first_token_ms']:.0f} ms",
            (x, c["stateless_first_token_ms"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
        )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
