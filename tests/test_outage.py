"""Redis outages longer than redis-py's retry budget (~10 s), Redis with AOF like compose's.

Ridden out: ingest, encoder and qa stay up through a 15 s outage under a live stream, keep
their lease, encode every frame at most once, and answer a question asked before it. Past
`redis_grace_s` every service exits 3 with one log line.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import redis

from apps.samplevideo import write_sample_video
from common.lease import holder_name
from common.wire import keys
from common.wire.schemas import EndOfStream, FrameMsg, decode_frame, encode_frame
from qa_worker.client import Client
from tests.conftest import free_port
from tests.pipeline import Services, chunk_frames_in_history, head, reading_questions, wait_for
from tests.rtsp_server import RtspServer, gst_available

CAM = "cam1"
OUTAGE_S = 15.0


def test_services_ride_out_an_outage_longer_than_the_retry_budget(aof_redis_server, tmp_path):
    url = aof_redis_server.url
    r = redis.Redis.from_url(url)
    video = write_sample_video(str(tmp_path / "long.mp4"), seconds=40, fps=10, width=160, height=120)
    services = Services(url, tmp_path, SVQA_STREAMS=CAM, SVQA_LEASE_MS="3000", SVQA_REDIS_GRACE_S="60")
    try:
        live = ("--url", video, "--stream", CAM, "--fps", "2", "--realtime", "true")
        procs = [services.start("encoder", "--consumer", "enc-a"), services.start("qa")]
        procs.append(services.start("ingest", *live))
        wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq >= 5, 90, "frames before the outage", services)
        wait_for(lambda: reading_questions(r), 90, "qa running", services)  # not still starting (a start fails)
        before = head(r, CAM)
        asked = Client(r).submit(CAM, "What now?", max_tokens=4)  # queued as Redis goes away
        aof_redis_server.stop()
        time.sleep(OUTAGE_S)
        assert all(p.poll() is None for p in procs), services.logs()
        aof_redis_server.start()
        r = redis.Redis.from_url(url)
        wait_for(lambda: head(r, CAM).last_frame_seq >= before.last_frame_seq + 8, 60, "frames after it", services)
        after = head(r, CAM)
        assert after.version > before.version and holder_name(r.get(keys.lease(CAM))) == "enc-a", (
            "the stream was not dropped"
        )
        assert not [f for _, f in r.xrange(keys.events(CAM)) if f[b"type"] == b"encoder_attached"][1:], "re-taken"
        seqs = chunk_frames_in_history(r, CAM)
        assert len(seqs) == len(set(seqs)), "a frame encoded twice"
        final = wait_for(lambda: _final(r, asked), 60, "the question asked before the outage", services)
        assert final.error is None
        assert all(p.poll() is None for p in procs), services.logs()
        assert "redis unreachable; waiting for it" in services.logs()
    finally:
        services.stop_all()


def _final(r: redis.Redis, qid: str):
    from common.wire.schemas import FinalAnswer, decode_answer

    return next((a for _, f in r.xrange(keys.answer(qid)) if isinstance(a := decode_answer(f), FinalAnswer)), None)


def test_past_the_grace_period_every_service_exits_3(aof_redis_server, tmp_path):
    url = aof_redis_server.url
    r = redis.Redis.from_url(url)
    video = write_sample_video(str(tmp_path / "clip.mp4"), seconds=30, fps=10, width=160, height=120)
    services = Services(url, tmp_path, SVQA_STREAMS=CAM, SVQA_REDIS_GRACE_S="1")
    try:
        live = ("--url", video, "--stream", CAM, "--fps", "2", "--realtime", "true")
        procs = {n: services.start(n, *(live if n == "ingest" else ())) for n in ("encoder", "qa", "ingest")}
        wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq >= 1, 90, "a first version", services)
        wait_for(lambda: reading_questions(r), 90, "qa running", services)  # not still starting
        aof_redis_server.stop()
        codes = {n: p.wait(timeout=40) for n, p in procs.items()}
        assert codes == {"encoder": 3, "qa": 3, "ingest": 3}, services.logs()
        for n in procs:
            log = (tmp_path / f"{n}-{list(procs).index(n)}.log").read_text().splitlines()
            gone = [json.loads(x) for x in log if "grace period" in x]
            assert len(gone) == 1 and gone[0]["level"] == "error", f"{n}: {log[-5:]}"
    finally:
        services.stop_all()


# -- ingest reading a file (backpressure, no pacing) --------------------------------------------------------
FILE_FRAMES = 20  # a 10 s clip sampled at 2 fps


def _file_ingest(server, tmp_path, **env: str):
    """An ingest subprocess reading a real file, held back by its backlog (4 frames) until the test,
    playing the encoder, takes them; its read watchdog at 1 s, well inside the outages below."""
    video = write_sample_video(str(tmp_path / "clip.mp4"), seconds=10, fps=10, width=160, height=120)
    r = redis.Redis.from_url(server.url)
    r.xgroup_create(keys.frames(CAM), keys.ENCODER_GROUP, id="0", mkstream=True)
    services = Services(server.url, tmp_path, SVQA_MAX_BACKLOG="4", SVQA_READ_TIMEOUT_S="1", **env)
    proc = services.start("ingest", "--url", video, "--stream", CAM, "--fps", "2")
    wait_for(lambda: r.xlen(keys.frames(CAM)) >= 4, 60, "the backlog filled", services)
    return r, services, proc


def _take_to_the_end(r: redis.Redis, services: Services, proc) -> tuple[list[int], EndOfStream]:
    """Read and ack every frames entry as the encoder would, until the end-of-stream marker."""
    seqs: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        exited = proc.poll() is not None  # read once more after it exits: its last entries
        got = r.xreadgroup(keys.ENCODER_GROUP, "test", {keys.frames(CAM): ">"}, count=8, block=200)
        if exited and not got:
            break
        for _, entries in got:
            for entry_id, fields in entries:
                r.xack(keys.frames(CAM), keys.ENCODER_GROUP, entry_id)
                msg = decode_frame(fields)
                if isinstance(msg, EndOfStream):
                    return seqs, msg
                seqs.append(msg.seq)
    raise AssertionError(f"no end of stream; frames {seqs}\n{services.logs()}")


@pytest.mark.parametrize("outage", ["paused", "restarted"])
def test_file_ingest_rides_out_an_outage_longer_than_its_read_timeout(aof_redis_server, tmp_path, outage):
    """Redis paused (SIGSTOP: commands hang) or restarted on its port for 3 s while ingest waits on
    the backlog: the read watchdog (1 s) does not blame the file; every frame arrives, then the end."""
    r, services, proc = _file_ingest(aof_redis_server, tmp_path, SVQA_REDIS_GRACE_S="60")
    try:
        if outage == "paused":
            aof_redis_server.proc.send_signal(signal.SIGSTOP)
            time.sleep(3)
            aof_redis_server.proc.send_signal(signal.SIGCONT)
        else:
            aof_redis_server.stop()
            time.sleep(3)
            aof_redis_server.start()
            r = redis.Redis.from_url(aof_redis_server.url)
        seqs, end = _take_to_the_end(r, services, proc)
        assert proc.wait(timeout=30) == 0, services.logs()
        assert sorted(set(seqs)) == list(range(FILE_FRAMES)) and end.seq == FILE_FRAMES - 1, services.logs()
        assert "stalled" not in services.logs()
    finally:
        services.stop_all()


def test_file_ingest_exits_3_past_the_grace_period(aof_redis_server, tmp_path):
    _, services, proc = _file_ingest(aof_redis_server, tmp_path, SVQA_REDIS_GRACE_S="1")
    try:
        aof_redis_server.stop()
        assert proc.wait(timeout=60) == 3, services.logs()
        log = (tmp_path / "ingest-0.log").read_text().splitlines()
        assert len([x for x in log if "grace period" in x]) == 1, log[-5:]
    finally:
        services.stop_all()


@pytest.mark.skipif(not gst_available()[0], reason=gst_available()[1])
def test_rtsp_ingest_rides_out_a_paused_redis_then_exits_3_past_the_grace_period(redis_server, tmp_path):
    """A live camera: Redis paused for 3 s (its commands hang) with the read watchdog at 1 s is no
    stall of the camera (no `stalled` event, no reopen, seqs go on); Redis gone past the grace
    period (2 s) is exit 3 with one line, as for a file."""
    r = redis.Redis.from_url(redis_server.url)
    camera = RtspServer(fps=10, width=160, height=120).start()
    services = Services(redis_server.url, tmp_path, SVQA_REDIS_GRACE_S="2", SVQA_READ_TIMEOUT_S="1")
    try:
        proc = services.start("ingest", "--url", camera.url, "--stream", CAM, "--fps", "5")
        wait_for(lambda: r.xlen(keys.frames(CAM)) >= 5, 60, "frames from the camera", services)
        redis_server.proc.send_signal(signal.SIGSTOP)
        time.sleep(3)
        redis_server.proc.send_signal(signal.SIGCONT)
        before = r.xlen(keys.frames(CAM))
        wait_for(lambda: r.xlen(keys.frames(CAM)) >= before + 10, 60, "frames after the pause", services)
        kinds = [f[b"type"] for _, f in r.xrange(keys.events(CAM))]
        assert b"stalled" not in kinds and kinds.count(b"connected") == 1, kinds
        seqs = [m.seq for _, f in r.xrange(keys.frames(CAM)) if isinstance(m := decode_frame(f), FrameMsg)]
        assert seqs == list(range(len(seqs)))
        redis_server.stop()
        assert proc.wait(timeout=60) == 3, services.logs()
        log = (tmp_path / "ingest-0.log").read_text().splitlines()
        assert len([x for x in log if "grace period" in x]) == 1, log[-5:]
    finally:
        services.stop_all()
        camera.stop(kill=True)


def test_a_full_redis_is_waited_out_and_blamed_on_no_frame_or_question(redis_server, tmp_path):
    """Redis at `maxmemory` (noeviction) refuses writes with OOM while it answers PING: the worker
    waits (ready fails naming it), dead-letters nothing, and goes on once there is room. It used
    to reject the question and the chunk as if they were at fault, then abort (SIGABRT)."""
    r = redis.Redis.from_url(redis_server.url)
    r.hset(keys.meta(CAM), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    for seq in range(4):
        r.xadd(keys.frames(CAM), _frame(seq))
    port = free_port()
    services = Services(redis_server.url, tmp_path, SVQA_STREAMS=CAM, SVQA_METRICS_PORT=str(port))
    worker = services.start("worker", "--chunk-frames", "2")
    try:
        wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq == 3, 120, "the first frames", services)
        assert Client(r).ask(CAM, "warm?", max_tokens=2, timeout_s=60).error is None
        asked = Client(r).submit(CAM, "And now?", max_tokens=4)
        for seq in (4, 5):
            r.xadd(keys.frames(CAM), _frame(seq))
        r.config_set("maxmemory", "1")
        why = wait_for(lambda: _not_ready(port).get("redis_writes"), 30, "ready to name the refusal", services)
        assert "OutOfMemoryError" in why
        time.sleep(2)
        assert worker.poll() is None, services.logs()
        r.config_set("maxmemory", "0")
        wait_for(lambda: head(r, CAM).last_frame_seq >= 5, 60, "the frames sent while Redis was full", services)
        final = wait_for(lambda: _final(r, asked), 60, "the question asked while Redis was full", services)
        assert final.error is None
        assert r.xlen(keys.DEAD_LETTER) == 0, r.xrange(keys.DEAD_LETTER)
        wait_for(lambda: _not_ready(port) == {}, 60, "ready again", services)
        assert worker.poll() is None and "redis refuses writes; waiting" in services.logs()
    finally:
        services.stop_all()


def _frame(seq: int) -> dict:
    return encode_frame(FrameMsg.from_rgb(seq, seq / 2, seq / 2, np.zeros((56, 56, 3), np.uint8)))


def _not_ready(port: int) -> dict:
    """/health/ready's failing reasons (empty when ready)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=2) as reply:
            return {} if json.load(reply)["ready"] else {"unknown": "not ready"}
    except urllib.error.HTTPError as e:
        return json.loads(e.read()).get("reasons") or {"checks": "failing"}
