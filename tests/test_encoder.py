"""Encoder ownership: a version is published only while this encoder holds the stream's lease."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import redis

from common.engine.model import load_model
from common.engine.runtime import Runtime
from common.segment_store import MemoryStore
from common.wire import keys
from common.wire.schemas import FrameMsg, decode_frame, encode_frame, manifest_from_bytes
from encoder_worker.config import EncoderConfig
from encoder_worker.stream import LeaseLost, open_stream


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


def test_publish_is_fenced_by_the_lease(rt, redis_url):
    r = redis.Redis.from_url(redis_url)
    cfg = EncoderConfig(redis_url=redis_url, streams=("cam",), consumer="me", chunk_frames=2)
    r.hset(keys.meta("cam"), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    r.set(keys.lease("cam"), "me")
    owned = open_stream(rt, r, MemoryStore(), cfg, "cam")
    frame = np.zeros((56, 56, 3), np.uint8)
    owned.add("1-0", FrameMsg.from_rgb(0, 0.0, 0.0, frame))
    owned.add("2-0", FrameMsg.from_rgb(1, 0.5, 0.5, frame))
    assert manifest_from_bytes(r.get(keys.head("cam"))).last_frame_seq == 1
    r.set(keys.lease("cam"), "someone-else")  # our lease expired and another encoder took the stream
    owned.add("3-0", FrameMsg.from_rgb(2, 1.0, 1.0, frame))
    with pytest.raises(LeaseLost):
        owned.add("4-0", FrameMsg.from_rgb(3, 1.5, 1.5, frame))
    assert manifest_from_bytes(r.get(keys.head("cam"))).last_frame_seq == 1, "a fenced-off write landed"


@pytest.mark.parametrize("decoders", [1, 4])
def test_frames_of_all_streams_are_decoded_at_most_decode_threads_at_once(rt, redis_url, monkeypatch, decoders):
    """Each stream's thread decodes its own frames; cameras in step deliver theirs together, and
    the decodes of all streams share `decode_threads` (the GPU loop keeps a core)."""
    from encoder_worker import service

    r = redis.Redis.from_url(redis_url)
    cams = [f"cam{i}" for i in range(6)]
    for cam in cams:
        r.hset(keys.meta(cam), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
        for seq in range(2):
            r.xadd(
                keys.frames(cam),
                encode_frame(FrameMsg.from_rgb(seq, seq / 2, seq / 2, np.zeros((56, 56, 3), np.uint8))),
            )
    at_once, most = [0], [0]
    lock = threading.Lock()

    def decode(fields):  # the real decode, held long enough for the streams' threads to overlap
        with lock:
            at_once[0] += 1
            most[0] = max(most[0], at_once[0])
        try:
            time.sleep(0.02)
            return decode_frame(fields)
        finally:
            with lock:
                at_once[0] -= 1

    monkeypatch.setattr(service, "decode_frame", decode)
    cfg = EncoderConfig(
        redis_url=redis_url, streams=tuple(cams), consumer="me", chunk_frames=2, block_ms=50, decode_threads=decoders
    )
    svc = service.EncoderService(cfg, rt, r, MemoryStore())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(r.exists(keys.head(cam)) for cam in cams):
        svc.step()
    assert all(manifest_from_bytes(r.get(keys.head(cam))).last_frame_seq == 1 for cam in cams), "every frame encoded"
    assert most[0] == decoders if decoders == 1 else 2 <= most[0] <= decoders
