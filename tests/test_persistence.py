"""The persistent cache against a real file system, a real tmpfs that fills up and a real
redis-server: segments are written off the stream threads in order, a full disk is an outage
(frames stay pending, readiness says why, writes resume), and a damaged store restarts only the
stream it damaged."""

from __future__ import annotations

import dataclasses
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from common import health, metrics
from common.engine.grid import Grid
from common.engine.model import load_model
from common.engine.pool import PoolFull
from common.engine.runtime import Runtime
from common.segment_store import DirectoryStore, MemoryStore, SegmentStore, SegmentStoreError
from common.segment_writer import SegmentWriter
from common.wire import keys
from common.wire.schemas import FrameMsg, encode_frame, manifest_from_bytes
from encoder_worker.config import EncoderConfig
from encoder_worker.owned_stream import open_stream
from encoder_worker.service import EncoderService
from tests.engine_helpers import make_frames, same_kv

FRAME = np.zeros((56, 56, 3), np.uint8)
WAIT_S = 60.0  # an upper bound for what normally takes well under a second (2 cores, shared)


def kv(tokens: int = 4, value: float = 1.0) -> torch.Tensor:
    return torch.full((2, 2, 1, tokens, 8), float(value))


def wait_for(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def fill(path: Path) -> Path:
    """Take every free byte of the file system at ``path``."""
    filler = path / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


# -- the writer --------------------------------------------------------------------------------
def test_writer_keeps_each_streams_puts_and_collections_in_order(tmp_path):
    """gc(keep) queued between two puts of a stream must see the first and not the second: run
    on another lane it would collect the segment the next version is about to publish."""
    store = DirectoryStore(tmp_path)
    writer = SegmentWriter(store, lanes=4)
    streams = [f"cam{i}" for i in range(8)]
    for step in range(20):
        for cam in streams:
            writer.put(cam, f"s{step}", kv(value=step))
            writer.gc(cam, {f"s{step}", f"s{step - 1}"})  # the last two versions are kept
    writer.close()
    for cam in streams:
        assert sorted(p.name for p in (tmp_path / cam).iterdir()) == ["s18.seg", "s19.seg"]
        assert torch.equal(store.get(cam, "s19"), kv(value=19))


class GatedStore(MemoryStore):
    """A medium slower than the streams: each put waits for the test to open the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Semaphore(0)

    def put(self, stream: str, segment_id: str, kv: torch.Tensor, *, epoch: str | None = None) -> None:
        self.gate.acquire()
        super().put(stream, segment_id, kv, epoch=epoch)


def test_writer_backpressure_holds_the_caller_not_host_memory():
    store = GatedStore()
    one = kv().numel() * 4
    writer = SegmentWriter(store, lanes=1, max_queued_bytes=2 * one)
    first = [writer.put("cam", f"s{i}", kv()) for i in range(2)]  # fills the queue's bound
    third: list = []
    caller = threading.Thread(target=lambda: third.append(writer.put("cam", "s2", kv())))
    caller.start()
    caller.join(0.3)
    assert caller.is_alive() and not third, "a third segment waits for room"
    store.gate.release()  # the medium takes one
    caller.join(WAIT_S)
    assert third and not caller.is_alive()
    store.gate.release()
    store.gate.release()
    assert first[0].result(WAIT_S) is None and third[0].result(WAIT_S) is None
    writer.close()


def test_full_disk_is_retried_with_the_reason_until_space_comes_back(small_disk):
    writer = SegmentWriter(DirectoryStore(small_disk), retry_s=0.01)
    filler = fill(small_disk)
    pending = writer.put("cam", "s", kv(tokens=256))
    wait_for(lambda: writer.problem is not None, "the writer to report the full disk")
    assert "No space left" in writer.problem and not pending.done(), "retried, not failed"
    filler.unlink()
    assert pending.result(WAIT_S) is None and writer.problem is None
    assert torch.equal(DirectoryStore(small_disk).get("cam", "s"), kv(tokens=256))
    writer.close()


# -- the encoder service ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


def service(rt: Runtime, r: redis.Redis, url: str, store: SegmentStore, cams: tuple[str, ...]) -> EncoderService:
    for cam in cams:
        r.hset(keys.meta(cam), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    cfg = EncoderConfig(redis_url=url, streams=cams, consumer="enc", chunk_frames=2, block_ms=50)
    return EncoderService(cfg, rt, r, store)


def push(r: redis.Redis, cam: str, seqs: range) -> None:
    for seq in seqs:
        r.xadd(keys.frames(cam), encode_frame(FrameMsg.from_rgb(seq, seq / 2, seq / 2, FRAME)))


def head(r: redis.Redis, cam: str):
    raw = r.get(keys.head(cam))
    return manifest_from_bytes(raw) if raw is not None else None


def encoded(r: redis.Redis, cam: str, last: int) -> bool:
    """The head holds frames up to ``last`` and none is left pending."""
    h = head(r, cam)
    return h is not None and h.last_frame_seq == last and not pending(r, cam)


def pending(r: redis.Redis, cam: str) -> int:
    return r.xpending(keys.frames(cam), keys.ENCODER_GROUP)["pending"]


def run_until(svc: EncoderService, check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        svc.step()


def stop(svc: EncoderService, r: redis.Redis) -> None:
    """What a crash leaves: the writer's queue finished (it ran), the leases gone (expired)."""
    svc._settle()
    svc.writer.close()
    for name in svc.names:
        r.delete(keys.lease(name))


def encoded_then_stopped(rt: Runtime, r: redis.Redis, url: str, store: SegmentStore, frames: int) -> None:
    """Camera "cam"'s first `frames` frames encoded into `store` by a service, which then stops."""
    svc = service(rt, r, url, store, ("cam",))
    push(r, "cam", range(frames))
    run_until(svc, lambda: encoded(r, "cam", frames - 1), f"{frames} frames")
    stop(svc, r)


def events(r: redis.Redis, cam: str, kind: bytes) -> list[dict]:
    return [f for _, f in r.xrange(keys.events(cam)) if f[b"type"] == kind]


def test_a_damaged_segment_restarts_its_stream_alone(rt, redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    store = DirectoryStore(tmp_path)
    cams = ("hurt", "fine")
    svc = service(rt, r, redis_url, store, cams)
    for cam in cams:
        push(r, cam, range(6))
    run_until(svc, lambda: all(encoded(r, c, 5) for c in cams), "6 frames each")
    stop(svc, r)
    fine = head(r, "fine")
    seg = tmp_path / "hurt" / f"{head(r, 'hurt').segment_ids[-1]}.seg"
    seg.write_bytes(seg.read_bytes()[:-100])  # truncated, as by a crash of the host mid-write

    again = service(rt, r, redis_url, store, cams)  # neither exits nor refuses the other stream
    run_until(again, lambda: set(again.owned) == set(cams), "both streams owned")
    assert head(r, "fine").version == fine.version and again.owned["fine"].engine.head.id == fine.version
    (restarted,) = events(r, "hurt", b"cache_restarted")
    assert b"corrupt segment" in restarted[b"reason"]
    assert head(r, "hurt").last_frame_seq == -1, "started over: an empty cache, not a wrong one"
    push(r, "hurt", range(6, 10))
    push(r, "fine", range(6, 10))
    run_until(again, lambda: all(encoded(r, c, 9) for c in cams), "both streams go on")
    stop(again, r)


def test_a_wiped_store_restarts_every_stream_without_a_crash_loop(rt, redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    store = DirectoryStore(tmp_path / "segments")
    encoded_then_stopped(rt, r, redis_url, store, 4)
    subprocess.run(["rm", "-rf", str(tmp_path / "segments")], check=True)  # the host rebooted: tmpfs gone
    for _ in range(3):  # each start finds the same store: none exits
        again = service(rt, r, redis_url, store, ("cam",))
        run_until(again, lambda s=again: "cam" in s.owned, "the stream owned")
        stop(again, r)
    assert len(events(r, "cam", b"cache_restarted")) == 1, "only the first start found a head it could not restore"


def test_a_head_read_into_a_restore_slot_is_bitwise_its_segments_and_damage_is_refused(rt, redis_url, tmp_path):
    """The restorer reads a head's segments with fewer readers than segments into its slot, those
    that do not fit (a slot of half the head) into memory of their own, checking each piece by
    piece; the oracle is the store's own reader. A bit flipped anywhere, or a truncated segment,
    is refused, and the slot is back for the next head; a released slot is reused."""
    from common.wire.manifest import from_manifest
    from encoder_worker.restore import Restorer

    r = redis.Redis.from_url(redis_url)
    store = DirectoryStore(tmp_path)
    encoded_then_stopped(rt, r, redis_url, store, 8)
    cache = from_manifest(head(r, "cam")).cache
    ids = [p.segment.id for p in cache.placements]
    stored = {sid: store.get("cam", sid) for sid in ids}
    nbytes = sum(t.numel() * t.element_size() for t in stored.values())
    assert len(ids) > 3
    restorer = Restorer(torch.device("cpu"), threads=3, slots=1, slot_bytes=nbytes // 2)
    try:
        for _ in range(2):  # the second into the slot the first released
            loaded = restorer.load_head(store, "cam", cache)
            assert list(loaded.kv) == ids and loaded.nbytes == nbytes
            in_slot = [t for t in loaded.kv.values() if t.untyped_storage().nbytes() > t.numel() * t.element_size()]
            assert 0 < len(in_slot) < len(ids), "some in the slot, the rest in memory of their own"
            for sid in ids:
                got, want = loaded.kv[sid], stored[sid]
                assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                assert torch.equal(loaded.to(got, torch.device("cpu")), got)
            loaded.release()

        damaged = tmp_path / "cam" / f"{ids[-1]}.seg"
        whole = damaged.read_bytes()
        flipped = bytearray(whole)
        flipped[-1500] ^= 0x10  # in the payload
        for bad, error in ((bytes(flipped), "checksum mismatch"), (whole[:-100], "bytes")):
            damaged.write_bytes(bad)
            with pytest.raises(SegmentStoreError, match=error):
                restorer.load_head(store, "cam", cache)
            assert restorer._slots.qsize() == 1, "the slot is back"
        damaged.write_bytes(whole)
        assert torch.equal(restorer.load_head(store, "cam", cache).kv[ids[-1]], stored[ids[-1]])
    finally:
        restorer.close()


def test_full_disk_keeps_frames_pending_and_fails_readiness_until_space_returns(rt, redis_url, small_disk):
    r = redis.Redis.from_url(redis_url)
    svc = service(rt, r, redis_url, DirectoryStore(small_disk), ("cam",))
    svc.writer.retry_s = 0.01
    health.READINESS.redis_url = redis_url
    try:
        push(r, "cam", range(2))
        run_until(svc, lambda: encoded(r, "cam", 1), "a first chunk")
        filler = fill(small_disk)
        push(r, "cam", range(2, 6))
        run_until(svc, lambda: svc.writer.problem is not None, "the full disk")
        ready, body = health.READINESS.check()
        assert not ready and "No space left" in body["reasons"]["segment_store"]
        for _ in range(20):
            svc.step()
        assert head(r, "cam").last_frame_seq == 1 and pending(r, "cam") > 0, "nothing acked, nothing published"
        assert not r.exists(keys.DEAD_LETTER), "an outage, not bad frames"
        filler.unlink()
        run_until(svc, lambda: encoded(r, "cam", 5), "the frames encoded")
        assert health.READINESS.check()[0]
        for sid in head(r, "cam").segment_ids:  # every segment the head names is stored
            DirectoryStore(small_disk).get("cam", sid)
    finally:
        health.READINESS.failing.pop("segment_store", None)
        stop(svc, r)


# -- kill -9 while chunks are being persisted -------------------------------------------------------
KILLS = 6


def test_encoder_killed_at_random_points_keeps_every_frame_once_and_every_head_whole(redis_url, tmp_path, rt):
    """`streamvqa encoder` on the default kind of store (shm://, here a directory of the test's own)
    SIGKILLed at random moments while a file streams in (wherever a kill lands: a segment queued,
    written but unpublished, published but unacked, mid-collection, mid-restore), restarted each
    time. Every frame of the file ends in the cache exactly once, every head's segments are stored
    whole (checksummed), and the answer from the head as restored from the store equals one-shot
    offline inference on the frames it holds."""
    import random

    from apps.samplevideo import write_sample_video
    from common.engine.answer import GenerationParams, ask
    from common.engine.grid import Grid
    from common.engine.offline import offline_answer
    from ingest.video import iter_file_frames
    from qa_worker.mirror import StreamMirror
    from tests.pipeline import Services, chunk_frames_in_history, manifests, wait_for

    video = write_sample_video(str(tmp_path / "clip.mp4"), seconds=12, fps=10, width=160, height=120)
    store_dir = tmp_path / "shm"
    services = Services(redis_url, tmp_path, SVQA_STREAMS="cam1", SVQA_SEGMENT_STORE=f"shm://{store_dir}")
    r = redis.Redis.from_url(redis_url)
    encoder_args = ("--chunk-frames", "2", "--lease-ms", "1500")
    rng = random.Random(7)
    try:
        feeder = services.start("ingest", "--url", video, "--stream", "cam1", "--fps", "2", "--max-backlog", "4")
        encoder = services.start("encoder", *encoder_args)
        for _ in range(KILLS):
            wait_for(lambda: r.exists(keys.head("cam1")), 120, "a head", services)
            time.sleep(rng.uniform(0.0, 3.0))
            encoder.kill()  # SIGKILL: no cleanup; the lease runs out, the restart takes over
            encoder.wait()
            encoder = services.start("encoder", *encoder_args)
        assert feeder.wait(timeout=240) == 0, services.logs()
        wait_for(
            lambda: (m := r.get(keys.head("cam1"))) and manifest_from_bytes(m).last_frame_seq == 23,
            240,
            "all",
            services,
        )
    finally:
        services.stop_all()
    assert chunk_frames_in_history(r, "cam1") == list(range(24)), "every frame in exactly one chunk"
    store = DirectoryStore(store_dir, durable=False)
    recent = manifests(r, "cam1")[-3:]
    for m in recent:  # the newest versions a mirror may still be asked for: every segment stored whole
        for sid in m.segment_ids:
            store.get("cam1", sid)
    restored = StreamMirror(rt, store, "cam1").apply(head(r, "cam1"))
    meta = r.hgetall(keys.meta("cam1"))
    frames = [f.rgb for f in iter_file_frames(video, 2.0, grid=Grid(int(meta[b"height"]), int(meta[b"width"])))]
    offline = offline_answer(
        rt, frames[:24], Grid(int(meta[b"height"]), int(meta[b"width"])), 2.0, "What is it?", max_tokens=6
    )
    streamed = ask(rt, restored, "What is it?", GenerationParams(max_tokens=6))
    assert streamed.token_ids == offline.token_ids


# -- no KV room for a chunk: backpressure, not bad frames -----------------------------------------------
def _budget_cfg(rt: Runtime, url: str, cams: tuple[str, ...], **kw) -> EncoderConfig:
    """Chunks of 4 frames (8 tokens at 56x56); a cache of the prefix and 8 chunks, evicted to 4."""
    prefix = len(rt.prefix_ids())
    budget = prefix + 64
    return EncoderConfig(
        redis_url=url,
        streams=cams,
        consumer="enc",
        chunk_frames=4,
        block_ms=50,
        max_cache_tokens=budget,
        low_watermark=(prefix + 32) / budget,
        **kw,
    )


def _refusing_whole_caches(rt: Runtime, budget: int, monkeypatch) -> list[int]:
    """The pool refuses regions of a whole cache (the copy an eviction beside a held version needs)
    until the test undoes the patch; the sizes refused are recorded."""
    alloc, refused = rt.pool.alloc, []

    def no_room_for_a_cache(n_tokens: int):
        if n_tokens >= budget:
            refused.append(n_tokens)
            raise PoolFull(f"no room for {n_tokens} more KV tokens (test)")
        return alloc(n_tokens)

    monkeypatch.setattr(rt.pool, "alloc", no_room_for_a_cache)
    return refused


def test_a_chunk_without_kv_room_waits_for_it_and_no_frame_is_dropped(rt, redis_url, monkeypatch):
    """A question holding a stream's version when its next chunk evicts makes that eviction copy the
    cache; with no room in the pool for the copy the chunk is refused (`PoolFull`). That is
    backpressure: its frames stay pending (nothing dead-lettered, nothing published), the chunk is
    tried again, and once room returns the stream's cache is exactly one fed without the refusal."""
    r = redis.Redis.from_url(redis_url)
    cams = ("cam", "same")
    for cam in cams:
        r.hset(keys.meta(cam), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    cfg = _budget_cfg(rt, redis_url, cams)
    svc = EncoderService(cfg, rt, r, MemoryStore())
    frames = make_frames(40, Grid(56, 56), seed=3)

    def send(cam: str, seqs: range) -> None:
        for s in seqs:
            r.xadd(keys.frames(cam), encode_frame(FrameMsg.from_rgb(s, s / 2, s / 2, frames[s])))

    waited = metrics.CHUNKS_WAITED_FOR_ROOM.labels("cam")._value.get()
    try:
        send("cam", range(32))
        run_until(svc, lambda: encoded(r, "cam", 31), "the cache at its budget")
        held = svc.owned["cam"].engine.head  # a question's version: the next eviction must copy
        refused = _refusing_whole_caches(rt, cfg.max_cache_tokens, monkeypatch)
        send("cam", range(32, 36))
        run_until(svc, lambda: len(refused) >= 3, "the chunk refused and tried again")
        assert events(r, "cam", b"waiting_for_kv_room"), "operators are told"
        assert head(r, "cam").last_frame_seq == 31 and pending(r, "cam") == 4, "nothing published, nothing acked"
        monkeypatch.undo()  # room again
        run_until(svc, lambda: encoded(r, "cam", 35), "the chunk encoded once room returned")
        send("same", range(36))  # the same frames, never refused
        run_until(svc, lambda: encoded(r, "same", 35), "the stream fed without the refusal")
        got, want = svc.owned["cam"].engine.head, svc.owned["same"].engine.head
        assert got.stats.evictions == want.stats.evictions == 1 and same_kv(got, want)
        assert held.last_frame_seq == 31, "the held version is as it was"
        assert not r.exists(keys.DEAD_LETTER), "backpressure, not bad frames"
        assert len(events(r, "cam", b"waiting_for_kv_room")) == 1, "one event an episode"
        assert metrics.CHUNKS_WAITED_FOR_ROOM.labels("cam")._value.get() == waited + 1
        assert not svc.owned["cam"].dropped
    finally:
        monkeypatch.undo()
        stop(svc, r)


def test_a_live_chunk_waits_for_kv_room_no_longer_than_its_deadline(rt, redis_url, monkeypatch):
    """A live chunk that finds no room until its frames would be `max_lag_s` old drops them as
    `late` (what a camera behind does anyway), not as bad frames; the stream goes on after."""
    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("live"), mapping={"fps": 2, "height": 56, "width": 56, "live": 1})
    r.set(keys.lease("live"), "enc")
    r.xgroup_create(keys.frames("live"), keys.ENCODER_GROUP, id="0", mkstream=True)
    cfg = _budget_cfg(rt, redis_url, ("live",), max_lag_s=60.0)
    owned = open_stream(rt, r, SegmentWriter(MemoryStore()), cfg, "live")
    frames, now = make_frames(40, Grid(56, 56), seed=4), time.time()

    def add(seqs: range) -> None:
        for s in seqs:
            msg = FrameMsg.from_rgb(s, now - 20 + s / 2, s / 2, frames[s])
            owned.add(r.xadd(keys.frames("live"), encode_frame(msg)).decode(), msg)

    add(range(32))
    assert owned.engine.head.last_frame_seq == 31
    held = owned.engine.head  # a question's version: the next eviction must copy
    _refusing_whole_caches(rt, cfg.max_cache_tokens, monkeypatch)
    owned.cfg = dataclasses.replace(cfg, max_lag_s=5.5)  # the last frame (2.5 s old) has about 3 s left
    t0 = time.monotonic()
    add(range(32, 36))
    assert 1.5 < time.monotonic() - t0 < 5.0, "waited, up to the chunk's deadline"
    assert owned.dropped["late"] == 4 and not owned.pending
    assert owned.engine.head.last_frame_seq == held.last_frame_seq == 31
    assert not r.exists(keys.DEAD_LETTER), "late, not bad"
    assert r.xpending(keys.frames("live"), keys.ENCODER_GROUP)["pending"] == 0, "the dropped frames are acked"
    monkeypatch.undo()
    owned.cfg = cfg
    add(range(36, 40))
    assert owned.engine.head.last_frame_seq == 39


def test_a_chunk_finished_after_the_writer_closed_stays_pending_for_the_next_owner(rt, redis_url, tmp_path):
    """A stopping worker closes its segment writer once its tasks settle (or their wait runs out);
    a chunk finishing after that cannot store its segment. That is the worker stopping, not bad
    frames: they stay pending for the next owner, nothing is dead-lettered, the head stays where it
    was (an H200 worker stopping beside 64 cameras dead-lettered 168 frames as `chunk failed`)."""
    r = redis.Redis.from_url(redis_url)
    svc = service(rt, r, redis_url, DirectoryStore(tmp_path), ("cam",))
    push(r, "cam", range(4))
    run_until(svc, lambda: encoded(r, "cam", 3), "4 frames")
    svc._settle()
    svc.writer.close()  # the stop's order: tasks settled, then the writer
    push(r, "cam", range(4, 8))
    run_until(svc, lambda: svc.owned["cam"].lost, "the chunk met the closed writer")
    svc._settle()
    assert head(r, "cam").last_frame_seq == 3 and pending(r, "cam") == 4, "nothing published, nothing acked"
    assert not r.exists(keys.DEAD_LETTER)

    again = service(rt, r, redis_url, DirectoryStore(tmp_path), ("cam",))  # the next owner
    r.delete(keys.lease("cam"))
    run_until(again, lambda: encoded(r, "cam", 7), "the pending frames encoded by the next owner")


def test_a_store_root_replaced_by_a_file_is_an_outage_not_each_streams_damage(rt, redis_url, tmp_path):
    """The store's directory gone and a file in its place (or a store the worker may not write)
    fails every stream alike: writes are retried and readiness names why, instead of each stream
    restarting its cache and failing its write again at every lease, readiness green."""
    r = redis.Redis.from_url(redis_url)
    root = tmp_path / "segments"
    store = DirectoryStore(root)
    encoded_then_stopped(rt, r, redis_url, store, 4)
    subprocess.run(["rm", "-rf", str(root)], check=True)
    root.write_text("not a directory")
    svc = service(rt, r, redis_url, store, ("cam",))
    svc.writer.retry_s = 0.01
    try:
        run_until(svc, lambda: svc.writer.problem is not None, "the outage")
        assert "Not a directory" in health.READINESS.failing["segment_store"]
        assert not events(r, "cam", b"store_write_failed"), "an outage, not a failed write"
        root.unlink()
        run_until(svc, lambda: "cam" in svc.owned and svc.writer.problem is None, "the store back")
        push(r, "cam", range(4, 6))
        run_until(svc, lambda: encoded(r, "cam", 5), "the stream goes on")
        assert len(events(r, "cam", b"cache_restarted")) == 1, "its segments were gone: one restart, no loop"
    finally:
        health.READINESS.failing.pop("segment_store", None)
        stop(svc, r)


def push_valued(r: redis.Redis, cam: str, seqs: range, value: int) -> None:
    for seq in seqs:
        frame = np.full((56, 56, 3), value, np.uint8)
        r.xadd(keys.frames(cam), encode_frame(FrameMsg.from_rgb(seq, seq / 2, seq / 2, frame)))


def life(rt: Runtime, r: redis.Redis, url: str, store: SegmentStore, cams: tuple[str, ...], value: int) -> None:
    """Frames 0-3 of `value` encoded for each camera into `store`, then the service stops."""
    svc = service(rt, r, url, store, cams)
    for cam in cams:
        push_valued(r, cam, range(4), value)
    run_until(svc, lambda: all(encoded(r, c, 3) for c in cams), "4 frames each")
    stop(svc, r)


def test_a_head_is_not_restored_from_another_lifes_or_streams_valid_segments(rt, redis_url, tmp_path):
    """Segment ids repeat across streams and lives (a stream restarted on an empty Redis encodes
    seqs 0.. again): a head of an earlier life (Redis brought back from an older backup) over the
    later life's segments, or a segment of another stream copied in, is whole, checked and of the
    right shape. Restored, the head held K/V other than its manifest names, with no event."""
    r = redis.Redis.from_url(redis_url)
    store = DirectoryStore(tmp_path)
    life(rt, r, redis_url, store, ("cam",), 10)
    earlier = r.get(keys.head("cam"))
    r.flushdb()  # Redis lost without its AOF: the stream starts over, under a new epoch
    life(rt, r, redis_url, store, ("cam", "other"), 200)
    assert manifest_from_bytes(earlier).segment_ids == head(r, "cam").segment_ids, "the same ids"
    later, other = head(r, "cam"), head(r, "other")
    r.set(keys.head("cam"), earlier)  # the older backup
    again = service(rt, r, redis_url, store, ("cam",))
    run_until(again, lambda: "cam" in again.owned, "the stream owned")
    stop(again, r)
    (restarted,) = events(r, "cam", b"cache_restarted")
    assert later.epoch.encode() in restarted[b"reason"], "refused as the later life's K/V"
    from encoder_worker.restore import Restorer

    (tmp_path / "cam" / "f1.seg").write_bytes((tmp_path / "other" / f"{other.segment_ids[-1]}.seg").read_bytes())
    restorer = Restorer(torch.device("cpu"), threads=1)  # copied in by hand: refused even with its epoch
    try:
        with pytest.raises(SegmentStoreError, match="holds stream 'other'"):
            restorer.load(store, "cam", ["f1"], [], other.epoch)
    finally:
        restorer.close()
