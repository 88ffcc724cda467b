"""Where segments' K/V live between processes (docs/DESIGN.md, "Persistence").

A segment is immutable once put: the encoder's writer (`common.segment_writer`) puts it before a
version that references it is published, QA workers get it when they mirror that version, and
the writer collects the segments no version still needs. Three backends, one interface:

- ``DirectoryStore``: a directory. Under ``shm://`` (the default) it lies in shared host memory
  (tmpfs): it outlives the worker process (a crash, kill -9, an upgrade of the container) but
  not the host, and is written with no fsync. Under ``dir://`` or a plain path it is a disk
  directory and every put is fsynced (file and directory) before it counts as written.
- ``RedisStore``: several hosts; the bytes sit in Redis next to the stream's other keys.
- ``MemoryStore``: encoder and qa in one process; references only, so nothing is held twice.

Every stored segment is one record: a header (magic, dtype, shape, checksum of the payload) and
the raw bytes of the tensor, so K/V are stored exactly as given (bfloat16 too) with no
serialization library in between, and a truncated, bit-flipped or foreign file is refused as
corrupt (`SegmentStoreError`) instead of being loaded. The checksum is CRC-32C (`crc32c`: the
CPU's CRC instruction, 16 GB/s a core where zlib's CRC-32 ran 4.2 on the same core and 2.9 on
an H200 host, GIL released): a worker taking over a dead one's streams checks every byte it reads
back, and the check was half of what a reader did a byte (encoder_worker/restore.py). A record
written before carries zlib's CRC-32 (`crc32`) and is checked with it: the shared-memory store
outlives an upgrade of the worker.

Beside a chunk's segments, exact eviction stores the chunk's vision embeddings (L, D) under
``embeds_id(chunk_id)``: put and get take them like K/V, and gc keeps them as long as any
segment of that chunk (the original or a re-prefilled ``<chunk>.rN``) is kept.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import secrets
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol, runtime_checkable

import crc32c
import msgpack
import redis
import torch

from common.engine.kvcache import chunk_id
from common.faults import fault_point
from common.files import fsync_dir, write_all
from common.redisio import connect
from common.wire import keys

_SUFFIX = ".seg"
_TMP_SUFFIX = ".tmp"
_EMBEDS = ".emb"
_MAGIC = b"SVQAseg1"
_PREFIX = struct.Struct("<8sI")  # magic, header length
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
_MAX_HEADER = 4096
# Outages of the medium rather than faults of a segment: the writer retries these. A store the
# worker may not write (permissions) fails every stream's writes alike, so it is one too.
_UNAVAILABLE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ENOMEM, errno.EACCES, errno.EPERM}


def embeds_id(chunk: str) -> str:
    """Where a chunk's vision embeddings are stored, next to its segments."""
    return chunk + _EMBEDS


class SegmentStoreError(RuntimeError):
    """A segment is missing or corrupt, or an id or URL is invalid."""


class StoreUnavailable(SegmentStoreError):
    """The store cannot take writes now (disk full, read-only, I/O error): an outage, not bad data."""


@runtime_checkable
class SegmentStore(Protocol):
    def put(self, stream: str, segment_id: str, kv: torch.Tensor, *, epoch: str | None = None) -> None: ...
    def get(
        self, stream: str, segment_id: str, device: torch.device | str = "cpu", *, pin: bool = False
    ) -> torch.Tensor: ...
    def gc(self, stream: str, keep: Iterable[str]) -> int: ...


def _check_ids(*ids: str) -> None:
    """Stream and segment ids become file names and key suffixes: nothing that escapes the
    stream's directory or hides as a dot file (temp files are dot files, so gc never confuses them)."""
    for value in ids:
        if not isinstance(value, str) or not value or value[0] == "." or any(c in value for c in "/\\\0"):
            raise SegmentStoreError(f"invalid stream or segment id {value!r}: empty, leading dot or path separator")


def _check_kv(segment_id: str, kv: torch.Tensor) -> None:
    if segment_id.endswith(_EMBEDS):
        if kv.dim() != 2 or not kv.is_floating_point():
            raise ValueError(f"embeddings must be a float (n_tokens, hidden) tensor, got {kv.dtype} {tuple(kv.shape)}")
    elif kv.dim() != 5 or kv.shape[1] != 2 or not kv.is_floating_point():
        raise ValueError(
            f"kv must be a float (layers, 2, kv_heads, n_tokens, head_dim) tensor, got {kv.dtype} {tuple(kv.shape)}"
        )
    if str(kv.dtype) not in _DTYPES:
        raise ValueError(f"unsupported dtype {kv.dtype}")


Checksum = Callable[[memoryview, int], int]  # (bytes, the checksum so far) -> the checksum with them
# A header's checksum field and its function.
_CHECKSUMS: dict[str, Checksum] = {"crc32c": crc32c.crc32c, "crc32": zlib.crc32}
WRITTEN_WITH = "crc32c"  # what records are written with (scripts/bench_restore.py writes the old kind too)


def checksum(meta: dict) -> tuple[Checksum, int]:
    """The function a record's payload is checked with, and what it must come to (the header
    names which; KeyError when it names none)."""
    for name, fn in _CHECKSUMS.items():
        if name in meta:
            return fn, int(meta[name])
    raise KeyError("no checksum")


def encode(kv: torch.Tensor, stream: str | None = None, epoch: str | None = None) -> tuple[bytes, memoryview]:
    """A record's header and its payload: the tensor's own bytes, not copied when it is already a
    contiguous CPU tensor (the pinned copy the encoder hands over). ``stream`` and ``epoch`` (the
    stream's life) name whose K/V it is: segment ids repeat across streams and lives, so a valid
    record of another one under the same name is refused at restore (`owner_mismatch`)."""
    kv = kv.detach().to("cpu").contiguous()
    payload = memoryview(kv.reshape(-1).view(torch.uint8).numpy()).cast("B")
    meta = {
        "dtype": str(kv.dtype),
        "shape": list(kv.shape),
        "nbytes": payload.nbytes,
        WRITTEN_WITH: _CHECKSUMS[WRITTEN_WITH](payload, 0),
    }
    owner = {"stream": stream, "epoch": epoch}
    header = msgpack.packb(meta | {k: v for k, v in owner.items() if v is not None})
    return _PREFIX.pack(_MAGIC, len(header)) + header, payload


def _header(head: bytes, where: str, size: int) -> tuple[dict, int]:
    """The record's header, rebuilt from values checked to be what a record holds (a foreign or
    damaged one's may be anything msgpack can hold: a float size, a bool in a shape), and where
    its payload starts. `size`: the record's bytes; a header claiming more payload than that is
    refused before anything is allocated for it."""
    if len(head) < _PREFIX.size:
        raise SegmentStoreError(f"corrupt segment {where}: truncated header")
    magic, n = _PREFIX.unpack_from(head)
    if magic != _MAGIC or n > _MAX_HEADER or len(head) < _PREFIX.size + n:
        raise SegmentStoreError(f"corrupt segment {where}: not a segment record")
    try:
        raw = msgpack.unpackb(head[_PREFIX.size : _PREFIX.size + n])
        if not isinstance(raw, dict):
            raise TypeError("not a map")
        dtype, shape, nbytes = _DTYPES[raw["dtype"]], [_count(s) for s in raw["shape"]], _count(raw["nbytes"])
        name = next(name for name in _CHECKSUMS if name in raw)
        meta = {"dtype": str(dtype), "shape": shape, "nbytes": nbytes, name: _count(raw[name])}
        meta |= {k: _text(raw[k]) for k in _OWNER if k in raw}
    except (ValueError, KeyError, TypeError, StopIteration, msgpack.UnpackException) as e:
        raise SegmentStoreError(f"corrupt segment {where}: bad header ({e!r})") from None
    if nbytes != math.prod(shape) * dtype.itemsize:
        raise SegmentStoreError(f"corrupt segment {where}: header's size does not match its shape")
    if nbytes > size - _PREFIX.size - n:
        raise SegmentStoreError(f"corrupt segment {where}: {size - _PREFIX.size - n} of {nbytes} bytes")
    return meta, _PREFIX.size + n


_OWNER = ("stream", "epoch")  # whose K/V a record holds; a record written before lacks them


def owner_mismatch(meta: dict, stream: str, epoch: str | None, where: str) -> str | None:
    """Why a record is not the K/V of ``stream``'s life ``epoch`` (another stream's or another
    life's, valid and of the right shape: copied in, or left by a later life under the same id),
    or None. What the record does not name (written before it did), or ``epoch`` None, passes."""
    for key, want in zip(_OWNER, (stream, epoch), strict=True):
        if want is not None and key in meta and meta[key] != want:
            return f"segment {where} holds {key} {meta[key]!r}'s K/V, not {want!r}'s"
    return None


def _text(value: object) -> str:
    if type(value) is not str:
        raise TypeError(f"{value!r} is not text")
    return value


def _count(value: object) -> int:
    """A header's size, dimension or checksum: an int of 0 or more (not a bool, a float, text)."""
    if type(value) is not int or value < 0:
        raise TypeError(f"{value!r} is not a count")
    return value


def payload_tensor(
    meta: dict, payload: torch.Tensor, where: str, segment_id: str, crc: int | None = None
) -> torch.Tensor:
    """Check the payload (uint8, on any device) against its header; the tensor it holds. ``crc``:
    the payload's checksum (`checksum(meta)`) where the reader computed it piece by piece."""
    if payload.numel() != meta["nbytes"]:
        raise SegmentStoreError(f"corrupt segment {where}: {payload.numel()} of {meta['nbytes']} bytes")
    fn, stored = checksum(meta)
    if crc is None:
        crc = fn(memoryview(payload.numpy()).cast("B"), 0)
    if crc != stored:
        raise SegmentStoreError(f"corrupt segment {where}: checksum mismatch")
    kv = payload.view(_DTYPES[meta["dtype"]]).reshape(meta["shape"])
    try:
        _check_kv(segment_id, kv)
    except ValueError as e:
        raise SegmentStoreError(f"corrupt segment {where}: {e}") from None
    return kv


def decode(data: bytes, segment_id: str, where: str) -> torch.Tensor:
    """A record held in memory (a Redis value) back to its tensor (a copy of its own)."""
    meta, start = _header(data[: _MAX_HEADER + _PREFIX.size], where, len(data))
    payload = torch.frombuffer(bytearray(data[start:]), dtype=torch.uint8) if len(data) > start else torch.empty(0)
    return payload_tensor(meta, payload.to(torch.uint8), where, segment_id)


def _unkept(stored: Iterable[str], keep: Iterable[str]) -> set[str]:
    """Ids among `stored` that gc deletes: segments not in `keep`, embeddings of chunks none of
    whose segments are in `keep`."""
    keep = set(keep)
    chunks = {embeds_id(chunk_id(s)) for s in keep}
    return {s for s in stored if s not in keep and not (s.endswith(_EMBEDS) and s in chunks)}


def _os_error(e: OSError, what: str, root: Path) -> SegmentStoreError:
    """A failed write as an outage (retried, readiness fails) or this segment's fault. A store
    root that is no directory (a file put in its place) fails every stream's writes: an outage,
    where a stream's own directory replaced by a file is that stream's damage alone."""
    lost_root = e.errno == errno.ENOTDIR and not root.is_dir()
    cls = StoreUnavailable if e.errno in _UNAVAILABLE_ERRNOS or lost_root else SegmentStoreError
    return cls(f"{what}: {e.strerror or e}")


class DirectoryStore:
    """root/<stream>/<segment_id>.seg, each written whole under a temporary name and renamed, so
    a reader sees a segment whole or not at all. ``durable``: fsync the file and the directory
    before the put returns (a disk); without it (tmpfs) a put survives the process, not the host."""

    def __init__(self, root: str | Path, durable: bool = True) -> None:
        self.root = Path(root)
        self.durable = durable

    def path(self, stream: str, segment_id: str) -> Path:
        _check_ids(stream, segment_id)
        return self.root / stream / (segment_id + _SUFFIX)

    def put(self, stream: str, segment_id: str, kv: torch.Tensor, *, epoch: str | None = None) -> None:
        _check_kv(segment_id, kv)
        final = self.path(stream, segment_id)
        head, payload = encode(kv, stream, epoch)
        # A dot name in the same directory: os.replace is then an atomic rename, and gc knows a
        # leftover of a writer that died as one.
        tmp = final.parent / f".{segment_id}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            # os.open with 0o666, not mkstemp's 0o600: the qa container may run as another user.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "wb", buffering=0) as f:
                write_all(f.fileno(), head)
                write_all(f.fileno(), payload)  # the GIL is released while the kernel copies
                if self.durable:
                    os.fsync(f.fileno())  # data on disk before the name points at it
            os.replace(tmp, final)
            if self.durable:
                fsync_dir(final.parent)  # the rename itself survives a power cut
        except OSError as e:
            with contextlib.suppress(OSError):  # its directory may be what failed (not a directory)
                tmp.unlink(missing_ok=True)
            raise _os_error(e, f"cannot write segment {final}", self.root) from e

    @contextlib.contextmanager
    def open(self, stream: str, segment_id: str) -> Iterator[tuple[dict, BinaryIO, str]]:
        """A stored record: its header, its file at the start of the payload, and where it is (for
        errors). A missing file, a bad header or a failed read inside the block is a SegmentStoreError."""
        path = self.path(stream, segment_id)
        try:
            with open(path, "rb", buffering=0) as f:
                meta, start = _header(f.read(_PREFIX.size + _MAX_HEADER), str(path), os.fstat(f.fileno()).st_size)
                f.seek(start)
                yield meta, f, str(path)
        except FileNotFoundError as e:
            raise SegmentStoreError(f"missing segment {path}") from e
        except OSError as e:
            raise SegmentStoreError(f"corrupt segment {path}: {e}") from e

    def get(
        self, stream: str, segment_id: str, device: torch.device | str = "cpu", *, pin: bool = False
    ) -> torch.Tensor:
        """``pin``: read into page-locked memory (a GPU copies it from there without a wait)."""
        device = torch.device(device)
        with self.open(stream, segment_id) as (meta, f, where):
            # Straight into page-locked memory when it goes on to a GPU: one copy, not waited for.
            payload = torch.empty(meta["nbytes"], dtype=torch.uint8, pin_memory=pin or device.type == "cuda")
            got = f.readinto(memoryview(payload.numpy()).cast("B")) if payload.numel() else 0
        kv = payload_tensor(meta, payload[:got], where, segment_id)
        return kv.to(device, non_blocking=True)

    def gc(self, stream: str, keep: Iterable[str]) -> int:
        """Delete the stream's segments not in keep and any temp files (a writer that crashed);
        returns the number of segments deleted. Call it from the stream's writer, with keep
        covering every segment it has put and may still publish."""
        _check_ids(stream)
        try:
            entries = list(os.scandir(self.root / stream))
        except (FileNotFoundError, NotADirectoryError):  # nothing stored (the root's outage is put's to report)
            return 0
        for entry in entries:
            if entry.name.startswith(".") and entry.name.endswith(_TMP_SUFFIX):
                Path(entry.path).unlink(missing_ok=True)
        stored = [e.name[: -len(_SUFFIX)] for e in entries if e.name.endswith(_SUFFIX) and not e.name.startswith(".")]
        drop = _unkept(stored, keep)
        for i, segment_id in enumerate(drop):
            if i:
                fault_point("persist.mid_gc")
            self.path(stream, segment_id).unlink(missing_ok=True)
        return len(drop)


class MemoryStore:
    """Segments held in this process. `put` stores a compact copy: a view would keep the whole
    arena it points into alive (and every arena an eviction leaves behind)."""

    def __init__(self) -> None:
        # by stream: gc looks at its stream's segments only (at every publish of every stream)
        self._data: dict[str, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()  # encoder and qa threads share one instance

    def put(self, stream: str, segment_id: str, kv: torch.Tensor, *, epoch: str | None = None) -> None:
        """``epoch`` is not kept: nothing copies another record into a process's memory."""
        _check_ids(stream, segment_id)
        _check_kv(segment_id, kv)
        kv = kv.clone()
        with self._lock:
            self._data.setdefault(stream, {})[segment_id] = kv

    def get(
        self, stream: str, segment_id: str, device: torch.device | str = "cpu", *, pin: bool = False
    ) -> torch.Tensor:
        _check_ids(stream, segment_id)
        with self._lock:
            kv = self._data.get(stream, {}).get(segment_id)
        if kv is None:
            raise SegmentStoreError(f"missing segment memory:{stream}/{segment_id}")
        kv = kv.to(device)  # the same object when it already lives there
        return kv.pin_memory() if pin and kv.device.type == "cpu" else kv

    def gc(self, stream: str, keep: Iterable[str]) -> int:
        _check_ids(stream)
        with self._lock:
            held = self._data.get(stream, {})
            drop = _unkept(list(held), keep)
            for segment_id in drop:
                del held[segment_id]
        return len(drop)


class RedisStore:
    """Segment records at keys.segment(stream, id); ``ttl_s`` bounds what a dead writer leaves.

    The client must return bytes (decode_responses=False, as common.redisio.connect does).
    Redis connection errors propagate as they are: callers already retry those.
    """

    def __init__(self, client: redis.Redis, ttl_s: int | None = None) -> None:
        self.r = client
        self.ttl_s = ttl_s

    def put(self, stream: str, segment_id: str, kv: torch.Tensor, *, epoch: str | None = None) -> None:
        _check_kv(segment_id, kv)
        head, payload = encode(kv, stream, epoch)
        try:
            self.r.set(self._key(stream, segment_id), head + payload.tobytes(), ex=self.ttl_s)
        except redis.ResponseError as e:  # OOM (maxmemory) or a read-only replica: Redis can't take it now
            raise StoreUnavailable(f"cannot write segment {segment_id}: {e}") from e

    def get(
        self, stream: str, segment_id: str, device: torch.device | str = "cpu", *, pin: bool = False
    ) -> torch.Tensor:
        key = self._key(stream, segment_id)
        data = self.r.get(key)
        if data is None:
            raise SegmentStoreError(f"missing segment {key}")
        kv = decode(data, segment_id, key).to(device)
        return kv.pin_memory() if pin and kv.device.type == "cpu" else kv

    def gc(self, stream: str, keep: Iterable[str]) -> int:
        _check_ids(stream)
        prefix = keys.segment(stream, "")
        # Escape glob characters: a stream named "cam*" must not match "camX"'s segments.
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
        stored = [k.decode()[len(prefix) :] for k in self.r.scan_iter(match=pattern, count=1000)]
        # One UNLINK per key, pipelined: a cluster redirects each on its own while their slot moves
        # (a multi-key command there fails with TRYAGAIN until every key has moved).
        pipe = self.r.pipeline(transaction=False)
        for s in _unkept(stored, keep):
            pipe.unlink(prefix + s)
        return sum(pipe.execute())

    @staticmethod
    def _key(stream: str, segment_id: str) -> str:
        _check_ids(stream, segment_id)
        return keys.segment(stream, segment_id)


_memory_stores: dict[str, MemoryStore] = {}
_memory_lock = threading.Lock()


def open_store(url: str, redis_client: redis.Redis | None = None, *, ttl_s: int | None = None) -> SegmentStore:
    """shm:///path (a tmpfs directory: outlives the process, no fsync; the default),
    dir:///path or a plain path (a disk directory, fsynced), memory://[name] (one instance per
    URL per process, so encoder and qa share it), redis://, rediss://, unix:// or a cluster's
    redis+cluster:// or rediss+cluster:// (ttl_s applies to Redis only)."""
    if url.startswith("memory://"):
        with _memory_lock:
            return _memory_stores.setdefault(url, MemoryStore())
    if url.startswith("shm://"):
        return DirectoryStore(url[len("shm://") :], durable=False)
    if url.startswith("dir://"):
        return DirectoryStore(url[len("dir://") :])
    if url.startswith(("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")):
        if redis_client is None:
            redis_client = connect(url)
        return RedisStore(redis_client, ttl_s)
    if "://" in url or not url:
        raise SegmentStoreError(f"unknown segment store URL {url!r}")
    return DirectoryStore(url)
