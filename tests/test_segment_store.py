"""Segment stores on a real file system, a real tmpfs and a real redis-server: round trips,
atomic writes, checksums, gc, and a full disk as an outage."""

from __future__ import annotations

import os
import re
import stat
import struct
import subprocess
import sys
import uuid
import zlib
from pathlib import Path

import crc32c
import msgpack
import pytest
import redis
import torch

from common.segment_store import (
    DirectoryStore,
    MemoryStore,
    RedisStore,
    SegmentStore,
    SegmentStoreError,
    StoreUnavailable,
    embeds_id,
    open_store,
)
from common.wire import keys

REPO = Path(__file__).resolve().parents[1]
KINDS = ["memory", "dir", "redis"]


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> SegmentStore:
    if request.param == "memory":
        return MemoryStore()
    if request.param == "dir":
        return DirectoryStore(tmp_path / "segs")
    return RedisStore(redis.Redis.from_url(request.getfixturevalue("redis_url")))


def arena(dtype: torch.dtype, tokens: int = 16) -> torch.Tensor:
    """(layers, 2, kv_heads, tokens, head_dim), like the encoder's arena."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 2, 2, tokens, 8, generator=g).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_bitwise(store: SegmentStore, dtype: torch.dtype) -> None:
    a = arena(dtype)
    cases = {
        "whole": a,
        "slice": a[:, :, :, 5:11],  # what the encoder passes: non-contiguous
        "offset_view": a[1:2],  # contiguous, but not at the start of its storage
    }
    assert not cases["slice"].is_contiguous()
    for sid, kv in cases.items():
        store.put("cam", sid, kv)
    for sid, kv in cases.items():
        got = store.get("cam", sid, device=torch.device("cpu"))
        assert same_bits(got, kv), sid


def exists(store: SegmentStore, stream: str, segment_id: str) -> bool:
    try:
        store.get(stream, segment_id)
    except SegmentStoreError:
        return False
    return True


def test_stores_satisfy_protocol(store: SegmentStore) -> None:
    assert isinstance(store, SegmentStore)


def test_missing_segment(store: SegmentStore) -> None:
    with pytest.raises(SegmentStoreError, match=r"missing segment.*nope"):
        store.get("cam", "nope")


@pytest.mark.parametrize("bad", ["", ".hidden", "..", "a/b", "/abs", "a\\b", "a\0b"])
def test_bad_ids_rejected(store: SegmentStore, bad: str) -> None:
    kv = arena(torch.float32)
    for call in (
        lambda: store.put(bad, "s", kv),
        lambda: store.put("cam", bad, kv),
        lambda: store.get(bad, "s"),
        lambda: store.get("cam", bad),
        lambda: store.gc(bad, []),
    ):
        with pytest.raises(SegmentStoreError, match="invalid"):
            call()


def test_bad_kv_rejected(store: SegmentStore) -> None:
    with pytest.raises(ValueError):
        store.put("cam", "s", torch.zeros(2, 2, 4, 8))
    with pytest.raises(ValueError):
        store.put("cam", "s", torch.zeros(2, 2, 1, 4, 8, dtype=torch.int32))


def test_gc_deletes_exactly_the_unkept_of_one_stream(store: SegmentStore) -> None:
    kv = arena(torch.float32, tokens=2)
    for i in range(5):
        store.put("a", f"s{i}", kv)
    for i in range(2):
        store.put("b", f"s{i}", kv)
    assert store.gc("a", iter(["s1", "s3", "never-put"])) == 3
    assert [exists(store, "a", f"s{i}") for i in range(5)] == [False, True, False, True, False]
    assert exists(store, "b", "s0") and exists(store, "b", "s1")
    assert store.gc("a", ["s1", "s3"]) == 0
    assert store.gc("empty", []) == 0


def test_embeddings_round_trip_and_live_as_long_as_a_segment_of_their_chunk(store: SegmentStore) -> None:
    """Exact eviction keeps a chunk's vision embeddings beside its segments; re-prefilled segments
    (`<chunk>.rN`) keep them alive, and they go with the chunk's last segment."""
    embeds = torch.randn(12, 64).to(torch.bfloat16)
    kv = arena(torch.float32, tokens=2)
    for chunk in ("f000000000004", "f000000000008"):
        store.put("a", chunk, kv)
        store.put("a", embeds_id(chunk), embeds)
    store.put("a", "f000000000008.r2", kv)
    assert same_bits(store.get("a", embeds_id("f000000000004")), embeds)
    with pytest.raises(ValueError, match="embeddings"):
        store.put("a", embeds_id("f1"), kv)
    assert store.gc("a", ["f000000000004", "f000000000008.r2"]) == 1  # f000000000008 itself
    assert exists(store, "a", embeds_id("f000000000004")) and exists(store, "a", embeds_id("f000000000008"))
    assert store.gc("a", ["f000000000008.r2"]) == 2  # f000000000004 and its embeddings
    assert not exists(store, "a", embeds_id("f000000000004")) and exists(store, "a", embeds_id("f000000000008"))
    assert store.gc("a", []) == 2


# -- DirectoryStore ------------------------------------------------------------------------


def test_directory_layout_and_metadata(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    kv = arena(torch.bfloat16)[:, :, :, 2:6]
    umask = os.umask(0o022)
    os.umask(umask)
    store.put("cam", "seg-1", kv)
    path = tmp_path / "cam" / "seg-1.seg"
    assert sorted(p.name for p in (tmp_path / "cam").iterdir()) == ["seg-1.seg"]
    # Readable by the qa container's user as the umask allows (not mkstemp's 0600).
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert path.read_bytes().startswith(b"SVQAseg1")
    assert path.stat().st_size > kv.numel() * 2  # the raw bfloat16 payload after a small header


def test_directory_fsyncs_before_the_final_name_appears(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DirectoryStore(tmp_path)
    final = tmp_path / "cam" / "s.seg"
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync")
        real_fsync(fd)

    def replace(src, dst) -> None:
        assert not final.exists()
        assert Path(src).parent == final.parent and Path(src).name.startswith(".")
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store.put("cam", "s", arena(torch.float32))
    assert events[:2] == ["fsync", "replace"]  # file data durable before it gets its name; then the dir


def test_directory_failed_replace_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DirectoryStore(tmp_path)
    old = arena(torch.float32)
    store.put("cam", "kept", old)

    def crash(src, dst) -> None:
        raise OSError("injected crash")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(SegmentStoreError, match=r"cannot write segment .*new\.seg"):
        store.put("cam", "new", arena(torch.float32))
    with pytest.raises(SegmentStoreError, match="cannot write"):
        store.put("cam", "kept", torch.zeros_like(old))  # an overwrite that fails keeps the old file
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "cam").iterdir()) == ["kept.seg"]  # no temp left
    with pytest.raises(SegmentStoreError, match="missing"):
        store.get("cam", "new")
    assert same_bits(store.get("cam", "kept"), old)


def test_directory_hard_crash_leaves_only_a_temp_file_that_gc_removes(tmp_path: Path) -> None:
    # A real crash: the writer process dies inside os.replace, so no cleanup code runs.
    code = (
        "import os, torch\n"
        "from common.segment_store import DirectoryStore\n"
        "os.replace = lambda *a: os._exit(3)\n"
        f"DirectoryStore({str(tmp_path)!r}).put('cam', 's', torch.ones(2, 2, 1, 4, 8))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, timeout=60)
    assert proc.returncode == 3, proc.stderr.decode()
    store = DirectoryStore(tmp_path)
    left = [p.name for p in (tmp_path / "cam").iterdir()]
    assert len(left) == 1 and left[0].startswith(".s.") and left[0].endswith(".tmp")
    with pytest.raises(SegmentStoreError, match="missing"):
        store.get("cam", "s")
    store.put("cam", "other", arena(torch.float32))
    assert store.gc("cam", ["other"]) == 0  # counts segments; the temp file goes too
    assert [p.name for p in (tmp_path / "cam").iterdir()] == ["other.seg"]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "bitflip", "header"])
def test_directory_corrupt_file_names_the_path(tmp_path: Path, damage: str) -> None:
    store = DirectoryStore(tmp_path)
    store.put("cam", "s", arena(torch.float32))
    path = tmp_path / "cam" / "s.seg"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00not a safetensors file" * 10)
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "bitflip":  # one bit of the payload: only the checksum can tell
        flipped = bytearray(data)
        flipped[-5] ^= 0x10
        path.write_bytes(bytes(flipped))
    else:  # a header that lies about the shape
        path.write_bytes(data.replace(b"\x95\x03\x02\x02", b"\x95\x04\x02\x02", 1))
        assert path.read_bytes() != data
    with pytest.raises(SegmentStoreError, match=re.escape(f"corrupt segment {path}")):
        store.get("cam", "s")


def _rewrite_checksum(path: Path, checksum: dict) -> dict:
    """The record at `path` with its header's checksum field(s) replaced by `checksum` (a function
    of the payload per field name); the header it had."""
    data = path.read_bytes()
    magic, n = struct.unpack_from("<8sI", data)
    meta, payload = msgpack.unpackb(data[12 : 12 + n]), data[12 + n :]
    header = {k: v for k, v in meta.items() if k not in ("crc32", "crc32c")}
    header.update({name: fn(payload) for name, fn in checksum.items()})
    packed = msgpack.packb(header)
    path.write_bytes(struct.pack("<8sI", magic, len(packed)) + packed + payload)
    return meta


def test_segments_carry_crc32c_and_those_written_with_zlibs_crc32_before_are_still_read(tmp_path: Path) -> None:
    """Records are written with CRC-32C; one written with zlib's CRC-32 (every segment before
    2026-11-29: the shared-memory store outlives an upgrade of the worker) is read back whole by
    the store and by the restorer, and a bit flipped in it is still refused. A header naming no
    checksum is corrupt."""
    from encoder_worker.restore import Restorer

    store = DirectoryStore(tmp_path)
    kv = arena(torch.bfloat16, tokens=64)
    store.put("cam", "s", kv)
    path = tmp_path / "cam" / "s.seg"
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    written = _rewrite_checksum(path, {"crc32": zlib.crc32})
    assert written["crc32c"] == crc32c.crc32c(payload) and "crc32" not in written
    restorer = Restorer(torch.device("cpu"), threads=2, slots=1, slot_bytes=1 << 20)
    try:
        assert same_bits(store.get("cam", "s"), kv)
        loaded = restorer.load(store, "cam", ["s"], [])
        assert same_bits(loaded.kv["s"], kv)
        loaded.release()
        flipped = bytearray(path.read_bytes())
        flipped[-7] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(SegmentStoreError, match="checksum mismatch"):
            store.get("cam", "s")
        with pytest.raises(SegmentStoreError, match="checksum mismatch"):
            restorer.load(store, "cam", ["s"], [])
    finally:
        restorer.close()
    store.put("cam", "t", kv)
    _rewrite_checksum(tmp_path / "cam" / "t.seg", {})
    with pytest.raises(SegmentStoreError, match="bad header"):
        store.get("cam", "t")


@pytest.mark.parametrize(
    "fields",
    [
        {"nbytes": 256.0},
        {"nbytes": "256"},
        {"shape": ["1", "2", "1", "4", "8"]},
        {"shape": [-1, 2, -1, 4, 8]},
        {"shape": [True, 2, True, 4, 8]},
        {"crc32c": float("inf")},
        {"nbytes": float("inf")},
        {"shape": [1, 2, 1, 2**63, 8]},
        {"shape": [1, 2, 1, 2**36, 8], "nbytes": 2**36 * 64},  # 4 TB, shape and size agreeing
        {"dtype": ["torch.float32"]},
    ],
)
def test_a_header_of_wellformed_msgpack_but_wrong_values_is_corrupt_never_another_error(tmp_path, fields) -> None:
    """Every value of a header is checked for what a record holds, and the size it claims against
    the file's, before anything is allocated: a record whose header holds a float size, text or a
    bool in its shape, or terabytes, is refused like any damaged one, by the store and by the
    restorer (another error type escaped their callers: a stream never rebuilt, a qa worker that
    crash-looped, `segments save` stopping at a traceback)."""
    from encoder_worker.restore import Restorer

    store = DirectoryStore(tmp_path)
    store.put("cam", "s", arena(torch.float32, tokens=4))
    path = tmp_path / "cam" / "s.seg"
    data = path.read_bytes()
    magic, n = struct.unpack_from("<8sI", data)
    packed = msgpack.packb(msgpack.unpackb(data[12 : 12 + n]) | fields)
    path.write_bytes(struct.pack("<8sI", magic, len(packed)) + packed + data[12 + n :])
    with pytest.raises(SegmentStoreError, match="corrupt segment"):
        store.get("cam", "s")
    restorer = Restorer(torch.device("cpu"), threads=1, slots=1, slot_bytes=1 << 20)
    try:
        with pytest.raises(SegmentStoreError, match="corrupt segment"):
            restorer.load(store, "cam", ["s"], [])
        assert restorer._slots.qsize() == 1, "the slot is back"
    finally:
        restorer.close()


# -- MemoryStore ---------------------------------------------------------------------------


def test_memory_stores_a_compact_copy_not_the_arena() -> None:
    store = MemoryStore()
    a = arena(torch.bfloat16)
    view = a[:, :, :, 4:9]
    store.put("cam", "s", view)
    got = store.get("cam", "s")
    assert torch.equal(got, view)
    assert got.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert got.untyped_storage().nbytes() == view.numel() * view.element_size()  # the arena is not pinned
    assert store.get("cam", "s") is got  # reads share the stored tensor


# -- RedisStore ----------------------------------------------------------------------------


def test_redis_value_ttl_and_corruption(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    store = RedisStore(r, ttl_s=100)
    store.put("cam", "s", arena(torch.bfloat16))
    key = keys.segment("cam", "s")
    assert 0 < r.ttl(key) <= 100
    r.set(key, r.get(key)[:-10])
    with pytest.raises(SegmentStoreError, match=re.escape(f"corrupt segment {key}")):
        store.get("cam", "s")
    assert RedisStore(r).put("cam", "t", arena(torch.float32)) is None and r.ttl(keys.segment("cam", "t")) == -1


def test_redis_gc_touches_only_segment_keys_of_the_stream(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    store = RedisStore(r)
    kv = arena(torch.float32, tokens=1)
    for stream in ("cam*", "camX", "cam"):
        store.put(stream, "s0", kv)
        store.put(stream, "s1", kv)
        r.set(keys.head(stream), b"1")
    assert store.gc("cam*", []) == 2  # a glob character in the name matches only itself
    assert store.gc("cam", ["s1"]) == 1
    assert sorted(k.decode() for k in r.keys("*")) == sorted(
        [keys.head(s) for s in ("cam*", "camX", "cam")]
        + [keys.segment("camX", "s0"), keys.segment("camX", "s1"), keys.segment("cam", "s1")]
    )


# -- open_store ----------------------------------------------------------------------------


def test_open_store_memory_is_one_instance_per_url() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    encoder, qa = open_store(url), open_store(url)
    assert isinstance(encoder, MemoryStore) and encoder is qa
    assert open_store(f"memory://{uuid.uuid4().hex}") is not encoder
    kv = arena(torch.float32)[:, :, :, 1:3]
    encoder.put("cam", "s", kv)
    assert qa.get("cam", "s") is encoder.get("cam", "s")  # one store shared by both roles


def test_open_store_directory(tmp_path: Path) -> None:
    for url in (f"dir://{tmp_path}", str(tmp_path)):
        store = open_store(url)
        assert isinstance(store, DirectoryStore) and store.root == tmp_path and store.durable
    shm = open_store(f"shm://{tmp_path}")
    assert isinstance(shm, DirectoryStore) and shm.root == tmp_path and not shm.durable
    open_store(f"dir://{tmp_path}").put("cam", "s", arena(torch.float32))
    assert exists(open_store(str(tmp_path)), "cam", "s")


def test_open_store_redis(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    given = open_store(redis_url, redis_client=client, ttl_s=50)
    assert isinstance(given, RedisStore) and given.r is client and given.ttl_s == 50
    own = open_store(redis_url)
    kv = arena(torch.bfloat16)
    given.put("cam", "s", kv)
    assert same_bits(own.get("cam", "s"), kv)


@pytest.mark.parametrize("url", ["s3://bucket/x", "http://host/x", ""])
def test_open_store_rejects_unknown_urls(url: str) -> None:
    with pytest.raises(SegmentStoreError, match="unknown segment store URL"):
        open_store(url)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_get_to_cuda(store: SegmentStore) -> None:
    kv = arena(torch.bfloat16)
    store.put("cam", "s", kv)
    got = store.get("cam", "s", device="cuda")
    assert got.is_cuda and same_bits(got.cpu(), kv)


def test_shared_memory_store_writes_no_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """shm:// promises to outlive the process, not the host: nothing is fsynced (a tmpfs would
    ignore it; a disk mounted there by mistake would pay for it at every chunk)."""
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    store = open_store(f"shm://{tmp_path}")
    kv = arena(torch.bfloat16)
    store.put("cam", "s", kv)
    assert synced == [] and same_bits(store.get("cam", "s"), kv)


def test_redis_bitflip_is_refused(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    RedisStore(r).put("cam", "s", arena(torch.float32))
    key = keys.segment("cam", "s")
    data = bytearray(r.get(key))
    data[-3] ^= 1
    r.set(key, bytes(data))
    with pytest.raises(SegmentStoreError, match="checksum"):
        RedisStore(r).get("cam", "s")


def test_full_disk_is_an_outage_and_leaves_no_partial_segment(small_disk: Path) -> None:
    store = DirectoryStore(small_disk)
    small = arena(torch.float32, tokens=16)
    store.put("cam", "kept", small)
    with pytest.raises(StoreUnavailable, match="No space left"):
        store.put("cam", "big", torch.zeros(3, 2, 2, 8192, 8))  # 3 MiB into 1 MiB
    assert sorted(p.name for p in (small_disk / "cam").iterdir()) == ["kept.seg"]  # no temp file left
    assert same_bits(store.get("cam", "kept"), small)
