"""The frames log on a real file system: exact bytes back by seq and time, damage skipped, retention,
and a full disk (a small tmpfs) rolled back without a torn record."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest
import structlog

from apps.samplevideo import render_frame
from common import framelog
from common.framelog import INDEX_SUFFIX, FrameLog, LogFull, LogLocked
from common.wire.schemas import FIELD, FrameMsg, encode_frame

CAM = "cam1"
T0 = 1_800_000_000.0  # capture times: unix seconds, like a live camera's


def frame_payload(seq: int, size: int = 56) -> tuple[FrameMsg, bytes]:
    """A rendered frame (moving shapes and a clock) packed the way ingest sends it (WebP lossless)."""
    msg = FrameMsg.from_rgb(seq, T0 + seq / 2, seq / 2, render_frame(seq / 2, width=size, height=size))
    return msg, encode_frame(msg, codec="webp")[FIELD]


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock(T0)
    monkeypatch.setattr(framelog.time, "time", c)
    return c


def write(log: FrameLog, seqs: range, roll_s: float = 600.0) -> dict[int, bytes]:
    w = log.writer(CAM, roll_s)
    sent = {}
    for s in seqs:
        _, raw = frame_payload(s)
        assert w.append(s, T0 + s / 2, raw)
        sent[s] = raw
    w.commit()
    w.close()
    return sent


def test_frames_come_back_exactly_by_seq_and_by_time(tmp_path):
    log = FrameLog(tmp_path)
    sent = write(log, range(20))
    assert [(r.seq, r.raw) for r in log.frames(CAM, 5, 9)] == [(s, sent[s]) for s in range(5, 10)]
    got = list(log.between(CAM, T0 + 2.0, T0 + 3.5))  # seqs 4..7 (two frames a second)
    assert [r.seq for r in got] == [4, 5, 6, 7] and [r.ts for r in got] == [T0 + s / 2 for s in range(4, 8)]
    original, _ = frame_payload(7)
    assert framelog.decode(got[-1].raw).data == original.data  # lossless: the pixels the encoder saw
    span = log.span(CAM)
    assert (span.first_seq, span.last_seq, span.frames, span.files) == (0, 19, 20, 1)
    assert (span.first_ts, span.last_ts) == (T0, T0 + 9.5)
    assert span.bytes == log.size(CAM) > sum(map(len, sent.values()))
    assert log.cameras() == [CAM] and log.span("other") is None and not list(log.frames("other", 0, 9))


def test_a_frame_delivered_again_is_not_logged_twice(tmp_path):
    log = FrameLog(tmp_path)
    write(log, range(10))
    w = log.writer(CAM, 600)  # a new writer (a restarted recorder) knows the log's last frame
    assert w.last_seq == 9
    assert not any(w.append(s, T0 + s / 2, frame_payload(s)[1]) for s in range(5, 10))
    assert w.append(10, T0 + 5.0, frame_payload(10)[1]) and w.commit() > 0
    w.close()
    assert [r.seq for r in log.frames(CAM, 0, 100)] == list(range(11))


def test_files_roll_by_time_and_reads_cross_them(tmp_path, clock):
    log = FrameLog(tmp_path)
    w = log.writer(CAM, roll_s=60)
    for s in range(12):
        w.append(s, T0 + s / 2, frame_payload(s)[1])
        if s % 4 == 3:  # a commit every 4 frames, 30 s apart: a new file every 2 commits
            w.commit()
            clock.t += 30
    w.close()
    files = sorted(p.name for p in (tmp_path / CAM).glob("*.log"))
    assert len(files) == 2 and files[0] == f"{int(T0 * 1000):013d}.log"
    assert [r.seq for r in log.frames(CAM, 6, 9)] == [6, 7, 8, 9]
    assert log.span(CAM).files == 2


def newest_data(tmp_path: Path) -> Path:
    return sorted((tmp_path / CAM).glob("*.log"))[-1]


def test_a_torn_tail_is_skipped_with_a_warning_and_cut_off_by_the_next_writer(tmp_path):
    log = FrameLog(tmp_path)
    sent = write(log, range(10))
    data = newest_data(tmp_path)
    os.truncate(data, data.stat().st_size - 7)  # a crash in the middle of the last record
    with structlog.testing.capture_logs() as said:
        assert [r.seq for r in FrameLog(tmp_path).frames(CAM, 0, 100)] == list(range(9))
        w = log.writer(CAM, 600)
    assert any(e["event"] == "frames log tail torn; cut off" for e in said), said
    assert w.last_seq == 8  # seq 9 was never whole: it is written again
    assert w.append(9, T0 + 4.5, sent[9]) and w.commit()
    w.close()
    assert [(r.seq, r.raw) for r in FrameLog(tmp_path).frames(CAM, 0, 100)] == sorted(sent.items())


def test_a_flipped_bit_loses_only_its_record(tmp_path):
    sent = write(FrameLog(tmp_path), range(10))
    data = newest_data(tmp_path)
    entries, _ = framelog._read_index(data, data.stat().st_size)
    with open(data, "r+b") as f:  # a bit flip inside frame 4's pixels
        f.seek(entries[4].offset + 40)
        byte = f.read(1)
        f.seek(entries[4].offset + 40)
        f.write(bytes([byte[0] ^ 0x10]))
    with structlog.testing.capture_logs() as said:
        got = [(r.seq, r.raw) for r in FrameLog(tmp_path).frames(CAM, 0, 100)]
    assert got == [(s, sent[s]) for s in range(10) if s != 4]
    assert any(e["event"] == "frames log record damaged; skipped" and e["seq"] == 4 for e in said), said


def test_a_damaged_index_or_an_unindexed_tail_is_read_from_the_data(tmp_path):
    sent = write(FrameLog(tmp_path), range(10))
    data = newest_data(tmp_path)
    index = data.with_suffix(INDEX_SUFFIX)
    raw = bytearray(index.read_bytes())
    raw[3 * (framelog._ENTRY_SIZE) + 2] ^= 0xFF  # entry 3 fails its crc: records 3.. are found by scanning
    index.write_bytes(bytes(raw[: 7 * framelog._ENTRY_SIZE]))  # and the index lost its last 3 entries
    assert [(r.seq, r.raw) for r in FrameLog(tmp_path).frames(CAM, 0, 100)] == sorted(sent.items())
    w = FrameLog(tmp_path).writer(CAM, 600)  # the writer completes the index
    w.close()
    entries, damaged = framelog._read_index(data, data.stat().st_size)
    assert [e.seq for e in entries] == list(range(10)) and damaged == 0


def test_one_writer_per_camera(tmp_path):
    log = FrameLog(tmp_path)
    w = log.writer(CAM, 600)
    with pytest.raises(LogLocked):
        log.writer(CAM, 600)
    w.close()
    log.writer(CAM, 600).close()


def _files_a_minute_apart(log: FrameLog, root: Path, clock, n: int) -> list[Path]:
    """`n` data files of 5 frames each (seqs 0..5n-1), each written 60 s after the last."""
    w = log.writer(CAM, roll_s=60)
    for f in range(n):
        for s in range(f * 5, f * 5 + 5):
            w.append(s, T0 + s, frame_payload(s)[1])
        w.commit()
        clock.t += 60
    w.close()
    return sorted((root / CAM).glob("*.log"))


def test_collect_removes_whole_files_oldest_first_by_age_then_by_bytes(tmp_path, clock):
    log = FrameLog(tmp_path)
    files = _files_a_minute_apart(log, tmp_path, clock, 4)
    for i, p in enumerate(files):  # last written 4, 3, 2, 1 hours ago
        t = T0 - (4 - i) * 3600
        os.utime(p, (t, t))
    each = framelog._file_bytes(files[0])
    assert log.collect(CAM, keep_hours=10, keep_bytes=None, now=T0) == []
    removed = log.collect(CAM, keep_hours=3.5, keep_bytes=None, now=T0)
    assert [(r.name, r.reason, r.frames, r.first_ts) for r in removed] == [(files[0].name, "age", 5, T0)]
    removed = log.collect(CAM, keep_hours=None, keep_bytes=int(each * 1.5), now=T0)
    assert [(r.name, r.reason) for r in removed] == [(files[1].name, "space"), (files[2].name, "space")]
    assert log.collect(CAM, keep_hours=0, keep_bytes=0, now=T0) == []  # the newest file stays
    assert [r.seq for r in log.frames(CAM, 0, 100)] == list(range(15, 20))
    assert not [p for p in (tmp_path / CAM).glob("*.idx") if not p.with_suffix(".log").exists()]


def test_a_full_disk_rolls_back_to_the_last_commit_and_resumes_once_space_is_freed(small_disk):
    log = FrameLog(small_disk)
    filler = small_disk / "filler"
    filler.write_bytes(np.random.default_rng(0).bytes(1_500_000))
    w = log.writer(CAM, 600)
    committed, s = [], 0
    with pytest.raises(LogFull) as full:
        while True:
            _, raw = frame_payload(s, size=112)
            w.append(s, T0 + s / 2, raw)
            if s % 3 == 2:
                w.commit()
                committed = list(range(s + 1))
            s += 1
    assert "ENOSPC" in full.value.reason
    assert w.last_seq == committed[-1] and w.pending == 0
    assert [r.seq for r in log.frames(CAM, 0, 10**6)] == committed  # nothing torn, nothing half-written
    filler.unlink()
    for t in range(committed[-1] + 1, s + 1):
        assert w.append(t, T0 + t / 2, frame_payload(t, size=112)[1])
    assert w.commit() > 0
    w.close()
    assert [r.seq for r in FrameLog(small_disk).frames(CAM, 0, 10**6)] == list(range(s + 1))


def test_a_file_named_by_a_clock_that_was_ahead_still_rolls_and_is_collected(tmp_path, monkeypatch):
    """A host that started with its clock a day ahead (before NTP) names a file for then; once the
    clock is set right the file still rolls every roll_s (it rolled only once the clock reached its
    name: one file growing for a day, the newest, which retention never deletes)."""
    clock = Clock(T0 + 86400)
    monkeypatch.setattr(framelog.time, "time", clock)
    log = FrameLog(tmp_path)
    w = log.writer(CAM, roll_s=60)
    w.append(0, T0, frame_payload(0)[1])
    w.commit()
    clock.t = T0  # set right
    for seq in range(1, 21):  # ten minutes, a frame and a commit every 30 s
        w.append(seq, T0 + seq, frame_payload(seq)[1])
        w.commit()
        clock.t += 30
    w.close()
    assert len(list((tmp_path / CAM).glob("*.log"))) >= 9
    assert log.collect(CAM, keep_hours=None, keep_bytes=1, now=clock.t), "retention_gb deletes the older ones"


def test_a_file_that_cannot_be_read_is_skipped_by_readers_and_still_collected(tmp_path, clock):
    """A data file whose open fails (EIO on a bad sector; here a link to a directory, which open
    refuses with an OSError as it would EIO): every read of the camera raised, the spans it does
    not touch included (a clip's 503), and retention stopped at it for good, the disk filling."""
    files = _files_a_minute_apart(FrameLog(tmp_path), tmp_path, clock, 3)
    files[0].unlink()
    (tmp_path / "elsewhere").mkdir()
    files[0].symlink_to(tmp_path / "elsewhere")
    log = FrameLog(tmp_path)
    assert [r.seq for r in log.between(CAM, T0, T0 + 100)] == list(range(5, 15))
    assert [s for s, _ in log.stamps(CAM, T0, T0 + 100)] == list(range(5, 15))
    span = log.span(CAM)
    assert span is not None and (span.first_seq, span.last_seq, span.files) == (5, 14, 3)
    old = T0 - 48 * 3600
    for p in files[1:]:
        os.utime(p, (old, old))
    removed = log.collect(CAM, keep_hours=24, keep_bytes=None, now=T0 + 600)
    assert [(r.name, r.frames) for r in removed] == [(files[0].name, 0), (files[1].name, 5)]
    assert sorted((tmp_path / CAM).glob("*.log")) == files[2:]


def test_a_newest_file_that_cannot_be_opened_is_left_for_a_new_one(tmp_path, clock):
    """The newest data file unopenable (EIO; here a link to a directory, which open refuses with
    an OSError as it would EIO): every writer of the camera failed at start, retried for good, the
    camera recording nothing. It is left now, said once, and the next frame starts a new file."""
    files = _files_a_minute_apart(FrameLog(tmp_path), tmp_path, clock, 2)
    files[-1].unlink()
    (tmp_path / "elsewhere").mkdir()
    files[-1].symlink_to(tmp_path / "elsewhere")
    log = FrameLog(tmp_path)
    w = log.writer(CAM, roll_s=60)
    (left,) = w.take_left()
    assert left[0] == files[-1] and "IsADirectoryError" in left[1] and w.last_seq == 4
    for s in range(10, 15):
        assert w.append(s, T0 + s, frame_payload(s)[1])
    assert w.commit() > 0 and w.take_left() == []
    w.close()
    assert [r.seq for r in log.frames(CAM, 0, 100)] == [*range(5), *range(10, 15)]
    now = sorted((tmp_path / CAM).glob("*.log"))
    assert now[:2] == files and len(now) == 3
    w = log.writer(CAM, roll_s=60)
    assert w.take_left() == [] and w.last_seq == 14, "the new file is resumed next time"
    w.close()


def test_a_writer_that_cannot_start_lets_go_of_the_camera(small_disk):
    """A writer whose start failed (its newest file's index rewritten on a full disk) kept the
    camera's lock: every later writer was refused as another process's (LogLocked) for good, also
    once space was freed."""
    log = FrameLog(small_disk)
    write(log, range(10))
    newest_data(small_disk).with_suffix(INDEX_SUFFIX).unlink()  # found by scanning, written again at start
    fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)
    with contextlib.suppress(OSError):  # ENOSPC: the disk is full
        while True:
            os.write(fd, b"\0" * 4096)
    os.close(fd)
    with pytest.raises(LogFull):
        log.writer(CAM, 600)
    (small_disk / "filler").unlink()
    w = log.writer(CAM, 600)
    assert w.last_seq == 9
    w.close()


def test_a_camera_no_longer_recorded_loses_its_newest_file_too_unless_a_writer_holds_it(tmp_path):
    log = FrameLog(tmp_path)
    write(log, range(3))
    (data,) = (tmp_path / CAM).glob("*.log")
    old = T0 - 48 * 3600
    os.utime(data, (old, old))
    w = log.writer(CAM, 600)  # another recorder writes it: its file stays
    assert log.collect(CAM, keep_hours=24, keep_bytes=None, now=T0, unwritten=True) == []
    w.close()
    removed = log.collect(CAM, keep_hours=24, keep_bytes=None, now=T0, unwritten=True)
    assert [(r.name, r.frames, r.reason) for r in removed] == [(data.name, 3, "age")]
    assert log.span(CAM) is None
    log.writer(CAM, 600).close()  # a writer starts it anew
