"""Generate small, deterministic test/demo videos with PyAV, and damage them on purpose.

Every frame differs (shapes move, a clock is burned in) so tests can tell frames apart, and a
caption changes over time so a VLM demo has something to answer about.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from fractions import Fraction
from functools import cache

import av
import numpy as np
from PIL import Image, ImageDraw, ImageFont

DEFAULT_CAPTIONS: tuple[tuple[float, str], ...] = (
    (0.0, "RED BALL"),
    (3.0, "BLUE BOX"),
    (6.0, "GREEN STAR"),
)

# VFR files keep timestamps in milliseconds so irregular intervals are exact.
_VFR_TIME_BASE = Fraction(1, 1000)


def write_sample_video(
    path: str,
    *,
    seconds: float = 8.0,
    fps: int = 10,
    width: int = 320,
    height: int = 240,
    captions: Sequence[tuple[float, str]] = DEFAULT_CAPTIONS,
    vfr: bool = False,
    codec: str = "libx264",
) -> str:
    """Write an H.264/yuv420p video (container from the suffix: .mp4 or .mkv) and return ``path``.

    ``vfr=True``: the first half plays at 2*fps and the second half at fps/2, so frame counts
    and presentation times disagree (a count-based sampler gets the wrong frames).
    """
    if fps <= 0 or seconds <= 0:
        raise ValueError(f"fps and seconds must be positive, got fps={fps} seconds={seconds}")
    times = _vfr_times(seconds, fps) if vfr else [i / fps for i in range(round(seconds * fps))]
    # bitexact: no random segment UIDs / version strings, so equal arguments give equal bytes.
    container_options = {"fflags": "+bitexact"}
    if path.lower().endswith(".mp4"):
        # moov atom first: a truncated file is still openable and decodes up to the cut.
        container_options["movflags"] = "+faststart"
    with av.open(path, "w", container_options=container_options) as out:
        stream = _add_video_stream(out, codec=codec, fps=fps, width=width, height=height, vfr=vfr)
        for t in times:
            image = render_frame(t, width=width, height=height, captions=captions)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            if vfr:
                frame.pts, frame.time_base = round(t * 1000), _VFR_TIME_BASE
            else:
                frame.pts, frame.time_base = round(t * fps), Fraction(1, fps)
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))  # flush the encoder's delayed (B-)frames
    return path


def _add_video_stream(
    out: av.container.OutputContainer, *, codec: str, fps: int, width: int, height: int, vfr: bool
) -> av.VideoStream:
    options = {}
    if codec == "libx264":
        # Short GOP so damaged files recover at the next keyframe; B-frames on so decoders must
        # reorder (exercises "decode every packet"). Reproducible bytes need one thread AND
        # mbtree off: x264's macroblock-tree pass reads uninitialised memory (seen with VFR input),
        # so the first IDR frame came out differently from run to run.
        options = {
            "preset": "veryfast",
            "crf": "23",
            "g": str(2 * fps),
            "bf": "2",
            "threads": "1",
            "x264-params": "mbtree=0",
        }
    stream = out.add_stream(codec, rate=fps, options=options)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    stream.codec_context.thread_count = 1
    stream.codec_context.flags |= av.codec.context.Flags.bitexact
    if vfr:
        stream.codec_context.time_base = _VFR_TIME_BASE
        stream.time_base = _VFR_TIME_BASE
    return stream


def _vfr_times(seconds: float, fps: int) -> list[float]:
    """Presentation times: fast (2*fps) for the first half, slow (fps/2) for the second half."""
    times, t, half = [], 0.0, seconds / 2
    while t < seconds - 1e-9:
        times.append(round(t, 3))  # millisecond grid = the VFR time base
        t += 1 / (2 * fps) if t < half - 1e-9 else 2 / fps
    return times


def render_frame(
    t: float, *, width: int, height: int, captions: Sequence[tuple[float, str]] = DEFAULT_CAPTIONS
) -> np.ndarray:
    """One RGB frame at media time ``t``: moving shapes, a clock and the caption active at ``t``."""
    img = Image.new("RGB", (width, height), _background(t))
    draw = ImageDraw.Draw(img)
    r = max(4, min(width, height) // 8)
    # Ball bounces horizontally, box vertically: positions are a pure function of t.
    bx = r + _triangle(t / 3.0) * (width - 2 * r)
    by = height // 3
    draw.ellipse((bx - r, by - r, bx + r, by + r), fill=(220, 30, 30))
    qx = width * 3 // 4
    qy = r + _triangle(t / 2.0) * (height - 2 * r)
    draw.rectangle((qx - r, qy - r, qx + r, qy + r), fill=(30, 60, 220))
    font = _font(max(10, height // 12))
    draw.text((4, 4), f"t={t:05.2f}s", fill=(255, 255, 255), font=font)
    caption = caption_at(t, captions)
    if caption:
        draw.text((4, height - height // 8), caption, fill=(255, 255, 0), font=font)
    return np.asarray(img, dtype=np.uint8)


def caption_at(t: float, captions: Sequence[tuple[float, str]]) -> str:
    """The caption whose start time is the latest one <= t ("" before the first)."""
    current = ""
    for start, text in sorted(captions):
        if start <= t + 1e-9:
            current = text
    return current


def _background(t: float) -> tuple[int, int, int]:
    shade = int(40 + 30 * _triangle(t / 4.0))
    return (shade, shade + 20, shade)


def _triangle(x: float) -> float:
    """Triangle wave in [0, 1] with period 1: smooth back-and-forth motion."""
    frac = x % 1.0
    return 2 * frac if frac < 0.5 else 2 - 2 * frac


@cache
def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)  # scalable default font (Pillow >= 10.1, FreeType)
    except (TypeError, OSError):
        return ImageFont.load_default()


if __name__ == "__main__":  # python -m apps.samplevideo out.mp4 [seconds]
    import sys

    out_path = sys.argv[1] if len(sys.argv) > 1 else "sample.mp4"
    secs = float(sys.argv[2]) if len(sys.argv) > 2 else 8.0
    print(write_sample_video(out_path, seconds=secs), os.path.getsize(out_path), "bytes")
