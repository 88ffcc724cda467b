"""Real decoding with PyAV (no mocks): generated files, damaged files, a GStreamer RTSP server."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from apps.samplevideo import write_sample_video
from common.engine.grid import Grid
from ingest.video import (
    DecodedFrame,
    SourceError,
    is_live,
    iter_file_frames,
    open_container,
    sample_frames,
)
from tests.pipeline import with_deadline
from tests.rtsp_server import RtspServer, gst_available
from tests.videodamage import corrupt_bytes, truncate_file, write_garbage_file

GST_OK, GST_WHY = gst_available()
needs_gst = pytest.mark.skipif(not GST_OK, reason=f"GStreamer RTSP server unavailable: {GST_WHY}")


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("videos")
    return {
        "cfr": write_sample_video(str(d / "cfr.mp4"), seconds=8.0, fps=10),
        "cfr_mkv": write_sample_video(str(d / "cfr.mkv"), seconds=8.0, fps=10),
        "vfr": write_sample_video(str(d / "vfr.mp4"), seconds=8.0, fps=10, vfr=True),
    }


def _pts(frames: list[DecodedFrame]) -> list[float]:
    return [f.pts for f in frames]


# ------------------------------------------------------------------------------------ sampling


def test_fps2_gives_16_frames_every_half_second(videos: dict[str, str]) -> None:
    frames = list(iter_file_frames(videos["cfr"], 2))
    assert len(frames) == 16
    assert [f.index for f in frames] == list(range(16))
    assert _pts(frames) == pytest.approx([k * 0.5 for k in range(16)], abs=1e-6)


def test_fps_at_source_rate_keeps_every_frame(videos: dict[str, str]) -> None:
    frames = list(iter_file_frames(videos["cfr"], 10))
    assert len(frames) == 80
    assert _pts(frames) == pytest.approx([k / 10 for k in range(80)], abs=1e-6)


def test_fps_above_source_rate_does_not_duplicate(videos: dict[str, str]) -> None:
    assert len(list(iter_file_frames(videos["cfr"], 25))) == 80


def test_fps3_picks_first_frame_of_each_third_second(videos: dict[str, str]) -> None:
    frames = list(iter_file_frames(videos["cfr_mkv"], 3))
    assert len(frames) == 24  # slots k/3 for k = 0..23 within 8 s
    for k, f in enumerate(frames):
        # the first source frame (10 fps grid) at or after slot start k/3
        assert k / 3 - 1e-6 <= f.pts < k / 3 + 0.1


def test_vfr_is_sampled_by_presentation_time(videos: dict[str, str]) -> None:
    with open_container(videos["vfr"]) as c:
        all_pts = [f.pts for f in sample_frames(c, 1000)]
    # Fixture sanity: 4 s at 20 fps then 4 s at 5 fps, so picking every n-th frame (any n) cannot
    # land on a regular time grid: count-based sampling fails the assertions below.
    assert len(all_pts) == 100
    assert np.diff(all_pts).min() == pytest.approx(0.05) and np.diff(all_pts).max() == pytest.approx(0.2)

    frames = list(iter_file_frames(videos["vfr"], 2))
    assert len(frames) == 16
    for k, f in enumerate(frames):
        assert k * 0.5 - 1e-6 <= f.pts < k * 0.5 + 0.2  # within one source interval of the grid
    assert np.diff(_pts(frames)) == pytest.approx([0.5] * 15, abs=0.2)


def test_fps_must_be_positive(videos: dict[str, str]) -> None:
    with open_container(videos["cfr"]) as c:
        for bad in (0, -1, float("nan")):
            with pytest.raises(ValueError):
                sample_frames(c, bad)  # raised at the call, not at the first next()


# ------------------------------------------------------------------------------- frame content


def test_frames_have_shape_and_differ(videos: dict[str, str]) -> None:
    frames = list(iter_file_frames(videos["cfr"], 5))
    for f in frames:
        assert f.rgb.shape == (240, 320, 3) and f.rgb.dtype == np.uint8
    for a, b in itertools.pairwise(frames):
        assert np.abs(a.rgb.astype(int) - b.rgb.astype(int)).mean() > 1.0  # shapes moved


@pytest.mark.parametrize("size", [(112, 160), (448, 448)])
def test_grid_resizes(videos: dict[str, str], size: tuple[int, int]) -> None:
    frames = list(iter_file_frames(videos["cfr"], 1, grid=Grid(*size)))
    assert len(frames) == 8
    assert all(f.rgb.shape == (*size, 3) and f.rgb.dtype == np.uint8 for f in frames)


def test_sample_video_is_deterministic(tmp_path: Path) -> None:
    # VFR + several writes in one process: the case that exposed x264 mbtree's uninitialised reads.
    paths = [write_sample_video(str(tmp_path / f"{i}.mkv"), seconds=2.0, vfr=True) for i in range(3)]
    assert len({Path(p).read_bytes() for p in paths}) == 1


# ------------------------------------------------------------------------------- broken inputs


@pytest.mark.parametrize("kind", ["cfr", "cfr_mkv"])
def test_truncated_file_decodes_what_it_can(videos: dict[str, str], kind: str, tmp_path: Path) -> None:
    cut = truncate_file(videos[kind], 0.5, dest=str(tmp_path / Path(videos[kind]).name))
    errors: list[str] = []
    frames = list(iter_file_frames(cut, 10, on_error=errors.append))
    assert 0 < len(frames) < 80
    assert _pts(frames) == sorted(_pts(frames))


def test_corrupt_middle_reports_errors_and_continues(videos: dict[str, str], tmp_path: Path) -> None:
    bad = corrupt_bytes(videos["cfr"], start_fraction=0.3, length=3000, dest=str(tmp_path / "bad.mp4"))
    errors: list[str] = []
    frames = list(iter_file_frames(bad, 10, on_error=errors.append))
    assert errors, "the decoder should have reported the damaged packets"
    assert 40 < len(frames) < 80  # frames after the damage (next keyframe) still come out
    assert frames[-1].pts > 7.0


def test_garbage_file_raises_source_error(tmp_path: Path) -> None:
    path = write_garbage_file(str(tmp_path / "garbage.mp4"))
    with pytest.raises(SourceError, match=r"garbage\.mp4"):
        list(iter_file_frames(path, 2))


def test_missing_file_raises_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"missing\.mp4"):
        list(iter_file_frames(str(tmp_path / "missing.mp4"), 2))


@pytest.mark.parametrize(
    ("url", "live"),
    [
        ("rtsp://cam.local:554/stream1", True),
        ("RTSP://cam/x", True),
        ("rtmp://host/app/key", True),
        ("https://host/live/index.m3u8?token=1", True),
        ("https://host/clip.mp4", False),
        ("/dev/video0", True),
        ("v4l2:///dev/video2", True),
        ("/data/clip.mp4", False),
        ("clip.mkv", False),
    ],
)
def test_is_live(url: str, live: bool) -> None:
    assert is_live(url) is live


# ------------------------------------------------------------------------------------------ RTSP


@pytest.fixture
def rtsp_server() -> Iterator[RtspServer]:
    server = RtspServer(fps=10).start()  # port 0: the server binds a free port and reports it
    try:
        yield server
    finally:
        server.stop(kill=True)


def _pull(url: str, fps: float, n: int, *, read_timeout_s: float = 5.0) -> list[DecodedFrame]:
    """Open, take n sampled frames, close; all under a deadline so a hang fails instead of blocking."""

    def pull() -> list[DecodedFrame]:
        with open_container(url, open_timeout_s=10, read_timeout_s=read_timeout_s) as c:
            frames: list[DecodedFrame] = []
            for f in sample_frames(c, fps):
                frames.append(f)
                if len(frames) == n:
                    return frames
        raise AssertionError(f"stream ended after {len(frames)} frames")

    return with_deadline(pull, 30, what=f"pull {url}")


@needs_gst
def test_rtsp_pulls_frames(rtsp_server: RtspServer) -> None:
    frames = _pull(rtsp_server.url, 5, 10)  # ~2 s of stream at 5 fps
    assert all(f.rgb.shape == (240, 320, 3) for f in frames)
    pts = _pts(frames)
    assert all(b > a for a, b in itertools.pairwise(pts))
    assert np.diff(pts) == pytest.approx([0.2] * 9, abs=0.11)


@needs_gst
def test_rtsp_serves_a_file(videos: dict[str, str]) -> None:
    server = RtspServer(file=videos["cfr"]).start()
    try:
        frames = _pull(server.url, 5, 5)
    finally:
        server.stop(kill=True)
    assert all(f.rgb.shape == (240, 320, 3) for f in frames)


@needs_gst
def test_rtsp_unknown_path_is_source_error(rtsp_server: RtspServer) -> None:
    with pytest.raises(SourceError, match="404"):
        open_container(rtsp_server.url + "-nope", open_timeout_s=30)  # answered at once; a timeout would not say 404


@needs_gst
def test_rtsp_server_killed_and_restarted_on_same_port(rtsp_server: RtspServer) -> None:
    url = rtsp_server.url
    assert _pull(url, 5, 2)
    rtsp_server.stop(kill=True)
    with pytest.raises(SourceError):
        open_container(url, open_timeout_s=2)  # connection refused, at once
    rtsp_server.start()
    assert rtsp_server.url == url
    assert _pull(url, 5, 2)


@needs_gst
def test_rtsp_stalled_server_raises_source_error(rtsp_server: RtspServer) -> None:
    """A server that stops sending mid-stream: the read timeout fires, no hang."""

    def read_until_error() -> float:
        with open_container(rtsp_server.url, open_timeout_s=10, read_timeout_s=1.0) as c:
            frames = sample_frames(c, 10)
            next(frames)
            assert rtsp_server.proc is not None
            os.kill(rtsp_server.proc.pid, signal.SIGSTOP)  # freeze: TCP stays open, no data
            started = time.monotonic()
            with pytest.raises(SourceError, match="read failed"):
                for _ in frames:
                    pass
            return time.monotonic() - started

    try:
        elapsed = with_deadline(read_until_error, 30, what="stalled read")
    finally:
        if rtsp_server.proc is not None:
            os.kill(rtsp_server.proc.pid, signal.SIGCONT)
    # FFmpeg hands out one more packet when the first timeout fires, so a stall costs ~2x read timeout
    # (~2 s); the bound is under one default read timeout (10 s), with room for a loaded machine.
    assert elapsed < 8.0


def test_silent_server_open_times_out() -> None:
    """PyAV #584: a server that accepts TCP and never answers must not hang av.open."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)  # the kernel completes the handshake; nobody ever replies
        url = f"rtsp://127.0.0.1:{listener.getsockname()[1]}/cam"
        started = time.monotonic()
        with pytest.raises(SourceError, match="timed out"):
            with_deadline(lambda: open_container(url, open_timeout_s=2, read_timeout_s=2), 20, what="open")
        assert time.monotonic() - started < 8.0  # ~2 s; under the default open timeout (10 s)
