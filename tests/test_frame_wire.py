"""Frames on the wire: compressed (lossless WebP by default), raw frames of older ingests still
decode, a bad image is a SchemaError, and live frames are trimmed by age, not by count."""

from __future__ import annotations

import time

import av
import msgpack
import numpy as np
import pytest
import redis

from apps.samplevideo import write_sample_video
from common.wire import keys
from common.wire.schemas import FIELD, FrameMsg, SchemaError, decode_frame, encode_frame
from tests.pipeline import Services

RNG = np.random.default_rng(0)


def sample_frame(tmp_path, size: int = 448) -> np.ndarray:
    """A real decoded H.264 frame (shapes and captions), as ingest would publish it."""
    path = write_sample_video(str(tmp_path / "s.mp4"), seconds=1, fps=4, width=size, height=size)
    with av.open(path) as c:
        return next(c.decode(video=0)).to_ndarray(format="rgb24")


def noisy_frame(h: int = 448, w: int = 448) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([120 + 80 * np.sin(6 * x + 2 * y), 100 + 60 * np.cos(4 * y), 90 + 50 * np.sin(24 * x * y)], -1)
    return np.clip(base + RNG.normal(0, 2.5, base.shape), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("codec", ["webp", "png"])
def test_lossless_codecs_round_trip_exactly_and_shrink_frames(codec, tmp_path):
    for rgb in (sample_frame(tmp_path), noisy_frame()):
        msg = FrameMsg.from_rgb(3, 10.5, 1.25, rgb)
        fields = encode_frame(msg, codec=codec)
        assert len(fields[FIELD]) < rgb.nbytes
        back = decode_frame(fields)
        assert back == msg  # same seq, times, size and exactly the same pixels, raw in memory


def test_jpeg_is_near_lossless_and_much_smaller(tmp_path):
    rgb = noisy_frame()
    fields = encode_frame(FrameMsg.from_rgb(0, 0.0, 0.0, rgb), codec="jpeg")
    back = decode_frame(fields).rgb().astype(int)
    assert np.abs(back - rgb).mean() < 2.0 and np.abs(back - rgb).max() <= 32
    assert len(fields[FIELD]) < rgb.nbytes / 5


def test_raw_frames_of_an_older_ingest_still_decode():
    rgb = noisy_frame(28, 56)
    old = {"v": 1, "seq": 1, "ts": 2.0, "pts": 2.0, "h": 28, "w": 56, "fmt": "rgb24", "data": rgb.tobytes()}
    assert np.array_equal(decode_frame({FIELD: msgpack.packb(old)}).rgb(), rgb)


def test_noise_that_defeats_the_codec_goes_raw():
    rgb = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    m = msgpack.unpackb(encode_frame(FrameMsg.from_rgb(0, 0.0, 0.0, rgb), codec="webp")[FIELD])
    assert m["fmt"] == "rgb24" and m["data"] == rgb.tobytes()


@pytest.mark.parametrize(
    ("change", "problem"),
    [({"data": b"RIFF\x00\x00garbage"}, "undecodable"), ({"h": 32}, "header says"), ({"fmt": "gif"}, "fmt")],
)
def test_bad_compressed_frames_are_schema_errors(change, problem):
    m = msgpack.unpackb(encode_frame(FrameMsg.from_rgb(0, 0.0, 0.0, noisy_frame(64, 64)), codec="webp")[FIELD])
    with pytest.raises(SchemaError, match=problem):
        decode_frame({FIELD: msgpack.packb(m | change)})


def test_unknown_codec_is_refused():
    with pytest.raises(SchemaError, match="unknown codec"):
        encode_frame(FrameMsg.from_rgb(0, 0.0, 0.0, noisy_frame(8, 8)), codec="bmp")


def test_live_frames_are_trimmed_by_age(redis_url, tmp_path):
    """A file paced like a camera: the stream keeps only the last `frames_max_age_s` of frames."""
    r = redis.Redis.from_url(redis_url)
    video = write_sample_video(str(tmp_path / "a.mp4"), seconds=5, fps=10, width=160, height=120)
    services = Services(redis_url, tmp_path)
    try:
        proc = services.start(
            "ingest", "--url", video, "--stream", "cam", "--fps", "5", "--realtime", "true", "--frames-max-age-s", "1.5"
        )
        assert proc.wait(timeout=120) == 0, services.logs()
    finally:
        services.stop_all()
    ids = [int(i.split(b"-")[0]) for i, _ in r.xrange(keys.frames("cam"))]
    assert 3 <= len(ids) < 15  # ~25 frames were published over 5 s
    assert (ids[-1] - ids[0]) / 1000 <= 1.5 + 0.5
    assert time.time() - ids[-1] / 1000 < 60
