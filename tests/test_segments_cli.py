"""`streamvqa segments save/load`: the shared-memory store carried over a planned reboot through a
directory on a disk, against a real redis-server (the leases a running worker holds)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import redis
import torch

from apps import cli
from common.segment_store import DirectoryStore
from common.wire import keys


def stored(root: Path) -> dict[tuple[str, str], torch.Tensor]:
    """Segments of two streams, as a worker's writer puts them (K/V shaped, bf16)."""
    store = DirectoryStore(root, durable=False)
    segments = {}
    for i, (stream, segment_id) in enumerate([("cam1", "c1-0"), ("cam1", "c1-1"), ("cam2", "prefix")]):
        kv = torch.randn(2, 2, 3, 5 + i, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        store.put(stream, segment_id, kv)
        segments[stream, segment_id] = kv
    return segments


def segments(action: str, saved: Path, shm: Path, redis_url: str, capsys) -> tuple[int, dict]:
    code = cli.main(["segments", action, str(saved), "--segment-store", f"shm://{shm}", "--redis-url", redis_url])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_saved_before_a_reboot_and_loaded_after_the_segments_are_bitwise_the_same(tmp_path, redis_url, capsys):
    shm, saved = tmp_path / "shm", tmp_path / "disk"
    want = stored(shm)
    (shm / "cam1" / ".c1-2.0000.tmp").write_bytes(b"a writer's leftover")  # not a segment: not carried
    code, summary = segments("save", saved, shm, redis_url, capsys)
    assert code == 0 and summary["segments"] == 3 and summary["damaged"] == []
    assert summary["bytes"] == sum(kv.numel() * kv.element_size() for kv in want.values())
    shutil.rmtree(shm)  # the reboot: shared memory is gone
    code, summary = segments("load", saved, shm, redis_url, capsys)
    assert code == 0 and summary["segments"] == 3
    store = DirectoryStore(shm, durable=False)
    for (stream, segment_id), kv in want.items():
        assert torch.equal(store.get(stream, segment_id), kv)
    assert sorted(p.name for p in (shm / "cam1").iterdir()) == ["c1-0.seg", "c1-1.seg"]


def test_a_damaged_segment_is_left_out_and_named_and_the_others_are_loaded(tmp_path, redis_url, capsys):
    shm, saved = tmp_path / "shm", tmp_path / "disk"
    want = stored(shm)
    assert segments("save", saved, shm, redis_url, capsys)[0] == 0
    damaged = saved / "cam1" / "c1-1.seg"
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0x40  # a bit flipped in the payload: its checksum no longer holds
    damaged.write_bytes(bytes(data))
    shutil.rmtree(shm)
    code, summary = segments("load", saved, shm, redis_url, capsys)
    assert code == 1 and summary["segments"] == 2
    assert len(summary["damaged"]) == 1 and summary["damaged"][0].startswith("cam1/c1-1:")
    assert not (shm / "cam1" / "c1-1.seg").exists()  # its stream is rebuilt at restore, as any damaged one's
    assert torch.equal(DirectoryStore(shm).get("cam2", "prefix"), want["cam2", "prefix"])


def test_it_refuses_while_a_worker_holds_a_stream_or_the_store_is_no_directory(tmp_path, redis_url, capsys):
    shm, saved = tmp_path / "shm", tmp_path / "disk"
    stored(shm)
    redis.Redis.from_url(redis_url).set(keys.lease("cam2"), "worker-a", px=60_000)
    with pytest.raises(SystemExit) as held:
        segments("save", saved, shm, redis_url, capsys)
    assert held.value.code == 3 and not saved.exists()
    assert "cam2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as memory:
        cli.main(["segments", "save", str(saved), "--segment-store", "memory://x", "--redis-url", redis_url])
    assert memory.value.code == 2
    for action, saved_at, store in (
        ("load", tmp_path / "none", shm),  # no such directory
        ("load", shm, shm),  # a directory, but no save's (no SAVED)
        ("save", tmp_path / "none", tmp_path / "typo"),  # a store that is no directory: not "0 segments, exit 0"
        ("save", shm / "cam1" / "c1-0.seg", shm),  # DIR a file: one line, not NotADirectoryError's traceback
    ):
        with pytest.raises(SystemExit) as bad:
            cli.main(["segments", action, str(saved_at), "--segment-store", f"shm://{store}", "--redis-url", redis_url])
        assert bad.value.code == 2, (action, saved_at)
    r = redis.Redis.from_url(redis_url)
    r.acl_setuser("noscan", enabled=True, passwords=["+secret-pw"], keys=["*"], commands=["+ping", "+info", "+get"])
    try:
        with pytest.raises(SystemExit) as no_scan:  # a user that may not list the leases (the `client` one)
            segments("save", saved, shm, redis_url.replace("redis://", "redis://noscan:secret-pw@"), capsys)
    finally:
        r.acl_deluser("noscan")
    assert no_scan.value.code == 3 and "secret-pw" not in capsys.readouterr().err


def test_a_save_leaves_only_its_own_segments_and_load_takes_only_a_whole_save(tmp_path, redis_url, capsys):
    """Segment ids repeat across a stream's lives (rebuilt from the frames log, it encodes the same
    seqs again): an earlier save's copy of a segment found damaged now must not be loaded in its
    place, whole and checked but another life's K/V. And a save cut short (no SAVED yet) is no save."""
    shm, saved = tmp_path / "shm", tmp_path / "disk"
    stored(shm)
    assert segments("save", saved, shm, redis_url, capsys)[0] == 0
    store = DirectoryStore(shm, durable=False)
    store.put("cam1", "c1-1", torch.ones(2, 2, 3, 6, 8, dtype=torch.bfloat16))  # the next life's, same id
    (shm / "cam2" / "prefix.seg").unlink()  # and a stream gone since
    damaged = shm / "cam1" / "c1-1.seg"
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0x40
    damaged.write_bytes(bytes(data))
    code, summary = segments("save", saved, shm, redis_url, capsys)  # the next planned reboot, the same DIR
    assert code == 1 and summary["damaged"][0].startswith("cam1/c1-1:")
    assert sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*.seg")) == ["cam1/c1-0.seg"]
    shutil.rmtree(shm)
    code, loaded = segments("load", saved, shm, redis_url, capsys)
    assert code == 0 and (loaded["segments"], loaded["damaged"]) == (1, [])
    assert sorted(p.relative_to(shm).as_posix() for p in shm.rglob("*.seg")) == ["cam1/c1-0.seg"]
    (saved / "SAVED").unlink()  # as if the save had been cut short
    with pytest.raises(SystemExit) as cut:
        segments("load", saved, shm, redis_url, capsys)
    assert cut.value.code == 2


def test_a_full_disk_is_exit_4_with_one_line(tmp_path, redis_url, capsys, small_disk):
    """A real 2 MiB file system saved to: the first segments fit, the next does not."""
    shm = tmp_path / "shm"
    store = DirectoryStore(shm, durable=False)
    for i in range(3):  # 1.5 MB each
        store.put("cam1", f"c1-{i}", torch.zeros(2, 2, 4, 3000, 16, dtype=torch.bfloat16))
    with pytest.raises(SystemExit) as failed:
        segments("save", small_disk, shm, redis_url, capsys)
    assert failed.value.code == 4
    assert "No space left on device" in capsys.readouterr().err


def test_load_leaves_a_segment_the_store_already_holds_whole(tmp_path, redis_url, capsys):
    """A worker started before the load (or no reboot came) wrote a segment since the save, under
    an id the save holds: segment ids repeat across a stream's lives, so the saved copy is an
    older life's K/V, whole and checked. The load must not put it back over the newer one."""
    shm, saved = tmp_path / "shm", tmp_path / "disk"
    want = stored(shm)
    assert segments("save", saved, shm, redis_url, capsys)[0] == 0
    newer = torch.ones(2, 2, 3, 6, 8, dtype=torch.bfloat16)
    DirectoryStore(shm).put("cam1", "c1-1", newer)
    damaged = shm / "cam1" / "c1-0.seg"
    damaged.write_bytes(damaged.read_bytes()[:-10])  # a damaged one is replaced by the saved copy
    (shm / "cam2" / "prefix.seg").unlink()
    code, summary = segments("load", saved, shm, redis_url, capsys)
    assert code == 0 and (summary["segments"], summary["already_held"]) == (2, 1)
    store = DirectoryStore(shm)
    assert torch.equal(store.get("cam1", "c1-1"), newer)
    assert torch.equal(store.get("cam1", "c1-0"), want["cam1", "c1-0"])
    assert torch.equal(store.get("cam2", "prefix"), want["cam2", "prefix"])


def test_save_and_load_keep_the_life_each_segment_names(tmp_path, redis_url, capsys):
    """A record names the stream's life it is K/V of (checked at restore); carried over a reboot,
    it must still name it, or a restore could no longer tell it from another life's."""
    shm, saved = tmp_path / "shm", tmp_path / "disk"
    DirectoryStore(shm).put("cam1", "c1-0", torch.ones(2, 2, 3, 5, 8), epoch="life-1")
    assert segments("save", saved, shm, redis_url, capsys)[0] == 0
    shutil.rmtree(shm)
    assert segments("load", saved, shm, redis_url, capsys)[0] == 0
    with DirectoryStore(shm).open("cam1", "c1-0") as (meta, _, _):
        assert (meta["stream"], meta["epoch"]) == ("cam1", "life-1")
