"""kill -9 at every point of a chunk's persistence (issue 36.7): a real encoder (its `main`, a
tiny random model on the CPU, a real redis-server, the default kind of segment store: a directory
that outlives the process) SIGKILLs itself at a named fault point (`common.faults`, named in
docs/DESIGN.md's version-life table), or is SIGKILLed at random instants while frames flow, and is
restarted each time. Then, from Redis and the store alone:

(a) every frame sent is in exactly one chunk of the stream's history (no frame encoded twice, one
    epoch: nothing started over), and it is in the final head, or in a chunk an eviction the head
    counts took out, or dead-lettered with an event: exactly one of the three;
(b) every segment that the head and the kept versions name is in the store and reads back (its
    CRC checked), and so are the head's chunks' embeddings (exact eviction re-prefills from them);
(c) the head restored as a new owner restores it (`open_stream`: the store read, the engine's restore)
    holds the stored segments bit for bit (keys turned by the manifest's deltas), and its answer
    equals one-shot offline inference on the frames it holds (transformers' own forward).

Exact eviction with a small budget, so that chunks are evicted and re-prefilled every few chunks
and a collection deletes several segments at once (there is a middle of gc to die in).

Lives are forked from one pre-imported parent (`tests.lives`): a cold start costs about 8 s of
imports, a forked life a fraction of a second, which is what lets `test_random_kills` kill 200
times (SVQA_KILLS sets another number; the seed is printed, SVQA_KILL_SEED replays the kill
instants, not the threads' timing). A killed life's lease is deleted once it is reaped: what its
expiry would do `lease_ms` later. The whole file took 3 min 20 s, the 200 kills 2 min 20 s of it, on
a 2-core machine shared with other test runs (load 6-7, 2026-11-28).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from common.engine.answer import GenerationParams, ask
from common.engine.grid import Grid
from common.engine.kvcache import chunk_id
from common.engine.model import load_model
from common.engine.offline import offline_answer
from common.engine.positions import shift_temporal
from common.engine.runtime import Runtime
from common.segment_store import DirectoryStore, SegmentStoreError, embeds_id
from common.segment_writer import SegmentWriter
from common.wire import keys
from common.wire.schemas import FrameMsg, Manifest, SegmentRecord, decode_manifest, encode_frame
from encoder_worker.config import EncoderConfig
from encoder_worker.owned_stream import open_stream
from tests.lives import Lives
from tests.pipeline import head, manifests

CAM = "cam"
BUDGET = 77  # the prefix (45 tokens) and 8 chunks of 4: an eviction every few chunks, down to 3 chunks
KEEP_VERSIONS = 4
SETTINGS = {
    "SVQA_MODEL": "tiny-random",
    "SVQA_DEVICE": "cpu",
    "SVQA_STREAMS": CAM,
    "SVQA_CONSUMER": "enc",  # one name for every life, as a restarted container keeps its host name
    "SVQA_CHUNK_FRAMES": "2",
    "SVQA_BLOCK_MS": "50",
    "SVQA_LEASE_MS": "3000",
    "SVQA_EVICTION": "exact",
    "SVQA_MAX_CACHE_TOKENS": str(BUDGET),
    "SVQA_KEEP_VERSIONS": str(KEEP_VERSIONS),
    "SVQA_VERSIONS_MAXLEN": "1000000",  # the whole history stays, for (a)
    "SVQA_DECODE_PROCESSES": "1",
    "SVQA_LOG_LEVEL": "INFO",
}
TEMPORAL_PATCH = 2  # frames a patch holds (the model's temporal_patch_size)
QUESTION = "What is it?"
WAIT_S = 120.0  # bounds what takes a few seconds on a loaded 2-core machine


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


@pytest.fixture(scope="module")
def lives(_session_redis, tmp_path_factory) -> Iterator[Lives]:
    env = {**os.environ, **SETTINGS, "SVQA_REDIS_URL": _session_redis.url}
    forker = Lives(env, tmp_path_factory.mktemp("lives"))
    try:
        yield forker
    finally:
        forker.close()


class Stream:
    """The camera as the test drives it: frames sent, lives started and ended, the store."""

    def __init__(self, r: redis.Redis, lives: Lives, tmp_path: Path) -> None:
        self.r, self.lives = r, lives
        self.store_dir = tmp_path / "shm"
        self.store = DirectoryStore(self.store_dir, durable=False)
        self.sent: dict[str, int] = {}  # frames entry id -> seq
        self.last_entry: str | None = None
        self.pid: int | None = None
        r.hset(keys.meta(CAM), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})

    def send(self, seqs: range) -> None:
        for seq in seqs:
            msg = FrameMsg.from_rgb(seq, seq / 2, seq / 2, frame(seq))
            self.last_entry = self.r.xadd(keys.frames(CAM), encode_frame(msg)).decode()
            self.sent[self.last_entry] = seq

    def start(self, kill_at: str | None = None) -> None:
        self.pid = self.lives.start(kill_at, SVQA_SEGMENT_STORE=f"shm://{self.store_dir}")

    def died(self) -> int:
        """Wait for the life to end by itself; how it ended."""
        code = self.lives.wait(self.pid, WAIT_S)
        self._reaped()
        return code

    def kill(self) -> int:
        code = self.lives.kill(self.pid)
        self._reaped()
        return code

    def _reaped(self) -> None:
        self.pid = None
        self.r.delete(keys.lease(CAM))  # what its expiry does, lease_ms later

    def finish(self) -> None:
        """A life without a fault point until every frame sent is handled, then stopped. A frame
        dead-lettered shifts the chunks by one: a last frame alone then gets the next one sent."""
        self.start()
        deadline, alone_since = time.monotonic() + WAIT_S, None
        while (pending := self.unhandled()) != 0:
            if time.monotonic() > deadline:
                code = self.kill()
                raise AssertionError(f"frames not all handled (the life: {code})\n{self.logs()}")
            alone_since = (alone_since or time.monotonic()) if pending == 1 else None
            if alone_since and time.monotonic() - alone_since > 1.0:
                self.send(range(max(self.sent.values()) + 1, max(self.sent.values()) + 2))
                alone_since = None
            time.sleep(0.02)
        assert self.kill() == -9

    def unhandled(self) -> int | None:
        """Frames read by the encoder and not acked (dead-lettered ones are acked too); None until
        it has read every frame sent."""
        try:
            (group,) = [g for g in self.r.xinfo_groups(keys.frames(CAM)) if g["name"] == keys.ENCODER_GROUP.encode()]
        except (redis.ResponseError, ValueError):
            return None
        return group["pending"] if group["last-delivered-id"].decode() == self.last_entry else None

    def logs(self) -> str:
        lives = range(max(1, self.lives.count - 2), self.lives.count + 1)  # the last three
        return "\n".join(f"== life {i}\n{self.lives.log(i).read_text()[-3000:]}" for i in lives)


def frame(seq: int) -> np.ndarray:
    return np.random.default_rng(seq).integers(0, 256, (56, 56, 3), dtype=np.uint8)


@pytest.fixture
def stream(redis_url, lives, tmp_path) -> Iterator[Stream]:
    s = Stream(redis.Redis.from_url(redis_url), lives, tmp_path)
    try:
        yield s
    finally:
        if s.pid is not None:
            s.kill()


# -- the invariants ----------------------------------------------------------------------------------
def encoder_events(r: redis.Redis, kind: str) -> list[dict]:
    return [f for _, f in r.xrange(keys.events(CAM)) if f[b"type"] == kind.encode()]


def dead_lettered(s: Stream) -> set[int]:
    return {s.sent[f[b"entry_id"].decode()] for f in encoder_events(s.r, "dead_letter")}


def chunk_frames(seg: SegmentRecord, dead: set[int]) -> list[int]:
    """The seqs a chunk was encoded from: its range, less frames dead-lettered inside it, as many as
    its patches hold (the manifest records the first and last seq, and the padding)."""
    frames = [seq for seq in range(seg.frame_seqs[0], seg.frame_seqs[1] + 1) if seq not in dead]
    assert len(frames) == seg.n_patches * TEMPORAL_PATCH - seg.padded_frames, f"{seg.id}: a frame unaccounted for"
    return frames


def check_frames(s: Stream) -> None:
    """(a): each frame sent is in exactly one of: the head, a chunk evicted, a dead letter."""
    history = manifests(s.r, CAM)
    final = head(s.r, CAM)
    assert {m.epoch for m in history} == {final.epoch}, "one life of the cache: nothing started over"
    dead = dead_lettered(s)
    chunks: dict[str, list[int]] = {}  # chunk id -> its frame seqs, over every version
    for m in history:
        for seg in m.segments[1:]:
            assert chunks.setdefault(chunk_id(seg.id), chunk_frames(seg, dead)) == chunk_frames(seg, dead), seg.id
    owners: dict[int, list[str]] = {}
    for cid, seqs in chunks.items():
        for seq in seqs:
            owners.setdefault(seq, []).append(cid)
    twice = {seq: cids for seq, cids in owners.items() if len(cids) > 1}
    assert not twice, f"frames encoded into more than one chunk: {twice}"
    in_head = {chunk_id(seg.id) for seg in final.segments[1:]}
    evicted = set(chunks) - in_head
    assert len(evicted) == final.evicted_segments, "every chunk gone from the head went by an eviction it counts"
    cached = {seq for seq, (cid,) in owners.items() if cid in in_head}
    gone = {seq for seq, (cid,) in owners.items() if cid in evicted}
    assert not encoder_events(s.r, "dropped"), "a file's frames are never late, nor behind"
    assert not (dead & set(owners)), f"dead-lettered yet in the cache: {sorted(dead & set(owners))}"
    sent = set(s.sent.values())
    assert cached | gone | dead == sent, f"frames lost: {sorted(sent - cached - gone - dead)}"
    assert (cached | gone) == set(owners), "only frames sent are in the cache"


def kept_manifests(r: redis.Redis) -> list[Manifest]:
    """The head, then the versions the writer keeps the segments of (the newest `keep_versions`)."""
    newest = r.xrevrange(keys.versions(CAM), count=KEEP_VERSIONS)
    return [head(r, CAM), *(decode_manifest(fields) for _, fields in newest)]


def check_store(s: Stream) -> None:
    """(b): what the head and the kept versions name is stored, whole."""
    kept = kept_manifests(s.r)
    named = {sid: m.version for m in reversed(kept) for sid in m.segment_ids}
    named |= {embeds_id(chunk_id(seg.id)): kept[0].version for seg in kept[0].segments[1:]}
    unreadable = {}
    for sid, version in named.items():
        try:
            s.store.get(CAM, sid)  # refused if missing, truncated or corrupt (its CRC)
        except SegmentStoreError as e:
            unreadable[sid] = (version, str(e))
    assert not unreadable, f"head {kept[0].version}, kept {[m.version for m in kept[1:]]}: {unreadable}"


def check_restored_head(rt: Runtime, s: Stream) -> None:
    """(c): the head as its next owner restores it equals its manifest's segments, bit for bit, and
    answers as one-shot inference on its frames."""
    manifest = head(s.r, CAM)
    cfg = EncoderConfig(streams=(CAM,), consumer="check", chunk_frames=2, eviction="exact", max_cache_tokens=BUDGET)
    writer = SegmentWriter(s.store, 1)
    try:
        restored = open_stream(rt, s.r, writer, cfg, CAM).engine.head  # the worker's own way in
    finally:
        writer.close()
    assert head(s.r, CAM) == manifest, "restored, not started over"
    assert (restored.id, restored.last_frame_seq) == (manifest.version, manifest.last_frame_seq)
    lm = rt.lm
    for p in restored.placements:
        stored = s.store.get(CAM, p.segment.id)
        keys_now = stored[:, 0]
        if any(p.t_delta):
            shift = torch.tensor(p.t_delta).repeat_interleave(p.segment.tokens_per_patch)
            keys_now = shift_temporal(keys_now, shift, lm.inv_freq, lm.mrope_section)
        held = restored.view.read(p.offset, p.segment.tokens)
        assert torch.equal(held[:, 0], keys_now) and torch.equal(held[:, 1], stored[:, 1]), p.segment.id
    dead = dead_lettered(s)
    kept = [seq for seg in manifest.segments[1:] for seq in chunk_frames(seg, dead)]
    streamed = ask(rt, restored, QUESTION, GenerationParams(max_tokens=6))
    offline = offline_answer(rt, [frame(seq) for seq in kept], Grid(56, 56), 2.0, QUESTION, max_tokens=6)
    assert streamed.token_ids == offline.token_ids


def check_all(rt: Runtime, s: Stream) -> None:
    check_frames(s)
    check_store(s)
    check_restored_head(rt, s)


# -- a kill at each named point -----------------------------------------------------------------------
FRAMES = 40  # 20 chunks: evictions at about chunks 8, 13 and 18


def stored_ids(s: Stream) -> set[str]:
    return {p.stem for p in (s.store_dir / CAM).glob("*.seg")}


def named_ids(s: Stream) -> set[str]:
    named = {sid for m in kept_manifests(s.r) for sid in m.segment_ids}
    return named | {embeds_id(chunk_id(sid)) for sid in named}


def pending(s: Stream) -> int:
    return s.r.xpending(keys.frames(CAM), keys.ENCODER_GROUP)["pending"]


# point (with the pass that kills) -> what the store and Redis show right after the kill
KILLS = {
    "persist.copy_queued:30": lambda s: head(s.r, CAM).last_frame_seq < FRAMES - 1,
    "persist.before_publish:12": lambda s: stored_ids(s) - named_ids(s),  # written, not published
    "persist.before_ack:12": lambda s: pending(s) >= 2,  # published, the chunk's frames not acked
    "persist.mid_gc": lambda s: stored_ids(s) - named_ids(s),  # some unkept segments still there
}


@pytest.mark.parametrize("kill_at", list(KILLS))
def test_a_kill_at_each_point_of_persistence(rt, stream, kill_at):
    stream.send(range(FRAMES))
    stream.start(kill_at)
    assert stream.died() == -9, stream.logs()
    assert KILLS[kill_at](stream), f"the kill at {kill_at} left nothing to recover from\n{stream.logs()}"
    check_store(stream)
    stream.finish()
    check_all(rt, stream)


def test_a_kill_mid_restore(rt, stream):
    """The life that restores dies after reading two of the head's segments; the next one restores."""
    stream.send(range(FRAMES))
    stream.start("persist.before_ack:12")
    assert stream.died() == -9
    before = head(stream.r, CAM)
    stream.start("persist.mid_restore:2")
    assert stream.died() == -9, stream.logs()
    assert head(stream.r, CAM) == before
    stream.finish()
    check_all(rt, stream)


def test_two_lives_in_a_row_killed_before_their_ack_lose_no_frame(rt, stream):
    """Frames pending at two deaths are still encoded: a death costs them one delivery (of
    max_deliveries 3), not two (the claim and the first read of the pending history both counted)."""
    stream.send(range(FRAMES))
    stream.start("persist.before_ack:3")
    assert stream.died() == -9
    stream.start("persist.before_ack:1")
    assert stream.died() == -9
    stream.finish()
    assert not encoder_events(stream.r, "dead_letter")
    check_all(rt, stream)


def test_frames_refused_after_three_deaths_are_dead_lettered_unless_the_cache_holds_them(rt, stream):
    """max_deliveries (3) deaths with frames pending: the next life refuses those frames, and those
    of them already in the cache (published, their ack cut by the kill) are acked as duplicates,
    not also reported dropped. Each life reads 16 entries and publishes one chunk before it dies."""
    stream.send(range(FRAMES))
    for kill_at in ("persist.before_ack:3", "persist.before_ack:1", "persist.before_ack:1"):
        stream.start(kill_at)  # chunks (4, 5), then (6, 7), then (8, 9) published, not acked
        assert stream.died() == -9
    stream.finish()
    assert dead_lettered(stream) == set(range(10, 16)), "read by the three lives that died, and never encoded"
    check_all(rt, stream)


def test_a_new_owners_first_collection_keeps_what_the_kept_versions_name(rt, stream):
    """The restored life's first version evicts (exact: every kept chunk but the sink re-prefilled,
    under new ids); its collection keeps the segments the `keep_versions` newest versions name (a
    mirror may be loading one), not only those of the versions this life published."""
    stream.send(range(FRAMES))
    stream.start("persist.before_ack:8")  # 8 chunks: the cache at its budget; the next one evicts
    assert stream.died() == -9
    stream.start("persist.mid_gc:6")  # several segments deleted, in its first collection or a later one
    assert stream.died() == -9, stream.logs()
    check_store(stream)
    stream.finish()
    check_all(rt, stream)


# -- kills at random instants -------------------------------------------------------------------------
RANDOM_KILLS = int(os.environ.get("SVQA_KILLS", "200"))
FEED_FPS = 20.0  # frames sent a second while no more than BACKLOG wait: a file's ingest, bounded
BACKLOG = 16
LIFE_S = (0.0, 1.0)  # a life is killed this long after it starts: in start-up, restore, encoding, gc


def test_random_kills(rt, stream):
    seed = int(os.environ.get("SVQA_KILL_SEED", random.randrange(1 << 32)))
    print(f"SVQA_KILL_SEED={seed}")
    rng = random.Random(seed)
    stop = threading.Event()
    feeder = threading.Thread(target=feed, args=(stream, stop), daemon=True)
    feeder.start()
    try:
        for _ in range(RANDOM_KILLS):
            stream.start()
            time.sleep(rng.uniform(*LIFE_S))
            assert stream.kill() == -9, stream.logs()
            if head(stream.r, CAM) is not None:
                check_store(stream)
    finally:
        stop.set()
        feeder.join()
    stream.finish()
    check_all(rt, stream)
    dead = dead_lettered(stream)
    final = head(stream.r, CAM)
    print(f"{RANDOM_KILLS} kills: {len(stream.sent)} frames, {len(dead)} dead-lettered, head version {final.version}")
    assert len(stream.sent) > 4 * BACKLOG, "frames flowed: lives encoded between the kills"


def feed(s: Stream, stop: threading.Event) -> None:
    """Frames at FEED_FPS, held back while BACKLOG of them wait for the encoder."""
    seq = 0
    while not stop.wait(1 / FEED_FPS):
        h = head(s.r, CAM)
        if seq - (h.last_frame_seq if h else -1) <= BACKLOG:
            s.send(range(seq, seq + 1))
            seq += 1
