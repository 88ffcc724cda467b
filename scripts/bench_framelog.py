"""Disk bytes a camera-hour of the frames log, and write bytes/s a camera (README "Frames log").

    python scripts/bench_framelog.py [VIDEO ...]

For each video (default: the generated sample video, 448x448): a private redis-server, the real
`streamvqa ingest` of the file at 2 fps onto a 448x448-pixel grid (min_pixels = max_pixels =
200704: 448x448 for a square source, the nearest 28-multiple grid of that area otherwise), the
real `streamvqa recorder` into a temporary directory; then the log's bytes (data and index) per
frame, a camera-hour at 2 fps, the bytes/s a camera writes, and the mean group commit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import redis

from apps.samplevideo import write_sample_video
from common.framelog import FrameLog
from common.wire import keys

FPS = 2.0
PIXELS = 448 * 448
CAM = "bench"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(video: str, workdir: Path) -> dict[str, float]:
    port, metrics_port = free_port(), free_port()
    server = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    env = {**os.environ, "SVQA_REDIS_URL": url, "SVQA_LOG_LEVEL": "WARNING"}
    cli = [sys.executable, "-m", "apps.cli"]
    log_dir = workdir / "frames"
    try:
        time.sleep(0.5)
        recorder = subprocess.Popen(
            [*cli, "recorder", "--streams", CAM, "--framelog-dir", str(log_dir), "--metrics-port", str(metrics_port)],
            env=env,
        )
        pixels = ("--min-pixels", str(PIXELS), "--max-pixels", str(PIXELS))
        ingest = [*cli, "ingest", "--url", video, "--stream", CAM, "--fps", str(FPS), "--max-backlog", "100000"]
        subprocess.run([*ingest, *pixels], env=env, check=True)
        r = redis.Redis.from_url(url)
        frames = r.xlen(keys.frames(CAM)) - 1  # less the end-of-stream marker
        while (span := FrameLog(log_dir).span(CAM)) is None or span.frames < frames:
            time.sleep(0.2)
        meta = r.hgetall(keys.meta(CAM))
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        recorder.terminate()
        recorder.wait(timeout=30)
    finally:
        server.terminate()
    commit = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith(("svqa_recorder_commit_seconds_sum", "svqa_recorder_commit_seconds_count"))
    }
    per_frame = span.bytes / span.frames
    return {
        "frames": span.frames,
        "grid": f"{int(meta[b'width'])}x{int(meta[b'height'])}",
        "bytes_per_frame": per_frame,
        "bytes_per_frame_448": per_frame * PIXELS / (int(meta[b"width"]) * int(meta[b"height"])),
        "commit_mean_ms": 1000
        * commit["svqa_recorder_commit_seconds_sum"]
        / commit["svqa_recorder_commit_seconds_count"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("videos", nargs="*")
    videos = p.parse_args().videos
    with tempfile.TemporaryDirectory() as d:
        if not videos:
            videos = [write_sample_video(os.path.join(d, "sample.mp4"), seconds=60, fps=10, width=448, height=448)]
        for video in videos:
            with tempfile.TemporaryDirectory() as work:
                out = run(video, Path(work))
            hour = out["bytes_per_frame_448"] * FPS * 3600
            print(
                f"{Path(video).name}: {out['frames']} frames on a {out['grid']} grid, "
                f"{out['bytes_per_frame'] / 1024:.1f} KiB a frame "
                f"({out['bytes_per_frame_448'] / 1024:.1f} KiB scaled to 448x448): "
                f"{hour / 1e9:.2f} GB a camera-hour, {hour * 24 / 1e9:.1f} GB a camera-day, "
                f"{out['bytes_per_frame_448'] * FPS / 1e3:.0f} kB/s a camera at {FPS:g} fps; "
                f"group commit {out['commit_mean_ms']:.1f} ms mean"
            )


if __name__ == "__main__":
    main()
