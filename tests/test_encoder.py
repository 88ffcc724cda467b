"""Encoder ownership: a version is published only while this encoder holds the stream's lease."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis
import structlog.testing

from common.decoding import FrameDecoder
from common.engine.model import load_model
from common.engine.runtime import Runtime
from common.segment_store import MemoryStore
from common.segment_writer import SegmentWriter
from common.wire import keys
from common.wire.schemas import (
    FIELD,
    EndOfStream,
    FrameMsg,
    SchemaError,
    capture_time,
    encode_frame,
    frame_from_map,
    manifest_from_bytes,
    unpack_frame,
)
from encoder_worker.config import EncoderConfig
from encoder_worker.owned_stream import LeaseLost, open_stream


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


def test_publish_is_fenced_by_the_lease(rt, redis_url):
    r = redis.Redis.from_url(redis_url)
    cfg = EncoderConfig(redis_url=redis_url, streams=("cam",), consumer="me", chunk_frames=2)
    r.hset(keys.meta("cam"), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    r.set(keys.lease("cam"), "me")
    owned = open_stream(rt, r, SegmentWriter(MemoryStore()), cfg, "cam")
    frame = np.zeros((56, 56, 3), np.uint8)
    owned.add("1-0", FrameMsg.from_rgb(0, 0.0, 0.0, frame))
    owned.add("2-0", FrameMsg.from_rgb(1, 0.5, 0.5, frame))
    assert manifest_from_bytes(r.get(keys.head("cam"))).last_frame_seq == 1
    r.set(keys.lease("cam"), "someone-else")  # our lease expired and another encoder took the stream
    owned.add("3-0", FrameMsg.from_rgb(2, 1.0, 1.0, frame))
    with pytest.raises(LeaseLost):
        owned.add("4-0", FrameMsg.from_rgb(3, 1.5, 1.5, frame))
    assert manifest_from_bytes(r.get(keys.head("cam"))).last_frame_seq == 1, "a fenced-off write landed"


def test_frames_pixels_decoded_in_processes_equal_decoding_in_the_thread_and_a_dead_process_loses_nothing():
    """The encoder's FrameDecoder: every codec's pixels as `frame_from_map` gives them here (and
    lossless: the frame sent), an undecodable image rejected with the thread's error, and a
    decoder process killed between frames replaced without a frame lost."""
    rows, cols = np.mgrid[0:56, 0:84]
    pictures = [np.stack([rows * 4 + s, cols * 3, (rows + cols + 40 * s) % 256], -1).astype(np.uint8) for s in range(3)]
    frames = [FrameMsg.from_rgb(s, s / 2, s / 2, p) for s, p in enumerate(pictures)]  # smooth: they compress
    decoder = FrameDecoder(2)
    try:
        for codec in ("webp", "png"):
            for frame in frames:
                m = unpack_frame(encode_frame(frame, codec=codec))
                assert m["fmt"] == codec
                got = decoder.decode(m)
                assert got == frame_from_map(m) and got.data == frame.data, codec
        with pytest.raises(SchemaError, match="undecodable webp image"):
            decoder.decode(unpack_frame(_undecodable_webp(0, 3.0)))
        pool = decoder._pool
        assert pool is not None and 1 <= len(pool._processes) <= 2
        for pid in list(pool._processes):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)  # the pool has seen them die: it is broken
        with structlog.testing.capture_logs() as said:
            for frame in frames:
                assert decoder.decode(unpack_frame(encode_frame(frame, codec="webp"))).data == frame.data
        assert decoder._pool is not pool
        assert [e["event"] for e in said] == ["a frame decoder process died; its pool is replaced"]
    finally:
        decoder.close()


def _undecodable_webp(seq: int, ts: float) -> dict[str, bytes]:
    """A frames entry whose header is sound and whose pixels are not a WebP image."""
    frame = FrameMsg.from_rgb(seq, ts, ts, np.full((56, 56, 3), 7, np.uint8))
    m = msgpack.unpackb(encode_frame(frame, codec="webp")[FIELD])
    return {FIELD: msgpack.packb(m | {"data": b"RIFF\x00\x00garbage"})}


def test_a_late_live_frame_is_dropped_before_its_pixels_are_decoded(rt, redis_url):
    """Behind real time, most frames a read brings are dropped as late: their pixels are never
    decoded (decoding slows the GPU loop through the GIL). The oracle: pixels that cannot be
    decoded are dead-lettered when the frame is fresh, and only dropped, as late, when it is not."""
    from encoder_worker import service

    r = redis.Redis.from_url(redis_url)
    cam, now = "latecam", time.time()
    r.hset(keys.meta(cam), mapping={"fps": 2, "height": 56, "width": 56, "live": 1})
    fresh = [encode_frame(FrameMsg.from_rgb(s, now + s / 2, s / 2, np.zeros((56, 56, 3), np.uint8))) for s in (2, 3)]
    late_id, fresh_id = (
        r.xadd(keys.frames(cam), f) for f in (_undecodable_webp(0, now - 60), _undecodable_webp(1, now))
    )
    for fields in fresh:
        r.xadd(keys.frames(cam), fields)
    cfg = EncoderConfig(redis_url=redis_url, streams=(cam,), consumer="me", chunk_frames=2, block_ms=50, max_lag_s=30)
    svc = service.EncoderService(cfg, rt, r, MemoryStore())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
        (raw := r.get(keys.head(cam))) and manifest_from_bytes(raw).last_frame_seq == 3
    ):
        svc.step()
    assert manifest_from_bytes(r.get(keys.head(cam))).last_frame_seq == 3, "the fresh frames were encoded"
    dead = [f[b"entry_id"] for _, f in r.xrange(keys.DEAD_LETTER) if f[b"source"] == keys.frames(cam).encode()]
    assert dead == [fresh_id], (dead, late_id)  # the fresh undecodable one only
    events = [f for _, f in r.xrange(keys.events(cam))]
    assert any(f[b"type"] == b"dropped" and f[b"reason"] == b"late" for f in events), events
    assert r.xinfo_groups(keys.frames(cam))[0]["pending"] == 0, "every entry acked"


def test_a_taken_over_streams_backlog_waits_from_the_takeover_and_no_longer(rt, redis_url):
    """A live frame is late once it waited `max_lag_s` for this worker: a backlog left by a dead
    owner counts from the takeover (a failover's gap is not this worker falling behind), but not
    past `max_lag_s` after it, and a frame already over `max_lag_s` old at the takeover is late."""
    r = redis.Redis.from_url(redis_url)
    cam, lag = "takencam", 10.0
    r.hset(keys.meta(cam), mapping={"fps": 2, "height": 56, "width": 56, "live": 1})
    r.set(keys.lease(cam), "me")
    r.xgroup_create(keys.frames(cam), keys.ENCODER_GROUP, id="0", mkstream=True)
    cfg = EncoderConfig(redis_url=redis_url, streams=(cam,), consumer="me", chunk_frames=2, max_lag_s=lag)
    owned = open_stream(rt, r, SegmentWriter(MemoryStore()), cfg, cam)
    now = time.time()

    def late(taken_ago: float, captured_before_taken: float) -> bool:
        owned.taken_at = now - taken_ago
        return owned.skip_late("1-0", owned.taken_at - captured_before_taken)

    assert not late(3, 8), "11 s old, but waited 3 s for this worker"
    assert late(3, 11), "over max_lag_s old when taken"
    assert late(11, 1), "waited over max_lag_s since the takeover"
    assert late(11, -0.5), "captured after the takeover: its own age counts"
    assert not late(11, -2), "captured after the takeover, 9 s old"
    assert owned.dropped["late"] == 3


def test_a_frames_capture_time_is_read_without_its_pixels():
    frame = FrameMsg.from_rgb(4, 12.5, 2.0, np.zeros((56, 56, 3), np.uint8))
    assert capture_time(unpack_frame(encode_frame(frame, codec="webp"))) == 12.5
    undecodable = unpack_frame(_undecodable_webp(0, 3.0))
    assert capture_time(undecodable) == 3.0
    with pytest.raises(SchemaError, match="undecodable"):
        frame_from_map(undecodable)
    assert capture_time(unpack_frame(encode_frame(EndOfStream(4)))) is None
    assert capture_time({"v": 1, "ts": "noon"}) is None
    for bad in ({FIELD: b"\xc1 not msgpack"}, {}):
        with pytest.raises(SchemaError):
            unpack_frame(bad)
    assert frame_from_map(unpack_frame(encode_frame(frame, codec="webp"))).ts == 12.5


def test_a_read_takes_at_most_read_per_stream_entries_of_each_stream(rt, redis_url):
    """XREADGROUP's COUNT bounds each stream, not the reply: a worker far behind (its frames
    streams hold up to 2,000 entries each) must not pull every stream's whole backlog at once."""
    from encoder_worker import service

    r = redis.Redis.from_url(redis_url)
    cams = ["deep0", "deep1"]
    for cam in cams:
        r.hset(keys.meta(cam), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    cfg = EncoderConfig(redis_url=redis_url, streams=tuple(cams), consumer="me", chunk_frames=2, block_ms=50)
    svc = service.EncoderService(cfg, rt, r, MemoryStore())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (len(svc.owned) < 2 or set(svc.reader.cursors.values()) != {">"}):
        svc.step()  # takes the streams' leases, opens them and reads their (empty) history
    frame = np.zeros((56, 56, 3), np.uint8)
    for cam in cams:
        for seq in range(3 * service.READ_PER_STREAM):
            r.xadd(keys.frames(cam), encode_frame(FrameMsg.from_rgb(seq, seq / 2, seq / 2, frame)))
    got = svc.reader.read()
    per_stream = {s: sum(1 for e in got if e[0] == s) for s in map(keys.frames, cams)}
    assert per_stream == dict.fromkeys(map(keys.frames, cams), service.READ_PER_STREAM), per_stream


def test_a_stream_waiting_for_the_gpu_holds_back_only_its_own_reads(rt, redis_url, monkeypatch):
    """Streams are not read in rounds: while one stream's chunk waits (behind many GPU steps, say),
    the other streams' new frames are read, encoded and published."""
    from encoder_worker import owned_stream, service

    r = redis.Redis.from_url(redis_url)
    cams = ["held", "flowing"]
    for cam in cams:
        r.hset(keys.meta(cam), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    frame = np.zeros((56, 56, 3), np.uint8)

    def send(cam: str, seqs: range) -> None:
        for seq in seqs:
            r.xadd(keys.frames(cam), encode_frame(FrameMsg.from_rgb(seq, seq / 2, seq / 2, frame)))

    def head_seq(cam: str) -> int | None:
        raw = r.get(keys.head(cam))
        return manifest_from_bytes(raw).last_frame_seq if raw else None

    def wait_for(cam: str, seq: int) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and head_seq(cam) != seq:
            time.sleep(0.01)
        assert head_seq(cam) == seq, f"{cam}: frame {seq} not encoded while the other stream's chunk waited"

    release = threading.Event()
    flush = owned_stream.OwnedStream.flush

    def held_flush(self: owned_stream.OwnedStream):
        if self.name == "held":
            release.wait(30)
        return flush(self)

    monkeypatch.setattr(owned_stream.OwnedStream, "flush", held_flush)
    send("held", range(2))
    send("flowing", range(2))
    cfg = EncoderConfig(redis_url=redis_url, streams=tuple(cams), consumer="me", chunk_frames=2, block_ms=50)
    svc = service.EncoderService(cfg, rt, r, MemoryStore())
    stop = threading.Event()
    runner = threading.Thread(target=svc.run, args=(stop,))
    runner.start()
    try:
        for seq in range(2, 8, 2):  # each chunk sent once the one before it is published
            wait_for("flowing", seq - 1)
            send("flowing", range(seq, seq + 2))
        wait_for("flowing", 7)
        assert head_seq("held") != 1, "the held chunk was published"
        release.set()
        wait_for("held", 1)
    finally:
        release.set()
        stop.set()
        runner.join(30)
    assert not runner.is_alive()


def test_a_killed_workers_frame_decoders_do_not_outlive_it(tmp_path):
    """SIGKILL leaves the pool no chance to stop its processes: they must see it and go."""
    script = tmp_path / "decoding_worker.py"
    script.write_text(
        "import sys, time\n"
        "import numpy as np\n"
        "from common.wire.schemas import FrameMsg, encode_frame, unpack_frame\n"
        "from common.decoding import FrameDecoder\n"
        "if __name__ == '__main__':\n"
        "    rows, cols = np.mgrid[0:56, 0:56]\n"
        "    picture = np.stack([rows, cols, rows + cols], -1).astype(np.uint8)\n"
        "    decoder = FrameDecoder(2)\n"
        "    decoder.decode(unpack_frame(encode_frame(FrameMsg.from_rgb(0, 0.0, 0.0, picture), codec='webp')))\n"
        "    print(*decoder._pool._processes, flush=True)\n"
        "    time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    worker = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        decoders = [int(pid) for pid in worker.stdout.readline().split()]
        assert decoders and all(_alive(pid) for pid in decoders)
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in decoders):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in decoders), "a decoder process outlived its killed worker"


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status  # a zombie has exited; only its parent's wait is missing
