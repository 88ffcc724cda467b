"""Control keys of the wrong type (a lease, the heartbeat set): only workers write them, so
another type there is damage. It is replaced, and every camera goes on; found by probing, when
one such key stopped the whole worker (WRONGTYPE out of the lease loop), and a restart too."""

from __future__ import annotations

import numpy as np
import redis

from common.wire import keys
from common.wire.schemas import FrameMsg, encode_frame
from qa_worker.client import Client
from tests.pipeline import Services, head, wait_for

CAMS = ("cam1", "cam2")


def test_a_damaged_lease_or_heartbeat_set_is_replaced_and_every_camera_goes_on(redis_server, tmp_path):
    r = redis.Redis.from_url(redis_server.url)
    sent = dict.fromkeys(CAMS, 0)
    for cam in CAMS:
        r.hset(keys.meta(cam), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
        _send(r, cam, sent, 4)
    services = Services(redis_server.url, tmp_path, SVQA_STREAMS=",".join(CAMS))
    worker = services.start("worker", "--chunk-frames", "2")
    try:
        _every_camera_encodes_and_answers(r, sent, services)
        r.delete(keys.lease("cam2"))
        r.hset(keys.lease("cam2"), "not", "a lease")
        r.delete(keys.WORKERS)
        r.set(keys.WORKERS, "not a set")
        for cam in CAMS:
            _send(r, cam, sent, 2)
        _every_camera_encodes_and_answers(r, sent, services)
        assert worker.poll() is None, services.logs()
        assert r.type(keys.WORKERS) == b"set" and r.type(keys.lease("cam2")) == b"string"
        logs = services.logs()
        assert "heartbeat keys of the wrong type; replaced" in logs and "lease key held no lease" in logs
    finally:
        services.stop_all()


def _send(r: redis.Redis, cam: str, sent: dict[str, int], n: int) -> None:
    black = np.zeros((56, 56, 3), np.uint8)
    for seq in range(sent[cam], sent[cam] + n):
        r.xadd(keys.frames(cam), encode_frame(FrameMsg.from_rgb(seq, seq / 2, seq / 2, black)))
    sent[cam] += n


def _every_camera_encodes_and_answers(r: redis.Redis, sent: dict[str, int], services: Services) -> None:
    """Every frame sent so far is encoded, and a question to each camera is answered."""
    for cam in CAMS:
        last = sent[cam] - 1
        wait_for(lambda c=cam, w=last: (h := head(r, c)) and h.last_frame_seq >= w, 120, f"{cam} encoded", services)
        assert Client(r).ask(cam, "and?", max_tokens=1, timeout_s=60).error is None
