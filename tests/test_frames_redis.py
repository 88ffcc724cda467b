"""Frames on a Redis of their own (`frames_redis_url`): they never reach the durable Redis's AOF,
while the stream's description, versions, questions and answers never leave it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from apps.samplevideo import write_sample_video
from common.wire import keys
from qa_worker.client import Client
from tests.conftest import RedisServer
from tests.pipeline import Services, head, wait_for

CAM = "cam1"


@pytest.fixture
def two_redis(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """(durable with AOF, frames without persistence), as compose runs them."""
    (tmp_path / "durable").mkdir()
    (tmp_path / "frames").mkdir()
    durable, frames = RedisServer(tmp_path / "durable", aof=True), RedisServer(tmp_path / "frames")
    durable.start()
    frames.start()
    try:
        yield durable, frames
    finally:
        durable.stop()
        frames.stop()


def all_keys(r: redis.Redis) -> set[str]:
    return {k.decode() for k in r.scan_iter("*")}


def test_frames_live_only_on_the_frames_redis_and_questions_are_answered(two_redis, tmp_path: Path):
    durable, frames = two_redis
    rd, rf = redis.Redis.from_url(durable.url), redis.Redis.from_url(frames.url)
    video = write_sample_video(str(tmp_path / "clip.mp4"), seconds=6, fps=10, width=160, height=120)
    services = Services(durable.url, tmp_path, SVQA_STREAMS=CAM, SVQA_FRAMES_REDIS_URL=frames.url)
    try:
        worker = services.start("worker")
        feeder = services.start("ingest", "--url", video, "--stream", CAM, "--fps", "2", "--max-backlog", "8")
        assert feeder.wait(timeout=180) == 0, services.logs()
        wait_for(lambda: (h := head(rd, CAM)) and h.last_frame_seq == 11, 180, "all 12 frames encoded", services)
        final = Client(rd).ask(CAM, "What is on the screen?", max_tokens=4, timeout_s=120)
        assert final.error is None and final.tokens > 0, final
        assert worker.poll() is None, services.logs()
        # the audit copy is written after the final the client read (answering.py `_finish`)
        wait_for(lambda: rd.exists(keys.ANSWERS), 60, "the final's audit copy", services)

        on_frames, on_durable = all_keys(rf), all_keys(rd)
        # frames, the picture, and the chunks' search vectors (bounded, for the recorder's index)
        assert on_frames == {keys.frames(CAM), keys.latest_frame(CAM), keys.features(CAM)}, "only frames and their kin"
        durable_only = {keys.meta(CAM), keys.events(CAM), keys.versions(CAM), keys.head(CAM), keys.lease(CAM)}
        durable_only |= {keys.QUESTIONS, keys.ANSWERS, keys.answer(final.id)}
        assert durable_only <= on_durable and not on_durable & on_frames, sorted(on_durable)
        (group,) = rf.xinfo_groups(keys.frames(CAM))
        assert group["pending"] == 0 and group["lag"] == 0, "every frame acked, on the frames Redis"
        aof = b"".join(p.read_bytes() for p in (tmp_path / "durable").rglob("appendonly*") if p.is_file())
        assert keys.versions(CAM).encode() in aof and keys.answer(final.id).encode() in aof
        assert b":frames" not in aof and b"frame:latest" not in aof, "a frame went through the durable AOF"

        # `streamvqa status` reads the frames queue where the frames are
        out = subprocess.run(
            [sys.executable, "-m", "apps.cli", "status", "--json", "--redis-url", durable.url],
            capture_output=True,
            text=True,
            timeout=60,
            env={**services.env, "SVQA_FRAMES_REDIS_URL": frames.url},
        )
        assert out.returncode == 0, out.stderr
        (stream,) = json.loads(out.stdout)["streams"]
        assert stream["frames"]["length"] == rf.xlen(keys.frames(CAM)) > 12 and stream["frames"]["pending"] == 0
    finally:
        services.stop_all()
