"""Bytes and CPU per 448x448 frame for each wire codec (README "Redis sizing").

    python scripts/bench_frames.py

Two frames: one decoded from the generated sample video (flat shapes and text, as H.264 leaves
them) and a worst case of smooth gradients under sensor noise, which lossless codecs cannot shrink much.
"""

from __future__ import annotations

import os
import tempfile
import time

import av
import numpy as np

from apps.samplevideo import write_sample_video
from common.wire.schemas import FIELD, FRAME_CODECS, FrameMsg, decode_frame, encode_frame

SIZE = 448


def sample_frame() -> np.ndarray:
    with tempfile.TemporaryDirectory() as d:
        path = write_sample_video(os.path.join(d, "s.mp4"), seconds=2, fps=4, width=SIZE, height=SIZE)
        with av.open(path) as c:
            return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)][3]


def noisy_frame() -> np.ndarray:
    y, x = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    base = np.stack([120 + 80 * np.sin(6 * x + 2 * y), 100 + 60 * np.cos(4 * y), 90 + 50 * np.sin(24 * x * y)], -1)
    return np.clip(base + np.random.default_rng(0).normal(0, 2.5, base.shape), 0, 255).astype(np.uint8)


def measure(rgb: np.ndarray, codec: str, n: int = 20) -> tuple[float, float, float]:
    msg = FrameMsg.from_rgb(0, 0.0, 0.0, rgb)
    t = time.perf_counter()
    for _ in range(n):
        fields = encode_frame(msg, codec=codec)
    enc = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n):
        decode_frame(fields)
    return len(fields[FIELD]) / 1024, enc * 1000, (time.perf_counter() - t) / n * 1000


def main() -> None:
    frames = {"sample": sample_frame(), "noise": noisy_frame()}
    for codec in FRAME_CODECS:
        for name, rgb in frames.items():
            kib, enc, dec = measure(rgb, codec)
            print(f"{codec:6} {name:7} {kib:7.1f} KiB  encode {enc:5.1f} ms  decode {dec:5.1f} ms")


if __name__ == "__main__":
    main()
