"""Ingest against real sources: generated H.264 files and GStreamer's RTSP server, real Redis."""

from __future__ import annotations

import base64
import http.server
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import redis

from apps.samplevideo import write_sample_video
from common import redisio
from common.wire import keys
from common.wire.schemas import INT64_MAX, EndOfStream, FrameMsg, decode_frame, encode_frame
from ingest.config import IngestConfig
from ingest.service import source_specs
from ingest.source import Source
from ingest.video import ended_playlist
from tests.conftest import RedisServer, free_port
from tests.pipeline import Services, wait_for
from tests.rtsp_server import RtspServer, gst_available
from tests.videodamage import corrupt_bytes, truncate_file, write_garbage_file

CAM = "cam1"


@pytest.fixture
def services(redis_url, tmp_path):
    s = Services(redis_url, tmp_path)
    yield s
    s.stop_all()


def frames(r: redis.Redis) -> list[FrameMsg | EndOfStream]:
    return [decode_frame(f) for _, f in r.xrange(keys.frames(CAM))]


def events(r: redis.Redis) -> list[str]:
    return [f[b"type"].decode() for _, f in r.xrange(keys.events(CAM))]


def ingest(services: Services, url: str, *args: str):
    return services.start("ingest", "--url", url, "--stream", CAM, *args)


def test_file_frames_at_target_fps_on_the_grid_then_eos(redis_url, services, tmp_path):
    r = redis.Redis.from_url(redis_url)
    video = write_sample_video(str(tmp_path / "a.mp4"), seconds=4, fps=10, width=320, height=240)
    assert ingest(services, video, "--fps", "2.5", "--max-backlog", "1000").wait(timeout=60) == 0, services.logs()
    got = frames(r)
    assert isinstance(got[-1], EndOfStream) and got[-1].seq == 9
    body = got[:-1]
    assert [f.seq for f in body] == list(range(10))
    assert [f.pts for f in body] == pytest.approx([i * 0.4 for i in range(10)])
    meta = r.hgetall(keys.meta(CAM))
    h, w = int(meta[b"height"]), int(meta[b"width"])
    assert h % 28 == 0 and w % 28 == 0 and float(meta[b"fps"]) == 2.5 and meta[b"live"] == b"0"
    assert all((f.h, f.w) == (h, w) for f in body)
    assert events(r)[0] == "connected" and events(r)[-1] == "eof"


def test_file_backpressure_bounds_the_stream_and_interrupted_file_resumes(redis_url, services, tmp_path):
    r = redis.Redis.from_url(redis_url)
    video = write_sample_video(str(tmp_path / "a.mp4"), seconds=4, fps=10, width=160, height=120)
    proc = ingest(services, video, "--fps", "5", "--max-backlog", "4")
    wait_for(lambda: r.xlen(keys.frames(CAM)) >= 4, 30, "first frames", services)
    time.sleep(1.5)
    assert r.xlen(keys.frames(CAM)) == 4, "no encoder consumed: ingest must wait, not grow the stream"
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    assert not any(isinstance(f, EndOfStream) for f in frames(r)), "an interrupted file is not ended"
    # a consumer takes frames; a restarted ingest continues where it stopped, no seq twice
    r.xgroup_create(keys.frames(CAM), keys.ENCODER_GROUP, id="0")
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set():
            for _, entries in r.xreadgroup(keys.ENCODER_GROUP, "t", {keys.frames(CAM): ">"}, block=100) or []:
                r.xack(keys.frames(CAM), keys.ENCODER_GROUP, *[eid for eid, _ in entries])

    consumer = threading.Thread(target=consume)
    consumer.start()
    try:
        assert ingest(services, video, "--fps", "5", "--max-backlog", "4").wait(timeout=60) == 0, services.logs()
    finally:
        stop.set()
        consumer.join()
    got = frames(r)
    assert [f.seq for f in got if isinstance(f, FrameMsg)] == list(range(20))
    assert [f.pts for f in got if isinstance(f, FrameMsg)] == pytest.approx([i * 0.2 for i in range(20)])
    assert isinstance(got[-1], EndOfStream)


def recordings_back_to_back(tmp_path, seconds: float) -> Path:
    """Two recordings in one TS file: its timestamps start over halfway."""
    parts = []
    for i in range(2):
        mp4 = write_sample_video(str(tmp_path / f"{i}.mp4"), seconds=seconds, fps=10, width=160, height=120)
        ts = tmp_path / f"{i}.ts"
        subprocess.run(["ffmpeg", "-v", "error", "-i", mp4, "-c", "copy", "-f", "mpegts", str(ts)], check=True)
        parts.append(ts.read_bytes())
    video = tmp_path / "both.ts"
    video.write_bytes(b"".join(parts))
    return video


def test_a_file_whose_clock_restarts_resumes_after_the_frame_it_sent_last(redis_url, services, tmp_path):
    """Two recordings back to back in one TS file (its timestamps start over): read across the
    restart, and an ingest stopped in the second one resumes after its last frame. Resuming by pts
    alone re-sent the first recording's frames past that pts (each one, then, a second time)."""
    r = redis.Redis.from_url(redis_url)
    video = recordings_back_to_back(tmp_path, seconds=3)
    r.xgroup_create(keys.frames(CAM), keys.ENCODER_GROUP, id="0", mkstream=True)
    stop = threading.Event()

    def consume() -> None:  # an encoder taking a frame every 50 ms
        while not stop.is_set():
            for _, entries in r.xreadgroup(keys.ENCODER_GROUP, "t", {keys.frames(CAM): ">"}, count=1, block=100) or []:
                r.xack(keys.frames(CAM), keys.ENCODER_GROUP, *[eid for eid, _ in entries])
                time.sleep(0.05)

    consumer = threading.Thread(target=consume)
    consumer.start()
    try:
        proc = ingest(services, str(video), "--fps", "5", "--max-backlog", "2")
        wait_for(lambda: r.xlen(keys.frames(CAM)) >= 20, 30, "frames of the second recording", services)
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        assert not any(isinstance(f, EndOfStream) for f in frames(r)), "stopped before its end"
        assert ingest(services, str(video), "--fps", "5", "--max-backlog", "2").wait(timeout=60) == 0, services.logs()
    finally:
        stop.set()
        consumer.join()
    got = [f for f in frames(r) if isinstance(f, FrameMsg)]
    assert [f.seq for f in got] == list(range(30)), [(f.seq, f.epoch, f.pts) for f in got]
    assert [f.epoch for f in got] == [0] * 15 + [1] * 15
    assert [(f.epoch, f.pts) for f in got] == sorted((f.epoch, f.pts) for f in got)
    assert isinstance(frames(r)[-1], EndOfStream)


def test_realtime_file_is_paced_like_a_camera(redis_url, services, tmp_path):
    r = redis.Redis.from_url(redis_url)
    video = write_sample_video(str(tmp_path / "a.mp4"), seconds=3, fps=10, width=160, height=120)
    t0 = time.monotonic()
    assert ingest(services, video, "--fps", "4", "--realtime", "true").wait(timeout=60) == 0, services.logs()
    assert time.monotonic() - t0 >= 2.7
    body = [f for f in frames(r) if isinstance(f, FrameMsg)]
    assert abs(body[-1].ts - time.time()) < 30, "a simulated camera stamps wall-clock capture times"
    assert r.hget(keys.meta(CAM), "live") == b"1"


def test_a_realtime_file_whose_clock_restarts_is_paced_across_the_restart(redis_url, services, tmp_path):
    """Pacing was anchored once: after the clock started over every frame was overdue, and the
    second recording went out in a burst (20 frames in 0.27 s against 3.8 s for the first)."""
    r = redis.Redis.from_url(redis_url)
    video = recordings_back_to_back(tmp_path, seconds=2)
    assert ingest(services, str(video), "--fps", "5", "--realtime", "true").wait(timeout=60) == 0, services.logs()
    got = [f for f in frames(r) if isinstance(f, FrameMsg)]
    second = [f.ts for f in got if f.epoch == 1]
    assert len(second) == 10 and second[-1] - second[0] >= 1.6, [f"{t - got[0].ts:.2f}" for t in second]


def encode_clip(path: str, pictures: list[np.ndarray], configure: Callable[[av.VideoStream], None]) -> str:
    """An H.264 mp4 of `pictures` at 10 fps, its stream set up by `configure` first."""
    with av.open(path, "w") as c:
        s = c.add_stream("libx264", rate=10)
        s.height, s.width = pictures[0].shape[:2]
        s.pix_fmt = "yuv420p"
        configure(s)
        for i, img in enumerate(pictures):
            f = av.VideoFrame.from_ndarray(img, format="rgb24")
            f.pts, f.time_base = i, Fraction(1, 10)
            for packet in s.encode(f):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return path


def test_rotated_phone_clip_is_ingested_upright(redis_url, services, tmp_path):
    """A portrait phone clip is stored as landscape pictures plus a display rotation: the grid and
    the frames must be as players (and the ffmpeg CLI) show it, not lying on their side."""
    r = redis.Redis.from_url(redis_url)
    img = np.zeros((120, 160, 3), np.uint8)
    img[:60, :80, 1] = 255  # green in the top left of the stored picture
    path = encode_clip(str(tmp_path / "phone.mp4"), [img] * 10, lambda s: s.set_display_rotation(90))
    assert ingest(services, path, "--fps", "5", "--max-backlog", "1000").wait(timeout=60) == 0, services.logs()
    meta = r.hgetall(keys.meta(CAM))
    assert int(meta[b"height"]) > int(meta[b"width"]), meta  # portrait, as shown
    rgb = next(f for f in frames(r) if isinstance(f, FrameMsg)).rgb()
    h, w = rgb.shape[0] // 2, rgb.shape[1] // 2
    green = [int(q[..., 1].mean()) for q in (rgb[:h, :w], rgb[:h, w:], rgb[h:, :w], rgb[h:, w:])]
    assert green[2] > 200 and max(green[:2] + green[3:]) < 50, green  # bottom left, where ffmpeg shows it


def test_anamorphic_clip_gets_a_grid_of_its_shown_shape(redis_url, services, tmp_path):
    """720x576 pictures with 64:45 pixels (16:9 PAL, as broadcast and DV record it) are shown 16:9:
    a grid for the stored 5:4 squeezes everything in it."""
    r = redis.Redis.from_url(redis_url)

    def anamorphic(s: av.VideoStream) -> None:
        s.codec_context.sample_aspect_ratio = Fraction(64, 45)

    path = encode_clip(str(tmp_path / "pal.mp4"), [np.zeros((576, 720, 3), np.uint8)] * 5, anamorphic)
    assert ingest(services, path, "--fps", "5", "--max-backlog", "1000").wait(timeout=60) == 0, services.logs()
    meta = r.hgetall(keys.meta(CAM))
    assert int(meta[b"width"]) / int(meta[b"height"]) == pytest.approx(16 / 9, rel=0.05), meta


def test_truncated_file_decodes_what_it_can(redis_url, services, tmp_path):
    r = redis.Redis.from_url(redis_url)
    video = write_sample_video(str(tmp_path / "a.mp4"), seconds=6, fps=10, width=160, height=120)
    truncate_file(video, 0.5)
    assert ingest(services, video, "--fps", "5", "--max-backlog", "1000").wait(timeout=60) == 0, services.logs()
    n = len([f for f in frames(r) if isinstance(f, FrameMsg)])
    assert 0 < n < 30


def test_a_damaged_file_counts_every_decode_error_in_few_events(redis_url, services, tmp_path):
    """Every packet that fails counts, but one decode_error event stands for all of them within
    DECODE_ERROR_EVENT_S: an event per packet flooded the stream's events (and the log)."""
    r = redis.Redis.from_url(redis_url)
    video = write_sample_video(str(tmp_path / "a.mp4"), seconds=6, fps=10, width=320, height=240)
    corrupt_bytes(video, start_fraction=0.3, length=20_000)
    assert ingest(services, video, "--fps", "5", "--max-backlog", "1000").wait(timeout=60) == 0, services.logs()
    found = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(keys.events(CAM))]
    errors = [e for e in found if e["type"] == "decode_error"]
    (eof,) = [e for e in found if e["type"] == "eof"]
    assert int(eof["decode_errors"]) > 1 and len(errors) == 1, found
    assert int(errors[0]["errors"]) == 1 and errors[0]["error"]


@pytest.fixture
def hls_vod(tmp_path):
    """A 3 s VOD playlist (ffmpeg's HLS muxer) behind a master playlist, served over HTTP; paths
    under /private/ ask for Basic credentials u / p@ss."""
    video = write_sample_video(str(tmp_path / "a.mp4"), seconds=3, fps=10, width=320, height=240)
    root = tmp_path / "hls"
    root.mkdir()
    hls = ["-f", "hls", "-hls_time", "1", "-hls_playlist_type", "vod", str(root / "v.m3u8")]
    subprocess.run(["ffmpeg", "-v", "error", "-i", video, "-c", "copy", *hls], check=True)
    (root / "master.m3u8").write_text("#EXTM3U\n#EXT-X-STREAM-INF:BANDWIDTH=100000\nv.m3u8\n")
    (root / "live.m3u8").write_text((root / "v.m3u8").read_text().replace("#EXT-X-ENDLIST", ""))
    login = "Basic " + base64.b64encode(b"u:p@ss").decode()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self):
            if self.path.startswith("/private/"):
                if self.headers.get("Authorization") != login:
                    return self.send_error(401)
                self.path = self.path.removeprefix("/private")
            return super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_hls_playlist_that_ends_is_read_once_like_a_file(redis_url, services, hls_vod):
    """A VOD playlist (#EXT-X-ENDLIST) is a file: read to its end once, then eof and exit 0. Taken
    for a live stream, it was reopened after its end and replayed from the start forever."""
    assert ended_playlist(f"http://{hls_vod}/master.m3u8", 5) and ended_playlist(f"http://{hls_vod}/v.m3u8", 5)
    assert not ended_playlist(f"http://{hls_vod}/live.m3u8", 5)
    assert ended_playlist(f"http://u:p%40ss@{hls_vod}/private/master.m3u8", 5)  # credentials as a header
    assert not ended_playlist(f"http://{hls_vod}/private/master.m3u8", 5)  # unreadable: live, as before
    r = redis.Redis.from_url(redis_url)
    url = f"http://{hls_vod}/master.m3u8"
    assert ingest(services, url, "--fps", "2", "--max-backlog", "1000").wait(timeout=60) == 0, services.logs()
    got = frames(r)
    assert isinstance(got[-1], EndOfStream) and 5 <= len(got) - 1 <= 7, got
    assert events(r)[-1] == "eof" and "reconnecting" not in events(r)


def test_garbage_file_exits_nonzero_with_an_error_event(redis_url, services, tmp_path):
    r = redis.Redis.from_url(redis_url)
    bad = write_garbage_file(str(tmp_path / "bad.mp4"))
    assert ingest(services, bad, "--fps", "5").wait(timeout=60) == 1
    assert "error" in events(r)
    assert not [f for f in frames(r) if isinstance(f, FrameMsg)]


def test_source_size_no_grid_fits_is_an_error_event_and_exit_1(redis_url, services, tmp_path):
    """4032x16 (over 200:1) has no model grid: one error event and exit 1, not a dead thread and exit 0."""
    r = redis.Redis.from_url(redis_url)
    wide = write_sample_video(str(tmp_path / "wide.mp4"), seconds=1, fps=5, width=4032, height=16)
    assert ingest(services, wide, "--fps", "5").wait(timeout=60) == 1, services.logs()
    errors = [f[b"error"].decode() for _, f in r.xrange(keys.events(CAM)) if f[b"type"] == b"error"]
    assert len(errors) == 1 and "aspect ratio" in errors[0], errors
    assert "uncaught exception" not in services.logs()


@pytest.mark.skipif(not gst_available()[0], reason=gst_available()[1])
def test_rtsp_reconnects_after_server_is_killed_and_restarted(redis_url, services):
    r = redis.Redis.from_url(redis_url)
    server = RtspServer(fps=10, width=320, height=240).start()
    try:
        proc = ingest(
            services,
            server.url,
            "--fps",
            "5",
            "--read-timeout-s",
            "2",
            "--open-timeout-s",
            "5",
            "--reconnect-min-s",
            "0.2",
            "--reconnect-max-s",
            "1",
        )
        wait_for(lambda: r.xlen(keys.frames(CAM)) >= 10, 60, "frames from RTSP", services)
        server.stop(kill=True)
        wait_for(lambda: "reconnecting" in events(r), 30, "a reconnect attempt", services)
        before = r.xlen(keys.frames(CAM))
        server.start()
        wait_for(lambda: r.xlen(keys.frames(CAM)) >= before + 10, 60, "frames after restart", services)
        assert events(r).count("connected") >= 2
        assert proc.poll() is None
        body = [f for f in frames(r) if isinstance(f, FrameMsg)]
        assert [f.seq for f in body] == list(range(len(body))), "seqs continue across reconnects"
        assert r.hget(keys.meta(CAM), "live") == b"1"
    finally:
        server.stop(kill=True)


@pytest.mark.skipif(not gst_available()[0], reason=gst_available()[1])
def test_rtsp_backoff_starts_over_after_the_camera_delivered_again(redis_url, services):
    """A stall after frames flowed again backs off from reconnect_min_s, and max_reconnects counts
    the reopens since the last frame: a camera with a blip now and then is not slowed down, and
    never given up, for the blips of long ago."""
    r = redis.Redis.from_url(redis_url)
    server = RtspServer(free_port(), fps=10, width=160, height=120)  # down at first

    def retries() -> list[dict[bytes, bytes]]:
        return [f for _, f in r.xrange(keys.events(CAM)) if f[b"type"] in (b"reconnecting", b"gave_up")]

    try:
        args = ["--fps", "5", "--open-timeout-s", "5", "--read-timeout-s", "1", "--reconnect-min-s", "0.2"]
        proc = ingest(services, server.url, *args, "--reconnect-max-s", "10", "--max-reconnects", "5")
        wait_for(lambda: len(retries()) >= 3, 30, "three reopens while the camera is down", services)
        server.start()
        wait_for(lambda: r.xlen(keys.frames(CAM)) >= 3, 60, "frames once the camera is up", services)
        seen = len(retries())
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)  # a blip: the camera falls silent, the session stalls
        wait_for(lambda: len(retries()) > seen, 30, "a reopen after the camera stalled", services)
        first = retries()[seen]
        assert first[b"type"] == b"reconnecting" and first[b"attempt"] == b"1", first
        assert float(first[b"in_s"]) <= 0.3, first  # reconnect_min_s with jitter, not 0.8 s and more
        assert proc.poll() is None
    finally:
        server.stop(kill=True)


@pytest.mark.skipif(not gst_available()[0], reason=gst_available()[1])
def test_rtsp_fps_below_one_per_read_timeout_is_not_a_stall(redis_url, services):
    """A camera sampled once every 4 s with a 1 s read timeout (a 0.05 fps camera with the default
    10 s) delivers all the time: the watchdog counts decoded frames, not the few kept ones."""
    r = redis.Redis.from_url(redis_url)
    with RtspServer(fps=10, width=160, height=120) as server:
        ingest(services, server.url, "--fps", "0.25", "--read-timeout-s", "1", "--reconnect-min-s", "0.2")
        wait_for(lambda: r.xlen(keys.frames(CAM)) >= 2, 30, "two frames, 4 s apart", services)
        kinds = events(r)
    assert kinds == ["connected"], kinds


def _ts_with_a_clock_jump(path: str, jump_s: float) -> bytes:
    """MPEG-TS, 1 s at 10 fps, then 10 s more (enough for the probe) whose timestamps jump ahead by ``jump_s``."""
    with av.open(path, "w", format="mpegts") as c:
        s = c.add_stream("mpeg2video", rate=10)
        s.width, s.height, s.pix_fmt = 64, 64, "yuv420p"
        for i, t in enumerate([k / 10 for k in range(10)] + [jump_s + 1 + k / 10 for k in range(100)]):
            f = av.VideoFrame.from_ndarray(np.full((64, 64, 3), i * 10 % 256, np.uint8), format="rgb24")
            f.pts, f.time_base = round(t * 90_000), Fraction(1, 90_000)
            for packet in s.encode(f):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    with open(path, "rb") as f:
        return f.read()


def test_live_source_whose_clock_jumps_ahead_is_not_frozen(redis_url, services, tmp_path):
    """A live stream's timestamps leap an hour ahead (an encoder restarted): its frames still come in
    real time, so ingest must not hold them back an hour to pace them."""
    r = redis.Redis.from_url(redis_url)
    data = _ts_with_a_clock_jump(str(tmp_path / "jump.ts"), 3600)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    done = threading.Event()

    def serve() -> None:  # one client gets the stream and the connection stays open (no EOF)
        conn, _ = listener.accept()
        with conn:
            conn.sendall(data)
            done.wait(30)

    threading.Thread(target=serve, daemon=True).start()
    try:
        url = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        ingest(services, url, "--fps", "5", "--read-timeout-s", "2", "--max-reconnects", "0")

        def after_the_jump() -> int:
            return sum(1 for f in frames(r) if isinstance(f, FrameMsg) and f.pts > 3600)

        wait_for(lambda: after_the_jump() >= 3, 10, "frames after the jump, without waiting an hour", services)
    finally:
        done.set()
        listener.close()


def test_live_source_whose_clock_stands_still_is_a_stall(redis_url, services, tmp_path):
    """Frames keep coming and decoding but their timestamps stand still, so the sampler keeps none:
    that is a stall too (reopened), not a camera shown connected that never delivers again."""
    r = redis.Redis.from_url(redis_url)
    path = str(tmp_path / "frozen.ts")
    with av.open(path, "w", format="mpegts") as c:
        s = c.add_stream("libx264", rate=25, options={"tune": "zerolatency"})
        s.width, s.height, s.pix_fmt = 64, 64, "yuv420p"
        s.time_base = s.codec_context.time_base = Fraction(1, 90_000)
        for i in range(400):  # 10 frames at 25 fps, then one 90 kHz tick apart: 16 s sent, 0.4 s of clock
            f = av.VideoFrame.from_ndarray(np.full((64, 64, 3), i % 256, np.uint8), format="rgb24")
            f.pts, f.time_base = (i * 3600 if i < 10 else 9 * 3600 + i - 9), Fraction(1, 90_000)
            for packet in s.encode(f):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    with open(path, "rb") as f:
        data = f.read()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    done = threading.Event()

    def serve() -> None:  # in real time: 400 frames over 16 s
        conn, _ = listener.accept()
        with conn:
            step = len(data) // 160
            for k in range(0, len(data), step):
                if done.wait(0.1):
                    return
                conn.sendall(data[k : k + step])

    threading.Thread(target=serve, daemon=True).start()
    try:
        url = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        ingest(services, url, "--fps", "5", "--read-timeout-s", "1", "--max-reconnects", "0")
        wait_for(lambda: "connected" in events(r), 10, "the source open", services)
        # ~1.5 s after it opens (read timeout 1 s); waited for up to 12 s, still within the 16 s the data lasts
        wait_for(lambda: "stalled" in events(r), 12, "a stall while frames still decode", services)
    finally:
        done.set()
        listener.close()


def test_server_that_accepts_and_never_answers_does_not_hang_ingest(redis_url, services):
    r = redis.Redis.from_url(redis_url)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        proc = ingest(
            services,
            f"rtsp://127.0.0.1:{port}/cam",
            "--fps",
            "5",
            "--open-timeout-s",
            "1",
            "--read-timeout-s",
            "1",
            "--reconnect-min-s",
            "0.2",
            "--reconnect-max-s",
            "0.5",
            "--max-reconnects",
            "2",
        )
        assert proc.wait(timeout=60) == 1  # gave up with nothing usable
        kinds = events(r)
        assert kinds.count("error") == 3 and "gave_up" in kinds
    finally:
        listener.close()


def test_sigterm_while_a_camera_opens_exits_at_once(redis_url, services):
    """A camera that accepts and never answers holds its open (FFmpeg's) for open_timeout_s, which
    no stop reached: SIGTERM waited it out (compose kills at 10 s). The open is left to time out on
    its own; the camera published nothing, and a stop is no error."""
    r = redis.Redis.from_url(redis_url)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(60)
    port = listener.getsockname()[1]
    try:
        proc = ingest(services, f"rtsp://127.0.0.1:{port}/cam", "--open-timeout-s", "30", "--read-timeout-s", "30")
        conn, _ = listener.accept()  # ingest is in its open now, waiting for an answer
        time.sleep(0.5)
        started = time.monotonic()
        proc.terminate()
        assert proc.wait(timeout=60) == 0, services.logs()
        assert time.monotonic() - started < 2.5, (time.monotonic() - started, services.logs())
        conn.close()
    finally:
        listener.close()
    assert r.xlen(keys.frames(CAM)) == 0 and events(r) == []


def test_hls_over_http(redis_url, services, hls_vod):
    """HTTP/HLS through a real HTTP server: an ffmpeg-segmented playlist, paced like a camera (its
    meta says live) and, since it ends, read to its end once."""
    r = redis.Redis.from_url(redis_url)
    assert ingest(services, f"http://{hls_vod}/v.m3u8", "--fps", "5").wait(timeout=60) == 0, services.logs()
    body = [f for f in frames(r) if isinstance(f, FrameMsg)]
    assert len(body) >= 12 and [f.seq for f in body] == list(range(len(body)))
    assert r.hget(keys.meta(CAM), "live") == b"1"


def test_a_forged_frame_with_the_last_seq_does_not_stop_a_new_camera(redis_url, services, tmp_path):
    """An entry with seq INT64_MAX on a stream without a head was taken as the resume point: no seq
    follows it, and the camera's thread died at its first frame while ingest exited 0."""
    r = redis.Redis.from_url(redis_url)
    forged = FrameMsg.from_rgb(INT64_MAX, 1.0, 1.0, np.zeros((28, 28, 3), np.uint8), 0)
    r.xadd(keys.frames(CAM), encode_frame(forged, codec="rgb24"))
    video = write_sample_video(str(tmp_path / "a.mp4"), seconds=2, fps=10, width=160, height=120)
    assert ingest(services, video, "--fps", "2", "--max-backlog", "1000").wait(timeout=60) == 0, services.logs()
    ours = frames(r)[1:]
    assert [f.seq for f in ours] == [0, 1, 2, 3, 3] and isinstance(ours[-1], EndOfStream)


def _metric(port: int, name: str, stream: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    prefix = f'{name}{{stream="{stream}"}} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), None)


def test_a_camera_that_fails_unexpectedly_is_down_with_an_error_event_and_fails_the_exit(redis_url, services, tmp_path):
    """A failure no source error names (here Redis refusing the frames: the camera's frames key
    holds a string) ended the camera's thread with a generic log line: its last event stayed
    `connected`, svqa_ingest_up 1, and ingest exited 0 once the other camera ended."""
    r = redis.Redis.from_url(redis_url)
    r.set(keys.frames("big"), "not a stream")
    small = write_sample_video(str(tmp_path / "small.mp4"), seconds=2, fps=10, width=160, height=120)
    # 15 s paced: still streaming when big's error is read, on a loaded machine too (6 s was not)
    longer = write_sample_video(str(tmp_path / "long.mp4"), seconds=15, fps=10, width=160, height=120)
    cameras = tmp_path / "cameras.yaml"
    cameras.write_text(
        "cameras:\n"
        f"  - {{name: big, url: '{small}', fps: 1}}\n"
        f"  - {{name: ok, url: '{longer}', fps: 2, realtime: true}}\n"
    )
    port = free_port()
    proc = services.start("ingest", "--cameras-file", str(cameras), "--metrics-port", str(port))
    wait_for(lambda: b"error" in [f[b"type"] for _, f in r.xrange(keys.events("big"))], 60, "big's error", services)
    assert _metric(port, "svqa_ingest_up", "big") == 0
    assert _metric(port, "svqa_ingest_up", "ok") == 1
    assert proc.wait(timeout=60) == 1, services.logs()
    last = r.xrevrange(keys.events("big"), count=1)[0][1]
    assert last[b"type"] == b"error" and b"WRONGTYPE" in last[b"error"], last
    assert r.xlen(keys.frames("ok")) == 31  # the other camera went on to its end: 30 frames and its marker
    assert '"stream": "big"' in services.logs() and "cameras failed" in services.logs()


def test_stopped_ingest_exits_0_though_a_camera_had_failed(redis_url, services, tmp_path):
    """SIGTERM exited 1 (`cameras failed`) once any camera had failed before it, a missing file
    of a copied cameras file say: a stop asked for read as a crash (systemd marks the unit failed).
    The failed camera is still named."""
    r = redis.Redis.from_url(redis_url)
    video = write_sample_video(str(tmp_path / "a.mp4"), seconds=30, fps=10, width=160, height=120)
    cameras = tmp_path / "cameras.yaml"
    cameras.write_text(
        "cameras:\n"
        f"  - {{name: gone, url: '{tmp_path / 'missing.mp4'}', fps: 2}}\n"
        f"  - {{name: ok, url: '{video}', fps: 2, realtime: true}}\n"
    )
    proc = services.start("ingest", "--cameras-file", str(cameras))
    wait_for(lambda: b"error" in [f[b"type"] for _, f in r.xrange(keys.events("gone"))], 60, "gone's error", services)
    wait_for(lambda: r.xlen(keys.frames("ok")) >= 2, 60, "ok's frames", services)
    proc.terminate()
    assert proc.wait(timeout=30) == 0, services.logs()
    assert "cameras failed" in services.logs() and '"gone"' in services.logs()
    lines = [json.loads(x) for x in services.logs().splitlines() if x.startswith("{")]
    (error,) = [x for x in lines if x["event"] == "error" and x.get("stream") == "gone"]
    assert error["level"] == "error", error  # a camera's error event was logged at info


def test_a_camera_redis_refuses_stops_alone_and_is_named(redis_server, tmp_path):
    """The ACL's ingest user lacks camera b's keys (added to the file before the users script ran
    again): b is named and reported, a streams to its end; it was an unnamed traceback and exit 1
    within a second, a publishing nothing."""
    r = redis.Redis.from_url(redis_server.url)
    r.execute_command("ACL", "SETUSER", "ing", "on", ">IngPw-77", "~svqa:{a}:*", "+@all")
    video = write_sample_video(str(tmp_path / "a.mp4"), seconds=3, fps=10, width=160, height=120)
    cameras = tmp_path / "cameras.yaml"
    cameras.write_text(
        f"cameras:\n  - {{name: a, url: '{video}', fps: 2, realtime: true}}\n  - {{name: b, url: '{video}', fps: 2}}\n"
    )
    services = Services(f"redis://ing:IngPw-77@127.0.0.1:{redis_server.port}/0", tmp_path)
    try:
        rc = services.start("ingest", "--cameras-file", str(cameras)).wait(timeout=60)
    finally:
        services.stop_all()
    logs = services.logs()
    assert rc == 1, logs
    assert isinstance(decode_frame(r.xrevrange(keys.frames("a"), count=1)[0][1]), EndOfStream)
    refused = [line for line in logs.splitlines() if '"stream": "b"' in line and "camera failed" in line]
    assert refused and "NoPermissionError" in refused[0], logs
    assert "IngPw-77" not in logs


@pytest.mark.skipif(not gst_available()[0], reason=gst_available()[1])
def test_a_camera_given_up_on_fails_the_exit_even_after_frames(redis_url, services):
    """Giving up after max_reconnects exited 0 once the camera had published: compose's
    restart: on-failure left ingest down, read as finished fine."""
    r = redis.Redis.from_url(redis_url)
    server = RtspServer(fps=10, width=160, height=120).start()
    try:
        proc = ingest(
            services,
            server.url,
            *("--fps", "5", "--open-timeout-s", "2", "--read-timeout-s", "2", "--max-reconnects", "2"),
            *("--reconnect-min-s", "0.2", "--reconnect-max-s", "0.5"),
        )
        wait_for(lambda: r.xlen(keys.frames(CAM)) >= 2, 60, "frames from RTSP", services)
    finally:
        server.stop(kill=True)
    assert proc.wait(timeout=60) == 1, services.logs()
    assert events(r)[-1] == "gave_up"


def test_hls_credentials_stay_with_their_origin_across_redirects(hls_vod):
    """A playlist origin that answers 302 to another host (a CDN edge) had the camera's Basic
    credentials sent there: urllib copies ordinary headers onto the redirected request."""
    seen: list[str | None] = []

    class Redirecting(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            # /same -> /hop on this host (the login goes on) -> /edge on another (localhost) -> the VOD
            port = self.server.server_address[1]
            hops = {"/same": "/hop", "/hop": f"http://localhost:{port}/edge", "/edge": f"http://{hls_vod}/v.m3u8"}
            self.send_response(302)
            self.send_header("Location", hops[self.path])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    origin = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    try:
        assert ended_playlist(f"http://cam:Hls-PW7@127.0.0.1:{origin.server_port}/same", 5)
    finally:
        origin.shutdown()
    login = "Basic " + base64.b64encode(b"cam:Hls-PW7").decode()
    assert seen == [login, login, None]


@pytest.mark.skipif(not gst_available()[0], reason=gst_available()[1])
@pytest.mark.parametrize(("fps", "stalled"), [("2", True), ("0.05", False)], ids=["stalled", "slow"])
def test_sigterm_stops_within_seconds_and_is_no_reconnect(redis_url, services, fps, stalled):
    """A stalled camera held SIGTERM up 20 s, one at fps 0.05 37 s (compose kills at 10 s), and a
    clean stop of a live camera wrote a `reconnecting` event."""
    r = redis.Redis.from_url(redis_url)
    with RtspServer(fps=10, width=160, height=120) as server:
        proc = ingest(services, server.url, "--fps", fps)
        wait_for(lambda: r.xlen(keys.frames(CAM)) >= 1, 60, "a frame", services)
        if stalled:
            os.kill(server.proc.pid, signal.SIGSTOP)  # the camera hangs; RtspServer.stop wakes it
            time.sleep(0.5)
        before = len(events(r))
        started = time.monotonic()
        proc.terminate()
        assert proc.wait(timeout=30) == 0, services.logs()
        assert time.monotonic() - started < 3
    assert events(r)[before:] == []


class FramesRedisDiesAtTheEnd(Source):
    """The frames Redis (compose's redis-frames) goes away just as the file ends."""

    frames_server: RedisServer

    def _publish(self, msg: FrameMsg | EndOfStream) -> None:
        if isinstance(msg, EndOfStream):
            self.frames_server.stop()
        super()._publish(msg)


def test_end_of_stream_during_a_frames_redis_outage_ends_past_the_grace_period(redis_url, redis_server, tmp_path):
    """The marker was retried riding out the durable Redis, which answered: 'redis unreachable',
    'redis back' every 10 s for ever, where the README promises exit 3 after redis_grace_s."""
    video = write_sample_video(str(tmp_path / "a.mp4"), seconds=1, fps=10, width=160, height=120)
    cfg = IngestConfig(url=video, stream=CAM, redis_url=redis_url, frames_redis_url=redis_server.url, redis_grace_s=2)
    source = FramesRedisDiesAtTheEnd(
        redisio.connect(redis_url), source_specs(cfg)[0], cfg, threading.Event(), redisio.connect(redis_server.url)
    )
    source.frames_server = redis_server
    ended: list[BaseException] = []

    def run() -> None:
        try:
            source.run()
        except redisio.RedisGone as e:
            ended.append(e)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=40)
    source.stop.set()  # ends the loop that never stopped, so the test does not leave it behind
    assert ended, "still riding out the durable Redis after 40 s (grace 2 s)"


def test_a_named_pipe_without_a_writer_is_waited_for_within_the_open_timeout(redis_url, services, tmp_path):
    """FFmpeg's open of a pipe with no writer blocked in open(2): no event, no log line, and
    SIGTERM ignored (the main thread joined the stuck camera). It is a camera now: bounded opens,
    retried, and read once a writer comes."""
    r = redis.Redis.from_url(redis_url)
    mp4 = write_sample_video(str(tmp_path / "a.mp4"), seconds=2, fps=10, width=160, height=120)
    ts = tmp_path / "a.ts"
    subprocess.run(["ffmpeg", "-v", "error", "-i", mp4, "-c", "copy", "-f", "mpegts", str(ts)], check=True)
    fifo = tmp_path / "cam.ts"
    os.mkfifo(fifo)
    proc = ingest(
        services,
        str(fifo),
        *("--fps", "5", "--open-timeout-s", "1", "--reconnect-min-s", "0.2", "--reconnect-max-s", "0.5"),
    )
    wait_for(lambda: "reconnecting" in events(r), 30, "a bounded open, retried", services)
    assert b"no writer" in r.xrange(keys.events(CAM))[0][1][b"error"]

    bridged = threading.Event()

    def bridge() -> None:  # comes up and streams; a reader that timed out as it opened is a broken pipe
        while not bridged.is_set():
            try:
                with fifo.open("wb") as out:
                    while not bridged.is_set():
                        out.write(ts.read_bytes())
            except BrokenPipeError:
                continue

    threading.Thread(target=bridge, daemon=True).start()
    try:
        wait_for(lambda: r.xlen(keys.frames(CAM)) >= 5, 30, "frames through the pipe", services)
        started = time.monotonic()
        proc.terminate()
        assert proc.wait(timeout=30) == 0, services.logs()
        assert time.monotonic() - started < 3
    finally:
        bridged.set()
    assert r.hget(keys.meta(CAM), "live") == b"1"


def test_the_starting_line_names_the_cameras_files_streams_never_their_urls(tmp_path):
    """Cameras from a cameras file: the `starting` log line lists their names (it showed none),
    and no URL, whose credentials stay out of the logs."""
    import json
    import sys

    cameras = tmp_path / "cameras.yaml"
    cameras.write_text(
        "cameras:\n"
        "  - {name: door, url: 'rtsp://viewer:Sup3r-s3cret@10.0.0.5/door', fps: 2}\n"
        "  - {name: yard, url: '/videos/yard.mp4', fps: 2}\n"
    )
    argv = ["ingest", "--cameras-file", str(cameras), "--redis-grace-s", "0.5"]
    argv += ["--redis-url", f"redis://127.0.0.1:{free_port()}/0"]  # nobody there: it exits after starting
    out = subprocess.run([sys.executable, "-m", "apps.cli", *argv], capture_output=True, text=True, timeout=60)
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    (starting,) = [line for line in lines if line["event"] == "starting"]
    assert starting["streams"] == ["door", "yard"], starting
    assert "Sup3r-s3cret" not in out.stderr and "10.0.0.5" not in out.stderr and "yard.mp4" not in out.stderr
