"""A stream whose segments are lost (the host rebooted: the shared-memory store is gone) is rebuilt
from the frames log: its kept chunks re-encoded through the ordinary append path, on a real
redis-server, real files and a tiny random-weight model. The answer from the rebuilt head equals
one-shot offline inference on exactly the frames it kept; a chunk the log does not hold whole is
skipped and said so; without the frames it starts over as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import redis

from common.engine.answer import GenerationParams, ask
from common.engine.grid import Grid
from common.engine.model import load_model
from common.engine.offline import offline_answer
from common.engine.runtime import Runtime
from common.framelog import FrameLog
from common.segment_store import DirectoryStore
from common.wire import keys
from common.wire.schemas import FIELD, FrameMsg, encode_frame
from encoder_worker.config import EncoderConfig
from encoder_worker.service import EncoderService
from qa_worker.mirror import StreamMirror
from tests.test_persistence import encoded, events, head, run_until, stop

CAM = "cam"
QUESTION = "What is it?"


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


def frame(seq: int) -> np.ndarray:
    return np.random.default_rng(seq).integers(0, 256, (56, 56, 3), dtype=np.uint8)


def service(rt: Runtime, r: redis.Redis, url: str, tmp_path: Path) -> EncoderService:
    r.hset(keys.meta(CAM), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    cfg = EncoderConfig(
        redis_url=url, streams=(CAM,), consumer="enc", chunk_frames=2, block_ms=50, framelog_dir=str(tmp_path / "log")
    )
    return EncoderService(cfg, rt, r, DirectoryStore(tmp_path / "segments"))


def send(r: redis.Redis, tmp_path: Path, seqs: range, logged: set[int]) -> None:
    """Frames onto the frames stream as ingest sends them, and those in ``logged`` into the frames
    log as the recorder writes them (the entry's packed payload)."""
    writer = FrameLog(tmp_path / "log").writer(CAM, roll_s=600)
    for seq in seqs:
        fields = encode_frame(FrameMsg.from_rgb(seq, seq / 2, seq / 2, frame(seq)))
        r.xadd(keys.frames(CAM), fields)
        if seq in logged:
            writer.append(seq, seq / 2, fields[FIELD])
    writer.commit()
    writer.close()


def host_lost(
    rt: Runtime, r: redis.Redis, url: str, tmp_path: Path, logged: set[int], then: range = range(0)
) -> EncoderService:
    """6 frames encoded (3 chunks of 2) with ``logged`` of them in the log, the segment store wiped
    (a reboot empties /dev/shm), the frames ``then`` sent meanwhile, and a new encoder started on
    the same Redis."""
    svc = service(rt, r, url, tmp_path)
    send(r, tmp_path, range(6), logged)
    run_until(svc, lambda: encoded(r, CAM, 5), "6 frames")
    stop(svc, r)
    shutil.rmtree(tmp_path / "segments")
    send(r, tmp_path, then, logged)
    again = service(rt, r, url, tmp_path)
    run_until(again, lambda: CAM in again.owned, "the stream owned")
    return again


def answers_like_offline(rt: Runtime, r: redis.Redis, tmp_path: Path, kept: list[int]) -> None:
    mirrored = StreamMirror(rt, DirectoryStore(tmp_path / "segments"), CAM).apply(head(r, CAM))
    streamed = ask(rt, mirrored, QUESTION, GenerationParams(max_tokens=6))
    offline = offline_answer(rt, [frame(s) for s in kept], Grid(56, 56), 2.0, QUESTION, max_tokens=6)
    assert streamed.token_ids == offline.token_ids


def test_a_lost_store_is_rebuilt_from_the_frames_log_and_frames_go_on(rt, redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    svc = host_lost(rt, r, redis_url, tmp_path, logged=set(range(10)), then=range(6, 8))  # 6, 7: not encoded yet
    (rebuilt,) = events(r, CAM, b"rebuilt")
    assert (rebuilt[b"chunks"], rebuilt[b"frames"], rebuilt[b"skipped"]) == (b"3", b"6", b"0")
    assert rebuilt[b"last_frame_seq"] == b"5", "frames up to the last rebuilt one are not taken again"
    assert not events(r, CAM, b"cache_restarted")
    run_until(svc, lambda: encoded(r, CAM, 7), "the frames pending at the restart")
    send(r, tmp_path, range(8, 10), logged=set())
    run_until(svc, lambda: encoded(r, CAM, 9), "the next frames")
    assert [s.frame_seqs for s in head(r, CAM).segments[1:]] == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)], "once each"
    answers_like_offline(rt, r, tmp_path, list(range(10)))
    stop(svc, r)


def test_a_chunk_the_log_lacks_a_frame_of_is_skipped(rt, redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    svc = host_lost(rt, r, redis_url, tmp_path, logged={0, 1, 3, 4, 5})  # seq 2 never reached the log
    (rebuilt,) = events(r, CAM, b"rebuilt")
    assert (rebuilt[b"chunks"], rebuilt[b"frames"], rebuilt[b"skipped"]) == (b"2", b"4", b"1")
    assert rebuilt[b"skipped_seqs"] == b"2-3"
    assert [s.frame_seqs for s in head(r, CAM).segments[1:]] == [(0, 1), (4, 5)]
    answers_like_offline(rt, r, tmp_path, [0, 1, 4, 5])
    stop(svc, r)


def test_a_log_without_the_streams_frames_starts_it_over(rt, redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    svc = host_lost(rt, r, redis_url, tmp_path, logged=set())
    assert len(events(r, CAM, b"cache_restarted")) == 1 and not events(r, CAM, b"rebuilt")
    assert head(r, CAM).last_frame_seq == -1
    stop(svc, r)
