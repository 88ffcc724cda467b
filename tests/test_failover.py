"""Stream ownership under the failures an operator meets, with real encoders on a real Redis.

A worker frozen past its lease (SIGSTOP: a stalled VM, a paused container) and woken after
another process took its streams must write nothing more to them, even when that other process
runs under the same consumer name (a replacement started under the frozen one's name, or two
workers given one name by mistake): one stream's versions have one writer at a time.
"""

from __future__ import annotations

import signal
import time

import redis
import yaml

from apps.samplevideo import write_sample_video
from common.wire import keys
from tests.pipeline import Services, chunk_frames_in_history, head, manifests, wait_for

CAM = "cam1"
GRID_PIXELS = 28 * 28 * 16  # a 112x112 model grid: small chunks, a fast CPU test
ENV = dict(SVQA_STREAMS=CAM, SVQA_LEASE_MS="2000", SVQA_CHUNK_FRAMES="2", SVQA_CLAIM_IDLE_MS="3000")


def live_camera(tmp_path) -> str:
    video = write_sample_video(str(tmp_path / "clip.mp4"), seconds=300, fps=4, width=160, height=120)
    cameras = tmp_path / "cameras.yaml"
    cam = dict(name=CAM, url=video, fps=2, realtime=True, min_pixels=GRID_PIXELS, max_pixels=GRID_PIXELS)
    cameras.write_text(yaml.safe_dump({"cameras": [cam]}))
    return str(cameras)


def attached(r: redis.Redis) -> int:
    return sum(f[b"type"] == b"encoder_attached" for _, f in r.xrange(keys.events(CAM)))


def started(services: Services, log_name: str) -> bool:
    return "encoder started" in (services.workdir / log_name).read_text()


def test_a_frozen_worker_woken_after_a_namesake_took_its_stream_writes_nothing(redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    services = Services(redis_url, tmp_path, **ENV)
    try:
        services.start("ingest", "--cameras-file", live_camera(tmp_path))
        frozen = services.start("encoder", "--consumer", "enc")
        wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq >= 3, 120, "a few chunks", services)
        services.start("encoder", "--consumer", "enc")  # the same name, by mistake or as a replacement
        wait_for(lambda: started(services, "encoder-2.log"), 120, "the second encoder running", services)
        frozen.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: attached(r) == 2, 30, "the stream taken over once the lease ran out", services)
            taken_at = head(r, CAM).version
        finally:
            frozen.send_signal(signal.SIGCONT)
        time.sleep(8)  # the woken one's renewals, reads and chunks: none may land
        assert head(r, CAM).version > taken_at + 2, "the new owner goes on"
        ids = [m.version for m in manifests(r, CAM)]
        assert ids == sorted(set(ids)), f"two writers: versions written twice or out of order: {ids}"
        seqs = chunk_frames_in_history(r, CAM)
        assert len(seqs) == len(set(seqs)), "a frame encoded twice"
    finally:
        services.stop_all()
