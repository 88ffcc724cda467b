"""Where segments' K/V live between processes (docs/DESIGN.md, "Transport between processes").

A segment is immutable once put: the encoder puts it before publishing a version that
references it, QA workers get it when they mirror that version, and the stream's writer
gc's the segments no version still needs. Three backends, one interface:

- ``DirectoryStore``: one host, a tmpfs or a volume shared by the encoder and qa containers.
- ``RedisStore``: several hosts; the bytes sit in Redis next to the stream's other keys.
- ``MemoryStore``: encoder and qa in one process; references only, so nothing is held twice.

K/V are stored exactly as given (dtype included, bfloat16 too), so a mirror is bitwise equal
to the encoder's cache.

Beside a chunk's segments, exact eviction stores the chunk's vision embeddings (L, D) under
``embeds_id(chunk_id)``: put and get take them like K/V, and gc keeps them as long as any
segment of that chunk (the original or a re-prefilled ``<chunk>.rN``) is kept.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

import redis
import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save

from common.engine.kvcache import chunk_id
from common.redisio import connect
from common.wire import keys

_SUFFIX = ".safetensors"
_TMP_SUFFIX = ".tmp"
_EMBEDS = ".emb"


def embeds_id(chunk: str) -> str:
    """Where a chunk's vision embeddings are stored, next to its segments."""
    return chunk + _EMBEDS


class SegmentStoreError(RuntimeError):
    """A segment is missing, corrupt or cannot be written, or an id or URL is invalid."""


@runtime_checkable
class SegmentStore(Protocol):
    def put(self, stream: str, segment_id: str, kv: torch.Tensor) -> None: ...
    def get(self, stream: str, segment_id: str, device: torch.device | str = "cpu") -> torch.Tensor: ...
    def gc(self, stream: str, keep: Iterable[str]) -> int: ...


def _check_ids(*ids: str) -> None:
    """Stream and segment ids become file names and key suffixes: nothing that escapes the
    stream's directory or hides as a dot file (temp files are dot files, so gc never confuses them)."""
    for value in ids:
        if not isinstance(value, str) or not value or value[0] == "." or any(c in value for c in "/\\\0"):
            raise SegmentStoreError(f"invalid stream or segment id {value!r}: empty, leading dot or path separator")


def _kind(segment_id: str) -> tuple[str, int]:
    """The tensor an id holds: ("kv", 5 dims) for a segment, ("embeds", 2 dims) for embeddings."""
    return ("embeds", 2) if segment_id.endswith(_EMBEDS) else ("kv", 5)


def _check_kv(segment_id: str, kv: torch.Tensor) -> None:
    name, dims = _kind(segment_id)
    if name == "embeds" and (kv.dim() != 2 or not kv.is_floating_point()):
        raise ValueError(f"embeddings must be a float (n_tokens, hidden) tensor, got {kv.dtype} {tuple(kv.shape)}")
    if name == "kv" and (kv.dim() != dims or kv.shape[1] != 2 or not kv.is_floating_point()):
        raise ValueError(
            f"kv must be a float (layers, 2, kv_heads, n_tokens, head_dim) tensor, got {kv.dtype} {tuple(kv.shape)}"
        )


def _to_bytes(segment_id: str, kv: torch.Tensor) -> bytes:
    # safetensors wants a contiguous CPU tensor; the encoder passes a strided view of its arena.
    kv = kv.detach().to("cpu").contiguous()
    return save({_kind(segment_id)[0]: kv}, metadata={"shape": str(list(kv.shape)), "dtype": str(kv.dtype)})


def _unpack(tensors: dict[str, torch.Tensor], segment_id: str, where: str, device: torch.device | str) -> torch.Tensor:
    name, dims = _kind(segment_id)
    kv = tensors.get(name)
    if kv is None or kv.dim() != dims:
        raise SegmentStoreError(f"corrupt segment {where}: no {dims}-d tensor {name!r}")
    return kv.to(device)


def _unkept(stored: Iterable[str], keep: Iterable[str]) -> set[str]:
    """Ids among `stored` that gc deletes: segments not in `keep`, embeddings of chunks none of
    whose segments are in `keep`."""
    keep = set(keep)
    chunks = {embeds_id(chunk_id(s)) for s in keep}
    return {s for s in stored if s not in keep and not (s.endswith(_EMBEDS) and s in chunks)}


class DirectoryStore:
    """root/<stream>/<segment_id>.safetensors, written atomically (temp file, fsync, rename)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, stream: str, segment_id: str) -> Path:
        _check_ids(stream, segment_id)
        return self.root / stream / (segment_id + _SUFFIX)

    def put(self, stream: str, segment_id: str, kv: torch.Tensor) -> None:
        _check_kv(segment_id, kv)
        final = self.path(stream, segment_id)
        data = _to_bytes(segment_id, kv)
        # Same directory so os.replace is a rename within one file system, hence atomic: a reader
        # sees the old name absent or the whole file. A dot name so gc knows it as a leftover.
        tmp = final.parent / f".{segment_id}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            # os.open with 0o666, not mkstemp's 0o600: the qa container may run as another user.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # data on disk before the name points at it
            os.replace(tmp, final)
            _fsync_dir(final.parent)  # the rename itself survives a power cut (restart reloads from here)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise SegmentStoreError(f"cannot write segment {final}: {e}") from e

    def get(self, stream: str, segment_id: str, device: torch.device | str = "cpu") -> torch.Tensor:
        path = self.path(stream, segment_id)
        try:
            tensors = load_file(path, device="cpu")
        except FileNotFoundError as e:
            raise SegmentStoreError(f"missing segment {path}") from e
        except (SafetensorError, OSError, ValueError) as e:
            raise SegmentStoreError(f"corrupt segment {path}: {e}") from e
        return _unpack(tensors, segment_id, str(path), device)

    def gc(self, stream: str, keep: Iterable[str]) -> int:
        """Delete the stream's segments not in keep and any temp files (a writer that crashed);
        returns the number of segments deleted. Call it from the stream's writer, with keep
        covering every segment it has put and may still publish."""
        _check_ids(stream)
        try:
            entries = list(os.scandir(self.root / stream))
        except FileNotFoundError:
            return 0
        for entry in entries:
            if entry.name.startswith(".") and entry.name.endswith(_TMP_SUFFIX):
                Path(entry.path).unlink(missing_ok=True)
        stored = [e.name[: -len(_SUFFIX)] for e in entries if e.name.endswith(_SUFFIX) and not e.name.startswith(".")]
        drop = _unkept(stored, keep)
        for segment_id in drop:
            self.path(stream, segment_id).unlink(missing_ok=True)
        return len(drop)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MemoryStore:
    """Segments held in this process. `put` stores a compact copy: a view would keep the whole
    arena it points into alive (and every arena an eviction leaves behind)."""

    def __init__(self) -> None:
        # by stream: gc looks at its stream's segments only (at every publish of every stream)
        self._data: dict[str, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()  # encoder and qa threads share one instance

    def put(self, stream: str, segment_id: str, kv: torch.Tensor) -> None:
        _check_ids(stream, segment_id)
        _check_kv(segment_id, kv)
        kv = kv.clone()
        with self._lock:
            self._data.setdefault(stream, {})[segment_id] = kv

    def get(self, stream: str, segment_id: str, device: torch.device | str = "cpu") -> torch.Tensor:
        _check_ids(stream, segment_id)
        with self._lock:
            kv = self._data.get(stream, {}).get(segment_id)
        if kv is None:
            raise SegmentStoreError(f"missing segment memory:{stream}/{segment_id}")
        return kv.to(device)  # the same object when it already lives there

    def gc(self, stream: str, keep: Iterable[str]) -> int:
        _check_ids(stream)
        with self._lock:
            held = self._data.get(stream, {})
            drop = _unkept(list(held), keep)
            for segment_id in drop:
                del held[segment_id]
        return len(drop)


class RedisStore:
    """Safetensors bytes at keys.segment(stream, id); ``ttl_s`` bounds what a dead writer leaves.

    The client must return bytes (decode_responses=False, as common.redisio.connect does).
    Redis connection errors propagate as they are: callers already retry those.
    """

    def __init__(self, client: redis.Redis, ttl_s: int | None = None) -> None:
        self.r = client
        self.ttl_s = ttl_s

    def put(self, stream: str, segment_id: str, kv: torch.Tensor) -> None:
        _check_kv(segment_id, kv)
        self.r.set(self._key(stream, segment_id), _to_bytes(segment_id, kv), ex=self.ttl_s)

    def get(self, stream: str, segment_id: str, device: torch.device | str = "cpu") -> torch.Tensor:
        key = self._key(stream, segment_id)
        data = self.r.get(key)
        if data is None:
            raise SegmentStoreError(f"missing segment {key}")
        try:
            tensors = load(data)
        except (SafetensorError, ValueError) as e:
            raise SegmentStoreError(f"corrupt segment {key}: {e}") from e
        return _unpack(tensors, segment_id, key, device)

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
    """memory://[name] (one instance per URL per process, so encoder and qa share it),
    dir:///path or a plain path, redis://, rediss://, unix:// or a cluster's redis+cluster:// or
    rediss+cluster:// (ttl_s applies to Redis only)."""
    if url.startswith("memory://"):
        with _memory_lock:
            return _memory_stores.setdefault(url, MemoryStore())
    if url.startswith("dir://"):
        return DirectoryStore(url[len("dir://") :])
    if url.startswith(("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")):
        if redis_client is None:
            redis_client = connect(url)
        return RedisStore(redis_client, ttl_s)
    if "://" in url or not url:
        raise SegmentStoreError(f"unknown segment store URL {url!r}")
    return DirectoryStore(url)
