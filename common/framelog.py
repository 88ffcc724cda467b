"""The frames log: every camera's frames on disk, exactly as they travelled on the wire.

Written by `streamvqa recorder`; read to rebuild a lost stream (re-encode its kept frames) and to
answer about the past (spans, clips, search). A record's bytes are the frames entry's packed
payload (the ``m`` field: msgpack with the pixels as ingest encoded them, WebP-lossless by
default), so a frame read back decodes bit-identically to what the encoder saw (``decode``).

Layout, per camera: ``root/<cam>/<start_ms>.log`` data files, rolled every ``roll_s`` of wall
time (the name is the file's start, in unix milliseconds, strictly increasing), each with an
index beside it, ``<start_ms>.idx``. A data record is a 32-byte header (magic, payload length,
crc32, seq, ts, epoch) and the payload; the crc covers the header's fields and the payload, and
the magic lets a reader find the next record after a damaged one. An index entry (seq, ts,
offset, length, epoch, its own crc32) points at each record, so reads by seq or time range touch
only the files and records they need; a data tail the index does not cover (a crash between the
two writes) is found by scanning the data.

Durability: a writer buffers records and writes them with `commit`, which fdatasyncs the data
and the index (group commit: the recorder calls it at most every ``framelog_sync_s``, never per
frame). What `commit` returned for is on disk; on a failure everything since the last commit is
rolled back (truncated) and `FrameLogError` (`LogFull` for ENOSPC/EDQUOT) says "not written,
retry later". A torn or corrupt record (crash mid-write, bit flip) fails its crc: readers skip it
with a warning, and a writer cuts a torn tail off the newest file when it opens. A file that
cannot be read (EIO) is skipped by readers with a warning, and collected like any other.

Retention: `collect` deletes whole files, oldest first, by age (the data file's last write) and
by bytes per camera; the newest file (the one being written) is never deleted.

No torch here; safe to import from any service.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import NamedTuple

import structlog

from common.files import fsync_dir, write_all
from common.wire.schemas import FIELD, FrameMsg, SchemaError, check_stream_name, decode_frame

log = structlog.get_logger(__name__)

MAGIC = b"SVFR"
_HEAD = struct.Struct("<4sIIqdI")  # magic, payload length, crc32, seq, ts, epoch
_CHECKED = struct.Struct("<IqdI")  # the header fields the crc covers: length, seq, ts, epoch
_ENTRY = struct.Struct("<qdQII")  # index entry: seq, ts, offset, length, epoch
_ENTRY_SIZE = _ENTRY.size + 4  # + crc32 of the entry
DATA_SUFFIX, INDEX_SUFFIX = ".log", ".idx"
LOCK_NAME = ".lock"
MAX_RECORD = 256 << 20  # no frame payload comes near this: a larger length is a damaged header
_RESYNC_CHUNK = 1 << 20
_CACHED_FILES = 256  # file indexes kept in memory by a reader (~1,200 entries each at 2 fps)
# Errors of the disk or the process, not of one file: a file that fails with one is no reason to
# leave it for a new one (which fails the same way).
_NOT_THE_FILE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EMFILE, errno.ENFILE, errno.ENOMEM})


class FrameLogError(Exception):
    """Records since the last commit are not on disk (rolled back): nothing is acked, retry later."""

    def __init__(self, cam: str, reason: str) -> None:
        super().__init__(f"frames log of {cam}: {reason}")
        self.cam, self.reason = cam, reason


class LogFull(FrameLogError):
    """No space left (ENOSPC, EDQUOT): an outage, not bad data."""


class LogLocked(FrameLogError):
    """Another process writes this camera's log."""


class Record(NamedTuple):
    seq: int
    ts: float
    raw: bytes  # the frames entry's payload, as on the wire: `decode(raw)` gives the frame


class _Entry(NamedTuple):
    seq: int
    ts: float
    offset: int
    length: int
    epoch: int

    @property
    def end(self) -> int:
        return self.offset + _HEAD.size + self.length


@dataclass(frozen=True)
class Span:
    """What a camera's log holds: seq and capture-time bounds, frames and bytes on disk."""

    first_seq: int
    last_seq: int
    first_ts: float
    last_ts: float
    frames: int
    bytes: int
    files: int


@dataclass(frozen=True)
class Removed:
    """One data file (and its index) deleted by `collect`."""

    name: str
    bytes: int
    frames: int
    first_ts: float | None
    last_ts: float | None
    reason: str  # "age" (older than keep_hours) or "space" (the camera's log over keep_bytes)


def decode(raw: bytes) -> FrameMsg:
    """A record's payload as the frame the encoder saw (pixels decoded); SchemaError if it is none."""
    msg = decode_frame({FIELD: raw})
    if not isinstance(msg, FrameMsg):
        raise ValueError("record holds an end-of-stream marker, not a frame")
    return msg


def _crc(length: int, seq: int, ts: float, epoch: int, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(_CHECKED.pack(length, seq, ts, epoch)))


def _pack_record(seq: int, ts: float, epoch: int, payload: bytes) -> bytes:
    n = len(payload)
    return _HEAD.pack(MAGIC, n, _crc(n, seq, ts, epoch, payload), seq, ts, epoch) + payload


def _pack_entry(e: _Entry) -> bytes:
    body = _ENTRY.pack(*e)
    return body + struct.pack("<I", zlib.crc32(body))


# --------------------------------------------------------------------------- reading one file


@dataclass(frozen=True)
class _FileIndex:
    entries: tuple[_Entry, ...]
    size: int  # data bytes when read
    valid_end: int  # end of the last whole, valid record
    index_entries: int  # leading entries the index file held valid (the rest were found by scanning)
    damaged: int  # records or index entries found damaged

    def summary(self) -> tuple[int, int, float, float] | None:
        return self._bounds

    @cached_property
    def _bounds(self) -> tuple[int, int, float, float] | None:
        """Once per file read: every read of a camera asks every file's."""
        if not self.entries:
            return None
        return (
            min(e.seq for e in self.entries),
            max(e.seq for e in self.entries),
            min(e.ts for e in self.entries),
            max(e.ts for e in self.entries),
        )


def _read_index(data: Path, size: int) -> tuple[list[_Entry], int]:
    """The index's valid leading entries (each crc-checked, contiguous, inside the data) and how
    many entries were damaged (0, or 1: reading stops at the first bad one)."""
    try:
        raw = data.with_suffix(INDEX_SUFFIX).read_bytes()
    except FileNotFoundError:
        return [], 0
    out: list[_Entry] = []
    end = 0
    for pos in range(0, len(raw) - _ENTRY_SIZE + 1, _ENTRY_SIZE):
        body = raw[pos : pos + _ENTRY.size]
        (crc,) = struct.unpack_from("<I", raw, pos + _ENTRY.size)
        e = _Entry(*_ENTRY.unpack(body))
        if crc != zlib.crc32(body) or e.offset != end or e.end > size:
            return out, 1
        out.append(e)
        end = e.end
    return out, 0


def _record_at(fd: int, pos: int, size: int) -> _Entry | None:
    """The valid record starting at ``pos``, or None."""
    found = _record_and_payload(fd, pos, size)
    return None if found is None else found[0]


def _record_and_payload(fd: int, pos: int, size: int) -> tuple[_Entry, bytes] | None:
    """The valid record starting at ``pos`` and its payload (read once: checked, then handed on)."""
    head = os.pread(fd, _HEAD.size, pos)
    if len(head) < _HEAD.size:
        return None
    magic, n, crc, seq, ts, epoch = _HEAD.unpack(head)
    if magic != MAGIC or n > MAX_RECORD or pos + _HEAD.size + n > size:
        return None
    payload = os.pread(fd, n, pos + _HEAD.size)
    if len(payload) != n or _crc(n, seq, ts, epoch, payload) != crc:
        return None
    return _Entry(seq, ts, pos, n, epoch), payload


def _next_magic(fd: int, pos: int, size: int) -> int | None:
    """Where the next magic after ``pos`` starts (a candidate record), or None."""
    while pos < size:
        chunk = os.pread(fd, _RESYNC_CHUNK + len(MAGIC) - 1, pos)
        i = chunk.find(MAGIC)
        if i >= 0:
            return pos + i
        pos += _RESYNC_CHUNK
    return None


def _scan(fd: int, pos: int, size: int) -> tuple[list[_Entry], int, int]:
    """Records from ``pos`` to the end of the data: (records, end of the last valid one, damaged
    stretches skipped). A damaged record is stepped over by finding the next valid one."""
    out: list[_Entry] = []
    end, damaged = pos, 0
    while pos < size:
        rec = _record_at(fd, pos, size)
        if rec is not None:
            out.append(rec)
            pos = end = rec.end
            continue
        nxt = _next_magic(fd, pos + 1, size)
        while nxt is not None and _record_at(fd, nxt, size) is None:
            nxt = _next_magic(fd, nxt + 1, size)
        if nxt is None:
            break  # a torn or damaged tail: nothing valid after it
        damaged += 1
        pos = nxt
    return out, end, damaged


def _load(data: Path) -> _FileIndex:
    """One data file's records: its index's valid entries, then a scan of what they do not cover."""
    with open(data, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        entries, damaged = _read_index(data, size)
        start = entries[-1].end if entries else 0
        tail, end, skipped = _scan(fd, start, size) if start < size else ([], start, 0)
    return _FileIndex(tuple(entries + tail), size, end, len(entries), damaged + skipped)


# --------------------------------------------------------------------------- the reader


def _cam_dir(root: Path, cam: str) -> Path:
    check_stream_name("cam", cam)  # a name becomes a directory: nothing that escapes root
    return root / cam


def _is_name(name: str) -> bool:
    try:
        check_stream_name("cam", name)
    except SchemaError:
        return False
    return True


def _data_files(d: Path) -> list[Path]:
    """A camera's data files, oldest first (names are start times, zero-padded)."""
    try:
        names = [n for n in os.listdir(d) if n.endswith(DATA_SUFFIX) and n[: -len(DATA_SUFFIX)].isdigit()]
    except FileNotFoundError:
        return []
    return [d / n for n in sorted(names)]


class FrameLog:
    """Reads (and collects) the frames log under ``root``; any number of readers beside one writer."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._cached = lru_cache(maxsize=_CACHED_FILES)(self._load_logged)

    def cameras(self) -> list[str]:
        """The cameras with files here (a directory not named as a stream, lost+found, is none)."""
        try:
            return sorted(p.name for p in self.root.iterdir() if _is_name(p.name) and p.is_dir() and _data_files(p))
        except FileNotFoundError:
            return []

    def frames(self, cam: str, first_seq: int, last_seq: int) -> Iterator[Record]:
        """Records with first_seq <= seq <= last_seq, in log order (seqs increase unless a stream's
        numbering started over)."""
        return self._select(
            cam, lambda s: s[0] <= last_seq and s[1] >= first_seq, lambda e: first_seq <= e.seq <= last_seq
        )

    def between(self, cam: str, t0: float, t1: float) -> Iterator[Record]:
        """Records captured at t0 <= ts <= t1 (the frame's `ts`: unix seconds for live sources)."""
        return self._select(cam, *_captured(t0, t1))

    def stamps(self, cam: str, t0: float, t1: float) -> list[tuple[int, float]]:
        """(seq, ts) of the records `between` would give, from the indexes alone: a question about
        an hour chooses its frames before it reads any."""
        return [(e.seq, e.ts) for _, entries, _ in self._entries(cam, _captured(t0, t1)) for e in entries]

    def stamps_at(
        self, cam: str, t0: float, t1: float, at: Callable[[int], Sequence[int]]
    ) -> dict[int, tuple[int, float]]:
        """(seq, ts) of the records `stamps` would give, at the positions among them `at(n)` names
        (n: how many there are; positions ascending), by position: a question about a week chooses
        a few of its million frames without a list of them all. A file collected meanwhile leaves
        its positions out."""
        counted = [(data, newest, n) for data, newest, idx in self._files(cam, t0, t1) if (n := _count(idx, t0, t1))]
        positions = at(sum(n for _, _, n in counted))
        found: dict[int, tuple[int, float]] = {}
        first, i = 0, 0  # the first position in this file; the next position wanted
        for data, newest, n in counted:
            mine = []
            while i < len(positions) and positions[i] < first + n:
                mine.append(positions[i] - first)
                i += 1
            idx = self._index_of(data, newest) if mine else None
            if idx is not None:
                entries = _within(idx, t0, t1)
                found |= {first + k: (entries[k].seq, entries[k].ts) for k in mine if k < len(entries)}
            first += n
        return found

    def span(self, cam: str) -> Span | None:
        """The log's bounds and size for ``cam``; None when it holds no frame."""
        files = _data_files(_cam_dir(self.root, cam))
        sums = [s for s in (self._summary(p, p == files[-1]) for p in files) if s is not None]
        if not sums:
            return None
        return Span(
            first_seq=min(s[0] for s in sums),
            last_seq=max(s[1] for s in sums),
            first_ts=min(s[2] for s in sums),
            last_ts=max(s[3] for s in sums),
            frames=sum(s[4] for s in sums),
            bytes=self.size(cam),
            files=len(files),
        )

    def size(self, cam: str) -> int:
        """Bytes of the camera's log on disk (data and index files)."""
        return sum(_file_bytes(data) for data in _data_files(_cam_dir(self.root, cam)))

    def collect(
        self,
        cam: str,
        keep_hours: float | None,
        keep_bytes: int | None,
        now: float | None = None,
        *,
        unwritten: bool = False,
    ) -> list[Removed]:
        """Delete whole files, oldest first: those last written more than ``keep_hours`` ago, then
        more while the camera's log exceeds ``keep_bytes``. The newest file is kept (a writer appends
        to it) unless ``unwritten`` (a camera no longer recorded: removed, renamed) and no writer
        holds the camera's lock."""
        d = _cam_dir(self.root, cam)
        with _lock_if_free(d) if unwritten else contextlib.nullcontext(False) as idle:
            files = _data_files(d)
            return self._collect(d, files, len(files) if idle else len(files) - 1, keep_hours, keep_bytes, now)

    def _collect(
        self,
        d: Path,
        files: list[Path],
        candidates: int,
        keep_hours: float | None,
        keep_bytes: int | None,
        now: float | None,
    ) -> list[Removed]:
        now = time.time() if now is None else now
        sizes = {p: _file_bytes(p) for p in files}
        total = sum(sizes.values())
        removed: list[Removed] = []
        for p in files[:candidates]:
            try:
                old = keep_hours is not None and p.stat().st_mtime < now - keep_hours * 3600
            except FileNotFoundError:
                continue
            reason = "age" if old else "space" if keep_bytes is not None and total > keep_bytes else None
            if reason is None:
                break
            removed.append(self._remove(p, sizes[p], reason))
            total -= sizes[p]
        _remove_orphan_indexes(d)
        return removed

    def _remove(self, data: Path, nbytes: int, reason: str) -> Removed:
        idx = self._index_of(data, newest=False)
        s = idx.summary() if idx is not None else None
        data.unlink(missing_ok=True)  # the data first: an index left alone is removed next time
        data.with_suffix(INDEX_SUFFIX).unlink(missing_ok=True)
        return Removed(
            data.name, nbytes, len(idx.entries) if idx else 0, s[2] if s else None, s[3] if s else None, reason
        )

    def _select(
        self, cam: str, file_wanted: Callable[[tuple], bool], wanted: Callable[[_Entry], bool]
    ) -> Iterator[Record]:
        for data, entries, newest in self._entries(cam, (file_wanted, wanted)):
            yield from self._records(data, entries, newest)

    def _entries(
        self, cam: str, select: tuple[Callable[[tuple], bool], Callable[[_Entry], bool]]
    ) -> Iterator[tuple[Path, list[_Entry], bool]]:
        """Per data file whose summary `select[0]` wants: the index entries `select[1]` wants, and
        whether it is the newest file."""
        file_wanted, wanted = select
        for data, newest, idx in self._indexes(cam):
            s = idx.summary()
            if s is not None and file_wanted((*s, len(idx.entries))):
                yield data, [e for e in idx.entries if wanted(e)], newest

    def _files(self, cam: str, t0: float, t1: float) -> Iterator[tuple[Path, bool, _FileIndex]]:
        """The camera's files holding frames captured within t0..t1 (by their bounds), their
        indexes, and whether each is the newest file; one at a time (the cache keeps some)."""
        for data, newest, idx in self._indexes(cam):
            s = idx.summary()
            if s is not None and s[2] <= t1 and s[3] >= t0:
                yield data, newest, idx

    def _indexes(self, cam: str) -> Iterator[tuple[Path, bool, _FileIndex]]:
        """Each of the camera's data files that has an index, oldest first, with it and whether it
        is the newest file."""
        files = _data_files(_cam_dir(self.root, cam))
        for i, data in enumerate(files):
            newest = i == len(files) - 1
            if (idx := self._index_of(data, newest)) is not None:
                yield data, newest, idx

    def _records(self, data: Path, entries: list[_Entry], newest: bool) -> Iterator[Record]:
        if not entries:
            return
        try:
            f = open(data, "rb")  # noqa: SIM115 (held across yields; closed below)
        except FileNotFoundError:  # collected meanwhile
            return
        except OSError as e:  # unreadable since its index was read: its frames are left out, not the span's
            log.warning("frames log file unreadable; skipped", file=str(data), error=f"{type(e).__name__}: {e}")
            return
        with f:
            fd = f.fileno()
            size = os.fstat(fd).st_size
            for e in entries:
                try:
                    found = _record_and_payload(fd, e.offset, size)
                except OSError as err:  # a bad sector under this record: the others are still read
                    log.warning("frames log record unreadable; skipped", file=str(data), seq=e.seq, error=str(err))
                    continue
                if found is None or found[0] != e:
                    if not (newest and e.end > size):  # the newest file may have been rolled back
                        log.warning("frames log record damaged; skipped", file=str(data), seq=e.seq, offset=e.offset)
                    continue
                yield Record(e.seq, e.ts, found[1])

    def _summary(self, data: Path, newest: bool) -> tuple[int, int, float, float, int] | None:
        idx = self._index_of(data, newest)
        s = idx.summary() if idx is not None else None
        return None if s is None else (*s, len(idx.entries))

    def _index_of(self, data: Path, newest: bool) -> _FileIndex | None:
        """The file's records (cached while its files are unchanged); ``newest``: the file a writer
        may be appending to, whose unfinished tail is no damage."""
        try:
            st, ist = data.stat(), _stat_or_none(data.with_suffix(INDEX_SUFFIX))
        except FileNotFoundError:
            return None
        key = (st.st_size, st.st_mtime_ns, ist.st_size if ist else -1, ist.st_mtime_ns if ist else -1)
        try:
            return self._cached(data, key, newest)
        except FileNotFoundError:
            return None
        except OSError as e:  # EIO of a bad sector: the camera's other files are still read (and this one collected)
            log.warning("frames log file unreadable; skipped", file=str(data), error=f"{type(e).__name__}: {e}")
            return None

    @staticmethod
    def _load_logged(data: Path, _key: tuple, newest: bool) -> _FileIndex:
        idx = _load(data)
        if idx.damaged:
            log.warning("frames log file damaged; its valid records are read", file=str(data), damaged=idx.damaged)
        if idx.valid_end < idx.size and not newest:
            log.warning("frames log tail torn; skipped", file=str(data), bytes=idx.size - idx.valid_end)
        return idx

    def writer(self, cam: str, roll_s: float) -> CameraWriter:
        """The camera's one writer (LogLocked while another process has it); FrameLogError (LogFull)
        when its directory or newest file cannot be made ready."""
        try:
            return CameraWriter(self.root, cam, roll_s)
        except OSError as e:
            raise log_error(cam, e) from e


def _captured(t0: float, t1: float) -> tuple[Callable[[tuple], bool], Callable[[_Entry], bool]]:
    """Files and entries of frames captured at t0 <= ts <= t1."""
    return (lambda s: s[2] <= t1 and s[3] >= t0), (lambda e: t0 <= e.ts <= t1)


def _within(idx: _FileIndex, t0: float, t1: float) -> Sequence[_Entry]:
    """The file's entries captured at t0 <= ts <= t1: all of them, not a copy, when its bounds
    lie within (every file of a long span but its first and last)."""
    s = idx.summary()
    if s is not None and t0 <= s[2] and s[3] <= t1:
        return idx.entries
    return [e for e in idx.entries if t0 <= e.ts <= t1]


def _count(idx: _FileIndex, t0: float, t1: float) -> int:
    return len(_within(idx, t0, t1))


def log_error(cam: str, e: OSError) -> FrameLogError:
    """An OSError of a write as the log's error: LogFull for a full disk or quota."""
    kind = LogFull if e.errno in (errno.ENOSPC, errno.EDQUOT) else FrameLogError
    return kind(cam, f"{errno.errorcode.get(e.errno or 0, 'error')}: {e.strerror or e}")


def _stat_or_none(p: Path) -> os.stat_result | None:
    try:
        return p.stat()
    except FileNotFoundError:
        return None


def _file_bytes(data: Path) -> int:
    return sum(st.st_size for st in (_stat_or_none(data), _stat_or_none(data.with_suffix(INDEX_SUFFIX))) if st)


@contextlib.contextmanager
def _lock_if_free(d: Path) -> Iterator[bool]:
    """Whether no writer holds the camera's lock; when none does, it is held here meanwhile (a
    writer starting now waits its turn: `LogLocked`, retried)."""
    try:
        fd = os.open(d / LOCK_NAME, os.O_RDWR)
    except FileNotFoundError:
        yield True  # no writer ever opened this log: nobody to wait for
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            free = False
        else:
            free = True
        yield free
    finally:
        os.close(fd)


def _remove_orphan_indexes(d: Path) -> None:
    for p in d.glob(f"*{INDEX_SUFFIX}"):
        if not p.with_suffix(DATA_SUFFIX).exists():
            p.unlink(missing_ok=True)


# --------------------------------------------------------------------------- the writer


@dataclass(frozen=True)
class _Mark:
    """What is on disk as of the last commit: where to roll back to."""

    data: Path | None
    data_size: int
    index_size: int
    last_seq: int
    last_ts: float


class CameraWriter:
    """Appends one camera's frames; `commit` makes them durable. One writer per camera (a lock file
    says so); not thread-safe."""

    def __init__(self, root: Path, cam: str, roll_s: float) -> None:
        if roll_s <= 0:
            raise ValueError(f"roll_s must be positive, got {roll_s}")
        self.cam, self.roll_s = cam, roll_s
        self.dir = _cam_dir(Path(root), cam)
        self.log = log.bind(stream=cam)
        self._lock_fd = self._lock()
        self._data_fd: int | None = None
        self._index_fd: int | None = None
        self._buf, self._ibuf = bytearray(), bytearray()
        self._pending = 0  # records buffered since the last commit
        self._new_file: Path | None = None  # where the buffered records go when they open a new file
        self._broken = False  # a failure left the files unknown: recover before the next write
        self._started = 0.0  # when this writer started the data file (`_roll_due`)
        self._left: dict[Path, str] = {}  # newest files that could not be resumed, and why
        self.left: list[tuple[Path, str]] = []  # those not yet reported (`take_left`)
        try:
            self._recover()
        except BaseException:  # let go of the lock: kept, every later try was refused as another writer's
            self.close()
            raise

    @property
    def pending(self) -> int:
        """Records appended and not yet committed."""
        return self._pending

    @property
    def pending_bytes(self) -> int:
        """Bytes appended and not yet committed (held in memory until then)."""
        return len(self._buf) + len(self._ibuf)

    def append(self, seq: int, ts: float, payload: bytes, epoch: int = 0) -> bool:
        """Buffer one frame; False (nothing buffered) when it is a frame already logged: a seq not
        after the last one, captured no later (an entry delivered again after a crash)."""
        self._ready()
        if seq <= self.last_seq and ts <= self.last_ts:
            return False
        if self._pending == 0 and self._roll_due():
            self._close_files()
            self._new_file = self._next_name()
        offset = (0 if self._new_file is not None else self._size) + len(self._buf)
        self._buf += _pack_record(seq, ts, epoch, payload)
        self._ibuf += _pack_entry(_Entry(seq, ts, offset, len(payload), epoch))
        self._pending += 1
        self.last_seq, self.last_ts = seq, ts
        return True

    def commit(self) -> int:
        """Write and fdatasync what was appended; the bytes written. FrameLogError (LogFull when the
        disk is full): nothing since the last commit is on disk (rolled back), `last_seq` included."""
        if not self._pending:
            return 0
        self._ready()
        written = len(self._buf) + len(self._ibuf)
        try:
            if self._new_file is not None:
                self._open(self._new_file)
            assert self._data_fd is not None and self._index_fd is not None
            write_all(self._data_fd, self._buf)
            write_all(self._index_fd, self._ibuf)
            os.fdatasync(self._data_fd)
            os.fdatasync(self._index_fd)
        except OSError as e:
            self._rollback()
            raise log_error(self.cam, e) from e
        self._size += len(self._buf)
        self._isize += len(self._ibuf)
        self._buf, self._ibuf, self._pending = bytearray(), bytearray(), 0
        self._mark = _Mark(self._data, self._size, self._isize, self.last_seq, self.last_ts)
        return written

    def take_left(self) -> list[tuple[Path, str]]:
        """The newest files left unresumed since the last call (an EIO of a bad sector), and why."""
        left, self.left = self.left, []
        return left

    def close(self) -> None:
        """Drop what was not committed and let go of the files and the lock."""
        self._close_files()
        os.close(self._lock_fd)

    # -- files ---------------------------------------------------------------------------

    def _lock(self) -> int:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LogLocked(self.cam, "another process writes this log") from None
        return fd

    def _roll_due(self) -> bool:
        """`roll_s` since this writer started the file (not since its name: a name given by a
        clock that was ahead, a host before NTP, kept the file from rolling until the clock
        reached it, growing out of retention's reach, the newest file never being collected); a
        clock set back by more than a roll rolls it too."""
        now = time.time()
        return self._data is None or not self._started - self.roll_s <= now < self._started + self.roll_s

    def _next_name(self) -> Path:
        now_ms = int(time.time() * 1000)
        files = _data_files(self.dir)
        last = int(files[-1].stem) if files else -1
        return self.dir / f"{max(now_ms, last + 1):013d}{DATA_SUFFIX}"

    def _open(self, data: Path) -> None:
        """Start a new data file (and its index); the directory entry is made durable too."""
        self._data_fd = os.open(data, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._index_fd = os.open(data.with_suffix(INDEX_SUFFIX), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._data, self._size, self._isize, self._new_file = data, 0, 0, None
        self._started = time.time()
        fsync_dir(self.dir)

    def _close_files(self) -> None:
        for fd in (self._data_fd, self._index_fd):
            if fd is not None:
                os.close(fd)
        self._data_fd = self._index_fd = None

    def _rollback(self) -> None:
        """Back to the last commit: a file begun since is removed, the current one truncated."""
        mark = self._mark
        begun = {self._new_file, self._data} - {None, mark.data}
        self._close_files()
        self._buf, self._ibuf, self._pending, self._new_file = bytearray(), bytearray(), 0, None
        try:
            for data in begun:
                data.unlink(missing_ok=True)
                data.with_suffix(INDEX_SUFFIX).unlink(missing_ok=True)
            if mark.data is not None:
                os.truncate(mark.data, mark.data_size)
                os.truncate(mark.data.with_suffix(INDEX_SUFFIX), mark.index_size)
        except OSError as e:  # what is left is cut off when the writer recovers (now or next time)
            self.log.error("frames log rollback failed", error=str(e))
        self._broken = True
        self._ready(raise_as=None)

    def _ready(self, raise_as: type[FrameLogError] | None = FrameLogError) -> None:
        """After a failed rollback, recover from what is on disk before going on."""
        if not self._broken:
            return
        try:
            self._recover()
            self._broken = False
        except OSError as e:
            self.log.error("frames log recovery failed", error=str(e))
            if raise_as is not None:
                raise raise_as(self.cam, f"recovery failed: {e.strerror or e}") from e

    def _recover(self) -> None:
        """Pick up after what is on disk: the newest file's torn tail is cut off, its index
        completed, and the last seq and capture time logged are restored (duplicates are skipped)."""
        self._close_files()
        self._data, self._size, self._isize = None, 0, 0
        self.last_seq, self.last_ts = -1, float("-inf")
        files = _data_files(self.dir)
        if files:
            self._resume_or_leave(files[-1])
        for data in reversed(files):  # the newest file may be empty
            try:
                idx = _load(data)
            except OSError as e:  # left (above), or an older bad sector: the one before it knows
                if e.errno in _NOT_THE_FILE:
                    raise
                continue
            if idx.entries:
                last = idx.entries[-1]
                self.last_seq, self.last_ts = last.seq, last.ts
                break
        self._mark = _Mark(self._data, self._size, self._isize, self.last_seq, self.last_ts)

    def _resume_or_leave(self, data: Path) -> None:
        """Resume the newest file, or leave it as it is when it cannot be read or opened (EIO):
        retrying it failed every write of the camera for good, and nothing but that file is lost
        by starting a new one with the next frame. Readers skip it, retention collects it."""
        try:
            self._resume(data)
        except OSError as e:
            if e.errno in _NOT_THE_FILE:
                raise
            self._close_files()
            self._data, self._size, self._isize = None, 0, 0  # the next append starts a new file
            if data not in self._left:
                why = f"{type(e).__name__}: {e}"
                self.log.warning("frames log file unusable; left, a new file is started", file=str(data), error=why)
                self._left[data] = why
                self.left.append((data, why))

    def _resume(self, data: Path) -> None:
        """Go on appending to the newest file, made whole first."""
        idx = _load(data)
        if idx.valid_end < idx.size:
            self.log.warning(
                "frames log tail torn; cut off", file=str(data), bytes=idx.size - idx.valid_end, kept=len(idx.entries)
            )
        if idx.damaged:
            self.log.warning("frames log file damaged; its valid records kept", file=str(data), damaged=idx.damaged)
        self._data_fd = os.open(data, os.O_WRONLY)
        self._index_fd = os.open(data.with_suffix(INDEX_SUFFIX), os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self._data_fd, idx.valid_end)
        # the index as far as it was valid, then entries for the records only a scan found
        os.ftruncate(self._index_fd, idx.index_entries * _ENTRY_SIZE)
        os.lseek(self._data_fd, 0, os.SEEK_END)
        os.lseek(self._index_fd, 0, os.SEEK_END)
        scanned = b"".join(_pack_entry(e) for e in idx.entries[idx.index_entries :])
        write_all(self._index_fd, scanned)
        if scanned or idx.valid_end < idx.size:
            os.fdatasync(self._data_fd)
            os.fdatasync(self._index_fd)
        self._data, self._size, self._isize = data, idx.valid_end, len(idx.entries) * _ENTRY_SIZE
        self._started = min(int(data.stem) / 1000, time.time())  # named ahead: started now
