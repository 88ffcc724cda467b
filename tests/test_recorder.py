"""`streamvqa recorder` as a process against a real redis-server: frames from a real frames stream
are in the log exactly once with their bytes, through SIGKILLs, damage, retention and a full disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from apps.samplevideo import render_frame, write_sample_video
from common import redisio
from common.framelog import FrameLog
from common.wire import keys
from common.wire.schemas import FIELD, FrameMsg, encode_frame, unpack_frame
from tests.conftest import free_port
from tests.pipeline import Services, wait_for

CAM = "cam1"
T0 = 1_700_000_000.0  # capture times in the past: a frame stamped ahead of the clock is not logged


@pytest.fixture
def services(redis_url, tmp_path) -> Iterator[Services]:
    s = Services(redis_url, tmp_path, SVQA_BLOCK_MS="100")
    yield s
    s.stop_all()


def start_recorder(services: Services, log_dir: Path, port: int, *args: str) -> subprocess.Popen:
    return services.start(
        "recorder",
        *("--streams", CAM, "--framelog-dir", str(log_dir), "--framelog-sync-s", "0.1"),
        *("--metrics-port", str(port), *args),
    )


def push(r: redis.Redis, seqs: range, size: int = 112) -> None:
    """Frames as ingest publishes them: rendered pictures, WebP lossless, one entry each."""
    for s in seqs:
        rgb = render_frame(s / 2, width=size, height=size)
        r.xadd(keys.frames(CAM), encode_frame(FrameMsg.from_rgb(s, T0 + s / 2, s / 2, rgb), codec="webp"))


def sent(r: redis.Redis) -> dict[int, bytes]:
    """seq -> the payload of every frame entry in the stream."""
    out = {}
    for _, fields in r.xrange(keys.frames(CAM)):
        m = unpack_frame(fields)
        if not m.get("eos"):
            out[m["seq"]] = fields[FIELD.encode()]
    return out


def logged(log_dir: Path) -> list[tuple[int, bytes]]:
    return [(rec.seq, rec.raw) for rec in FrameLog(log_dir).frames(CAM, 0, 10**9)]


def group(r: redis.Redis) -> dict | None:
    """The recorder's consumer group on the frames stream, as XINFO GROUPS gives it."""
    if not r.exists(keys.frames(CAM)):
        return None
    return next((g for g in r.xinfo_groups(keys.frames(CAM)) if g["name"] == keys.RECORDER_GROUP.encode()), None)


def unrecorded(r: redis.Redis) -> int:
    """Entries the recorder's group has not acked (pending, or not yet delivered)."""
    g = group(r)
    return r.xlen(keys.frames(CAM)) if g is None else int(g["lag"] or 0) + int(g["pending"])


def acked(r: redis.Redis) -> set[int]:
    """Seqs of the entries the recorder acked so far."""
    g = group(r)
    if g is None:
        return set()
    pending = {p["message_id"] for p in r.xpending_range(keys.frames(CAM), keys.RECORDER_GROUP, "-", "+", 100_000)}
    last = g["last-delivered-id"]
    return {unpack_frame(f)["seq"] for eid, f in r.xrange(keys.frames(CAM), max=last) if eid not in pending}


def ready(port: int) -> tuple[int, dict]:  # timeouts of 30 s: an answer comes at once, unless the machine is loaded
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return 0, {}


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        return resp.read().decode()


def events(r: redis.Redis) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(keys.events(CAM))]


def test_ingested_frames_are_logged_exactly_once_with_their_bytes(redis_url, services, tmp_path):
    r = redis.Redis.from_url(redis_url)
    log_dir, port = tmp_path / "frames", free_port()
    recorder = start_recorder(services, log_dir, port)
    video = write_sample_video(str(tmp_path / "a.mp4"), seconds=5, fps=10, width=160, height=120)
    ingest = services.start("ingest", "--url", video, "--stream", CAM, "--fps", "2", "--max-backlog", "1000")
    assert ingest.wait(timeout=60) == 0, services.logs()
    want = sent(r)
    assert sorted(want) == list(range(10))
    wait_for(lambda: unrecorded(r) == 0, 30, "every entry acked", services)
    assert logged(log_dir) == sorted(want.items())  # each frame once, in order, its bytes as sent
    times = [unpack_frame({FIELD: want[s]})["ts"] for s in range(10)]
    log = FrameLog(log_dir)
    assert [rec.seq for rec in log.between(CAM, times[3], times[6])] == [3, 4, 5, 6]
    assert [rec.seq for rec in log.frames(CAM, 8, 100)] == [8, 9]
    assert ready(port)[0] == 200 and recorder.poll() is None
    text = scrape(port)
    assert f'svqa_recorder_frames_total{{stream="{CAM}"}} 10.0' in text
    assert f'svqa_recorder_skipped_total{{reason="eos",stream="{CAM}"}} 1.0' in text


def test_sigkill_mid_stream_loses_nothing_acked_and_duplicates_nothing(redis_url, services, tmp_path):
    r = redis.Redis.from_url(redis_url)
    log_dir, port = tmp_path / "frames", free_port()
    done = threading.Event()

    def pusher() -> None:  # a camera at ~20 fps until the kills are over (at most 2,000 frames)
        for s in range(2000):
            push(r, range(s, s + 1))
            if done.wait(0.03):
                return

    t = threading.Thread(target=pusher)
    t.start()
    try:
        for kill in range(3):
            proc = start_recorder(services, log_dir, port)
            before = len(acked(r))
            wait_for(lambda b=before: len(acked(r)) > b + 3, 30, f"acks before kill {kill}", services)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            have = {seq for seq, _ in logged(log_dir)}
            assert acked(r) <= have, f"kill {kill}: acked but not in the log: {sorted(acked(r) - have)}"
    finally:
        done.set()
        t.join()
    start_recorder(services, log_dir, port)
    wait_for(lambda: unrecorded(r) == 0, 60, "all acked", services)
    assert logged(log_dir) == sorted(sent(r).items())


def test_frames_committed_but_not_acked_before_a_crash_are_acked_without_a_second_write(redis_url, services, tmp_path):
    r = redis.Redis.from_url(redis_url)
    log_dir, port = tmp_path / "frames", free_port()
    push(r, range(10))
    r.xgroup_create(keys.frames(CAM), keys.RECORDER_GROUP, id="0")
    delivered = r.xreadgroup(keys.RECORDER_GROUP, "recorder", {keys.frames(CAM): ">"}, count=6)[0][1]
    w = FrameLog(log_dir).writer(CAM, 600)  # what a recorder killed between its commit and its ack left
    for _, fields in delivered:
        m = unpack_frame(fields)
        w.append(m["seq"], m["ts"], fields[FIELD.encode()])
    w.commit()
    w.close()
    start_recorder(services, log_dir, port)
    wait_for(lambda: unrecorded(r) == 0, 30, "every entry acked", services)
    assert logged(log_dir) == sorted(sent(r).items())
    assert f'svqa_recorder_skipped_total{{reason="duplicate",stream="{CAM}"}} 6.0' in scrape(port)


def test_a_torn_tail_is_cut_off_and_the_recorder_goes_on(redis_url, services, tmp_path):
    r = redis.Redis.from_url(redis_url)
    log_dir, port = tmp_path / "frames", free_port()
    push(r, range(5))
    proc = start_recorder(services, log_dir, port)
    wait_for(lambda: unrecorded(r) == 0, 30, "first frames acked", services)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, services.logs()  # at once, unless the machine is loaded
    (data,) = (log_dir / CAM).glob("*.log")
    os.truncate(data, data.stat().st_size - 9)  # frame 4 torn, as a crash mid-write leaves it
    with open(data, "r+b") as f:  # and a flipped bit in frame 1
        rec = next(x for x in FrameLog(log_dir).frames(CAM, 1, 1))
        f.seek(data.read_bytes().index(rec.raw) + 20)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    push(r, range(5, 10))
    start_recorder(services, log_dir, port)
    wait_for(lambda: unrecorded(r) == 0, 30, "later frames acked", services)
    want = sent(r)
    assert logged(log_dir) == [(s, want[s]) for s in (0, 2, 3, *range(5, 10))]
    assert "frames log tail torn; cut off" in services.logs()
    assert ready(port)[0] == 200


def test_retention_collects_the_oldest_files_first_with_an_event(redis_url, services, tmp_path):
    r = redis.Redis.from_url(redis_url)
    log_dir, port = tmp_path / "frames", free_port()
    limit = 15_000  # about 2 files of 4 frames (~1.5 KB each)
    args = ("--framelog-roll-s", "0.2", "--retention-gb", str(limit / 1e9), "--collect-every-s", "0.2")
    start_recorder(services, log_dir, port, *args)
    for s in range(0, 40, 4):  # 4 frames at a time, each group in a file of its own
        push(r, range(s, s + 4))
        wait_for(lambda: unrecorded(r) == 0, 30, "acked", services)
        time.sleep(0.25)  # pacing, not a check: the next group starts a new file
    wait_for(lambda: any(e["type"] == "frames_log_collected" for e in events(r)), 30, "a collection event", services)
    event = next(e for e in events(r) if e["type"] == "frames_log_collected")
    assert event["reason"] == "space" and event["source"] == "recorder" and int(event["bytes"]) > 0
    assert float(event["from"]) == T0  # the oldest frame went first
    span = FrameLog(log_dir).span(CAM)
    assert span.first_seq > 0 and span.last_seq == 39
    assert [s for s, _ in logged(log_dir)] == list(range(span.first_seq, 40))  # a suffix: oldest gone first
    wait_for(lambda: 'reason="space"' in scrape(port), 10, "the collected-bytes metric", services)


def test_a_full_disk_stops_acks_fails_readiness_and_resumes_once_space_is_freed(redis_url, services, small_disk):
    r = redis.Redis.from_url(redis_url)
    log_dir, port = small_disk / "frames", free_port()
    filler = small_disk / "filler"
    filler.write_bytes(os.urandom(1_950_000))  # of 2 MiB: ~150 KB left
    start_recorder(services, log_dir, port)
    push(r, range(40), size=224)  # ~10 KB each: more than the disk has left
    _, body = wait_for(lambda: (s := ready(port))[0] == 503 and s, 30, "readiness failing", services)
    assert body["checks"]["frames_log"] is False and "ENOSPC" in body["reasons"]["frames_log"], body
    assert unrecorded(r) > 0  # what did not fit is not acked
    assert acked(r) <= {s for s, _ in logged(log_dir)}
    assert any(e["type"] == "frames_log_failing" and "ENOSPC" in e["reason"] for e in events(r))
    assert "svqa_recorder_write_failing 1.0" in scrape(port)
    filler.unlink()
    wait_for(lambda: ready(port)[0] == 200, 60, "readiness back", services)
    wait_for(lambda: unrecorded(r) == 0, 30, "every entry acked", services)
    assert logged(log_dir) == sorted(sent(r).items())
    assert any(e["type"] == "frames_log_resumed" for e in events(r))
    assert "svqa_recorder_write_failing 0.0" in scrape(port)


def test_a_second_recorder_on_the_same_log_exits_2_with_one_line(redis_url, services, tmp_path):
    log_dir, port = tmp_path / "frames", free_port()
    start_recorder(services, log_dir, port)
    wait_for(lambda: ready(port)[0] == 200, 30, "the first recorder ready", services)
    second = start_recorder(services, log_dir, free_port())
    assert second.wait(timeout=30) == 2
    assert "frames log in use by another recorder" in services.logs()
    assert services.start("recorder", "--framelog-dir", str(log_dir)).wait(timeout=30) == 2  # no streams


def test_frames_held_for_a_commit_are_bounded_while_catching_up(redis_url, tmp_path, monkeypatch):
    """A backlog (after an outage) is taken at the pace of commits: what waits for the next one in
    memory stays under the bound plus one read, however much Redis holds."""
    from recorder import service
    from recorder.config import RecorderConfig

    r = redis.Redis.from_url(redis_url)
    push(r, range(40))
    one = max(map(len, sent(r).values())) + 68  # the largest frame, with its header and index entry
    monkeypatch.setattr(service, "MAX_UNCOMMITTED_BYTES", 3 * one)
    cfg = RecorderConfig(streams=(CAM,), framelog_dir=str(tmp_path), framelog_sync_s=0.3, read_count=4, block_ms=100)
    rec = service.Recorder(cfg, redisio.connect(redis_url, block_ms=100))
    rec.open_writers()
    held = []
    while unrecorded(r):
        rec.step()
        held.append(rec.writers[CAM].pending_bytes)
    assert max(held) <= 3 * one + 4 * one  # the bound, then at most one read of 4 frames
    assert logged(tmp_path) == sorted(sent(r).items())


def test_a_frame_whose_epoch_the_log_cannot_hold_is_a_bad_frame_not_a_stopped_recorder(redis_url, tmp_path):
    """The log keeps a frame's epoch in 32 bits: one forged with 2**32 (the wire took any int64)
    raised out of the recorder's step, and its entry, never acked, stopped it again at every
    restart, every camera's log with it. It is a bad frame now, refused by the schema everywhere."""
    import msgpack

    from recorder import service
    from recorder.config import RecorderConfig

    r = redis.Redis.from_url(redis_url)
    forged = encode_frame(FrameMsg.from_rgb(0, T0, 0.0, render_frame(0.0, width=16, height=16)))
    forged[FIELD] = msgpack.packb(msgpack.unpackb(forged[FIELD]) | {"epoch": 2**32})
    r.xadd(keys.frames(CAM), forged)
    push(r, range(1, 2))
    cfg = RecorderConfig(streams=(CAM,), framelog_dir=str(tmp_path), framelog_sync_s=0.05, block_ms=50)
    rec = service.Recorder(cfg, redisio.connect(redis_url, block_ms=50))
    rec.open_writers()
    for _ in range(5):
        rec.step()
    assert [seq for seq, _ in logged(tmp_path)] == [1]


def test_the_log_of_a_camera_no_longer_recorded_is_collected_too(redis_url, tmp_path):
    """A camera removed from the cameras file (or renamed) kept its frames on disk for good:
    retention ran only over the cameras recorded now. Its files past retention_hours go too, the
    newest included (nobody writes it), and no event lists it again on /api/streams."""
    from recorder import service
    from recorder.config import RecorderConfig

    gone = FrameLog(tmp_path).writer("gone", roll_s=600)
    for s in range(3):
        gone.append(
            s, T0 + s, encode_frame(FrameMsg.from_rgb(s, T0 + s, s, render_frame(s, width=16, height=16)))[FIELD]
        )
    gone.commit()
    gone.close()
    old = time.time() - 48 * 3600
    for p in (tmp_path / "gone").iterdir():
        os.utime(p, (old, old))
    (tmp_path / "lost+found").mkdir()  # a file system's own directory: not a camera
    r = redis.Redis.from_url(redis_url)
    cfg = RecorderConfig(streams=(CAM,), framelog_dir=str(tmp_path), retention_hours=24, block_ms=50)
    rec = service.Recorder(cfg, redisio.connect(redis_url, block_ms=50))
    rec.open_writers()
    rec.step()
    assert not list((tmp_path / "gone").glob("*.log")) and FrameLog(tmp_path).span("gone") is None
    assert not r.exists(keys.events("gone"))


def test_a_newest_file_that_cannot_be_opened_is_left_with_an_event_and_recording_goes_on(redis_url, tmp_path):
    """The camera's newest data file unopenable at start (EIO; here a link to a directory): every
    write failed and was retried for good, the camera "failing" until someone removed the file.
    The recorder leaves it, says so in an event, and logs the frames into a new file."""
    from recorder import service
    from recorder.config import RecorderConfig

    r = redis.Redis.from_url(redis_url)
    w = FrameLog(tmp_path).writer(CAM, roll_s=600)
    for s in range(3):
        w.append(s, T0 + s / 2, b"x")
    w.commit()
    w.close()
    (bad,) = (tmp_path / CAM).glob("*.log")
    bad.unlink()
    (tmp_path / "elsewhere").mkdir()
    bad.symlink_to(tmp_path / "elsewhere")
    push(r, range(3, 8))
    cfg = RecorderConfig(streams=(CAM,), framelog_dir=str(tmp_path), framelog_sync_s=0.05, block_ms=50)
    rec = service.Recorder(cfg, redisio.connect(redis_url, block_ms=50))
    rec.open_writers()
    for _ in range(10):
        rec.step()
        if not unrecorded(r):
            break
    assert not rec.failing and unrecorded(r) == 0
    assert logged(tmp_path) == sorted(sent(r).items())
    (left,) = [e for e in events(r) if e["type"] == "frames_log_file_left"]
    assert left["file"] == bad.name and "IsADirectoryError" in left["reason"]
    assert not any(e["type"] == "frames_log_failing" for e in events(r))


def test_a_frame_stamped_ahead_of_the_clock_does_not_silence_the_cameras_log(redis_url, tmp_path):
    """A forged frame numbered and stamped far ahead (a year) was logged as the camera's newest, and
    every real frame after it, no later in seq and stamp, was taken for one already logged: the log
    of a live camera stopped for good (a restarted writer picks up the same last seq and stamp).
    It is not logged now, and the real frames around it are."""
    from recorder import service
    from recorder.config import RecorderConfig

    r = redis.Redis.from_url(redis_url)
    now, px = time.time(), render_frame(0.0, width=16, height=16)
    for seq, ts in [(0, now), (10**12, now + 365 * 86_400), (1, now + 0.5), (2, now + 1)]:
        r.xadd(keys.frames(CAM), encode_frame(FrameMsg.from_rgb(seq, ts, ts - now, px)))
    cfg = RecorderConfig(streams=(CAM,), framelog_dir=str(tmp_path), framelog_sync_s=0.05, block_ms=50)
    rec = service.Recorder(cfg, redisio.connect(redis_url, block_ms=50))
    rec.open_writers()
    while unrecorded(r):
        rec.step()
    rec.commit()
    assert [seq for seq, _ in logged(tmp_path)] == [0, 1, 2]
