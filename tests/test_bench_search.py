"""scripts/bench_search.py end to end on a small past: it builds the indexes, searches them through
the index process and reports every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_search_reports_its_times(tmp_path: Path):
    args = ["--cameras", "2", "--hours", "0.05", "--searches", "3", "--model", "tiny-random", "--dir", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, "-m", "scripts.bench_search", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert (report["cameras"], report["chunks_per_camera"]) == (2, 90)  # 0.05 h at 2 fps, 4 frames a chunk
    assert report["fixture"]["cameras"] == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["cam000", "cam001"]
    for kind in ("whole_past_s", "last_hour_s"):
        times = report[kind]
        assert 0 < times["p50"] <= times["p95"] <= times["max"]
    assert report["start_s"] > 0 and report["first_s"] > 0
