"""Encoder ownership: a version is published only while this encoder holds the stream's lease."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from common.engine.model import load_model
from common.engine.runtime import Runtime
from common.segment_store import MemoryStore
from common.wire import keys
from common.wire.schemas import FrameMsg, manifest_from_bytes
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
