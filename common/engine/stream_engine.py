"""The streaming engine: frames in, cache versions out. Each frame is encoded exactly once.

Token layout, one continuous video block (exactly what offline Qwen2.5-VL builds for "this
video so far + a question"):

    <|im_start|>system\\n…<|im_end|>\\n<|im_start|>user\\n<|vision_start|>  [chunk][chunk]…

A question appends `<|vision_end|>{question}<|im_end|>\\n<|im_start|>assistant\\n` to a version
(see answer.py). Without eviction a streamed answer therefore equals the offline answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from common.engine.eviction import EvictionPolicy
from common.engine.features import chunk_vector, feature_layers
from common.engine.frames import pad_to_temporal, patchify, stack_frames, video_grid_thw
from common.engine.grid import FrameError, StreamSpec
from common.engine.interleave import between_outputs
from common.engine.kvcache import CacheState, Rebuild, Segment, Version
from common.engine.lm import Item, KVView
from common.engine.phases import phase
from common.engine.pool import Region
from common.engine.positions import text_positions, video_positions
from common.engine.runtime import Runtime
from common.engine.work import BatchWork, fail_all

T = TypeVar("T")

SegmentSink = Callable[[Segment, torch.Tensor], None]
EmbedsSource = Callable[[str], torch.Tensor | None]  # chunk id -> its kept vision embeddings


@dataclass
class Chunk:
    """One chunk on its way to the GPU: its frames on the stream's grid (or embeddings already
    made) and what its segment will record."""

    grid_thw: tuple[int, int, int]
    frame_seqs: tuple[int, int]
    capture_range: tuple[float, float]
    padded_frames: int = 0
    video: torch.Tensor | None = None  # (T, H, W, 3) uint8, patchified on the device (frames.py)
    embeds: torch.Tensor | None = None
    waiting_since: float = math.inf  # time.monotonic() since when its camera waits (BatchWork's)
    deadline: float = math.inf  # time.monotonic() when its camera starts dropping frames (BatchWork's)


@dataclass
class Appended:
    version: Version
    segment: Segment  # the appended chunk's, as first encoded
    new: list[tuple[Segment, torch.Tensor | None]]  # segments the version adds, K/V in host memory
    embeds: torch.Tensor | None = None  # the chunk's vision embeddings in host memory, for `on_embeds`
    features: torch.Tensor | None = None  # the chunk's retrieval vector in host memory, for `on_features`
    copied: torch.cuda.Event | None = None  # the K/V copies to the host are done (see _read_out)


class StreamEngine:
    """One stream's writer: append(chunk of frames) -> new Version (the head).

    `on_segment(segment, kv)` sees each new segment's original K/V (layers, 2, kv_heads, n, hd)
    before it is published, which is where the encoder worker persists it (re-prefilled segments
    of an exact eviction included); it runs in the thread that calls `finish` (never in the GPU
    loop). With exact eviction, `on_embeds(segment, embeds)` sees each chunk's vision embeddings
    likewise, and `on_features(segment, vector)` each chunk's retrieval vector (features.py:
    float16, computed on the device from the chunk's keys as prefilled). `restore` continues a
    stream from a published manifest instead of starting empty; `load_embeds` then gives back the
    kept embeddings of its chunks (exact eviction). A stream started empty gets ``epoch`` on its
    versions; a restored one keeps its manifest's. A ``background`` stream (a temporary cache of
    past frames) is a question's work to the scheduler ("the past" there), not a camera's.
    """

    def __init__(
        self,
        runtime: Runtime,
        spec: StreamSpec,
        policy: EvictionPolicy | None = None,
        *,
        on_segment: SegmentSink | None = None,
        restore: tuple[CacheState, Callable[[Segment], torch.Tensor]] | None = None,
        on_embeds: SegmentSink | None = None,
        load_embeds: EmbedsSource | None = None,
        epoch: str = "",
        background: bool = False,
        on_features: SegmentSink | None = None,
    ):
        self.rt = runtime
        self.background = background  # its chunks yield to every other stream's (work.BatchWork)
        self.spec = spec
        self.cache = runtime.new_cache(spec, policy or EvictionPolicy())
        self.cache.epoch = epoch
        self.on_segment = on_segment
        self.on_embeds = on_embeds
        self.on_features = on_features
        self.feature_layers = feature_layers(runtime.lm.n_layers)
        if restore is None:
            self.finish(runtime.executor.call(self._prefill_prefix))
        else:
            state, load = restore
            runtime.executor.call(lambda: self._restore(state, load, load_embeds))

    @property
    def head(self) -> Version:
        assert self.cache.head is not None
        return self.cache.head

    # -- the caller's side -------------------------------------------------------------
    def append(
        self,
        frames: Sequence[np.ndarray],
        capture_times: Sequence[float] | None = None,
        frame_seqs: Sequence[int] | None = None,
        waiting_since: float = math.inf,
        deadline: float = math.inf,
    ) -> Version:
        """Encode one chunk (any positive count; an odd tail is padded by repeating the last
        frame) and publish the version that contains it. Bad input raises before any state
        changes. `waiting_since`: time.monotonic() since when the chunk has been ready, where that
        was before this call (a live camera's backlog): the scheduler's deadline counts from it.
        `deadline`: when the camera starts dropping frames if the chunk is not done (scheduler.py:
        cameras first)."""
        chunk = self.prepare(frames, capture_times, frame_seqs)
        chunk.waiting_since, chunk.deadline = waiting_since, deadline
        return self.finish(self.submit(chunk).result())

    def append_embeddings(
        self,
        embeds: torch.Tensor,
        n_patches: int,
        frame_seqs: tuple[int, int],
        capture_range: tuple[float, float],
        padded_frames: int = 0,
    ) -> Version:
        """Prefill already-encoded video tokens (n_patches * tokens per patch, in (t, h, w) order)."""
        chunk = Chunk((n_patches, 0, 0), frame_seqs, capture_range, padded_frames, embeds=embeds)
        return self.finish(self.submit(chunk).result())

    def prepare(
        self,
        frames: Sequence[np.ndarray],
        capture_times: Sequence[float] | None = None,
        frame_seqs: Sequence[int] | None = None,
    ) -> Chunk:
        """Validate and stack the frames (CPU work, in the caller's thread)."""
        frames = list(frames)
        if not frames:
            raise FrameError("empty chunk: no frames")
        times = list(capture_times) if capture_times is not None else [0.0] * len(frames)
        first = self.head.last_frame_seq + 1
        seqs = list(frame_seqs) if frame_seqs is not None else list(range(first, first + len(frames)))
        if len(times) != len(frames) or len(seqs) != len(frames):
            raise FrameError(f"{len(frames)} frames but {len(times)} capture times and {len(seqs)} seqs")
        padded, n_pad = pad_to_temporal(frames, self.rt.loaded.temporal_patch_size)
        tp = self.rt.loaded.temporal_patch_size
        video = stack_frames(padded, self.spec.grid, temporal_patch_size=tp, pin_memory=self.rt.device.type == "cuda")
        grid_thw = video_grid_thw(video, temporal_patch_size=tp)
        return Chunk(grid_thw, (seqs[0], seqs[-1]), (float(times[0]), float(times[-1])), n_pad, video=video)

    def submit(self, chunk: Chunk):
        """Queue the chunk for the GPU; the future gives an `Appended` for `finish`."""
        return self.rt.executor.submit(ChunkWork(self, chunk))

    def finish(self, appended: Appended) -> Version:
        """Hand the new segments to `on_segment`, the chunk's embeddings to `on_embeds` (storage
        I/O, outside the GPU loop)."""
        if self.on_embeds is not None and appended.embeds is not None:
            self.on_embeds(appended.segment, appended.embeds)
        if appended.copied is not None:
            appended.copied.synchronize()
        if self.on_features is not None and appended.features is not None:
            self.on_features(appended.segment, appended.features)
        for segment, original in appended.new:
            if self.on_segment is not None and original is not None:
                # The page-locked copy itself, not a clone of it: the sink (the encoder's segment
                # writer) keeps it only until it is written, and torch reuses it once dropped.
                self.on_segment(segment, original)
        return appended.version

    # -- the GPU's side ----------------------------------------------------------------
    def _prefill_prefix(self) -> Appended:
        ids = self.rt.prefix_ids()
        item = self.cache.reserve(len(ids))
        lm = self.rt.lm
        lm.write_kv(lm.embed(ids), text_positions(0, len(ids)), lm.plan([item]))
        segment = Segment(id="prefix", tokens=len(ids))
        original = self._read_out(segment, item.dest.kv, item.at)
        version = self.cache.publish_prefix(segment, video_start=len(ids))
        return Appended(version, segment, [(segment, original)], copied=_copies_done(original))

    def _restore(
        self, state: CacheState, load: Callable[[Segment], torch.Tensor], load_embeds: EmbedsSource | None
    ) -> None:
        self.cache.apply(state, load)
        if self.cache.policy.exact and load_embeds is not None:
            self.cache.keep_embeds(load_embeds)

    def _start(self, chunk: Chunk) -> tuple[Item, torch.Tensor, Segment]:
        """Where the chunk's tokens go and at which positions; the segment it becomes."""
        n_tokens, n_patches = chunk.embeds.shape[0], chunk.grid_thw[0]
        first_patch = self.cache.next_chunk_patch()
        pos = video_positions(self.head.video_start, first_patch, n_patches, *self.cache.grid_hw, self.cache.interval)
        item = self.cache.reserve(n_tokens)
        segment = Segment(
            id=f"f{chunk.frame_seqs[0]:012d}",  # frames enter the cache once, so their seq names the chunk
            tokens=n_tokens,
            first_patch=first_patch,
            n_patches=n_patches,
            frame_seqs=chunk.frame_seqs,
            capture_range=chunk.capture_range,
            padded_frames=chunk.padded_frames,
        )
        return item, pos, segment

    def _appended(
        self,
        before: set[str],
        version: Version,
        segment: Segment,
        original: torch.Tensor | None,
        embeds: torch.Tensor,
        features: torch.Tensor | None = None,
    ) -> Appended:
        """What `finish` hands on once `version` (the chunk's) is published over a head that held
        the segments `before`. `original` is the chunk's K/V as prefilled (read before publishing:
        an eviction may turn it in place); an exact eviction's re-prefilled segments have zero
        deltas, so theirs are where the version holds them."""
        new = []
        for p in version.placements:
            if p.segment.id in before:
                continue
            kv = original if p.segment.id == segment.id else self._read_out(p.segment, version.view, p.offset)
            new.append((p.segment, kv))
        kept = embeds.to("cpu", copy=True) if self.on_embeds is not None and self.cache.policy.exact else None
        return Appended(version, segment, new, kept, features, _copies_done(features, *(kv for _, kv in new)))

    def _read_out(self, segment: Segment, kv: torch.Tensor | KVView, start: int) -> torch.Tensor | None:
        """The segment's original K/V at `start` of `kv`, copied to host memory for `on_segment`.
        From a GPU the copy goes to page-locked memory and is not waited for (`finish` waits, in
        the caller's thread): a blocking copy to pageable memory held the GPU loop up for about
        2 ms a chunk (19 MB). It is queued on the device's stream before anything that may later
        turn those slots in place (an eviction), so it reads them as they were."""
        if self.on_segment is None:
            return None
        n = segment.tokens
        src = kv.read(start, n) if isinstance(kv, KVView) else kv[:, :, :, start : start + n]
        return _to_host(src)

    def _features(self, kv: torch.Tensor, start: int, n: int, positions: torch.Tensor) -> torch.Tensor | None:
        """The chunk's retrieval vector from its keys at `start` of `kv` (rotated at `positions`),
        float16 in host memory for `on_features`, copied like `_read_out`'s K/V."""
        if self.on_features is None:
            return None
        return _to_host(chunk_vector(self.rt, kv[:, :, :, start : start + n], positions, self.feature_layers).half())


def _to_host(src: torch.Tensor) -> torch.Tensor:
    """A copy in host memory; from a GPU into page-locked memory, not waited for (see _copies_done)."""
    if src.device.type != "cuda":
        return src.to("cpu", copy=True)
    return torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src, non_blocking=True)


def _copies_done(*copies: torch.Tensor | None) -> torch.cuda.Event | None:
    """An event after asynchronous copies to the host (None when none was asynchronous)."""
    if not any(c is not None and c.is_pinned() for c in copies):
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class ChunkWork(BatchWork):
    """One chunk of one stream. A batch holds at most one per stream (each writes its stream's
    head) and runs them through one vision forward and one prefill forward. A chunk that sets off
    an exact eviction stays in its lane for more batches, adding one piece of the rebuild to each
    batch's prefill, until the rebuilt version is published; other streams' chunks ride along."""

    def __init__(self, engine: StreamEngine, chunk: Chunk):
        super().__init__()
        self.engine, self.chunk = engine, chunk
        self.lane = engine.spec.name
        self.background = engine.background
        self.waiting_since, self.deadline = chunk.waiting_since, chunk.deadline
        self.started: tuple[Region, int, Segment] | None = None  # where the chunk was prefilled; its segment
        self.original: torch.Tensor | None = None  # its K/V as prefilled, for `on_segment`
        self.positions: torch.Tensor | None = None  # where it was prefilled, for its retrieval vector
        self.features: torch.Tensor | None = None  # its retrieval vector, for `on_features`
        self.rebuild: Rebuild | None = None  # the exact eviction it set off, while being prefilled

    @classmethod
    def run_batch(cls, batch: Sequence[BatchWork]) -> None:
        chunk_work = [j for j in batch if isinstance(j, ChunkWork)]
        if len({id(j.engine) for j in chunk_work}) != len(chunk_work):
            raise ValueError("a batch holds at most one chunk per stream")
        try:
            with phase("vision"):
                _vision(chunk_work)
        except Exception as e:
            fail_all(chunk_work, e)
            return
        # What one stream's cache refuses (no room in the pool for its chunk, or for the copy its
        # eviction needs) fails that stream's chunk alone; the batch goes on without it.
        with phase("inputs"):
            started = _each(chunk_work, ChunkWork._input)
        if not started:
            return
        try:
            lm = chunk_work[0].engine.rt.lm
            inputs = list(started.values())
            with phase("plan"):
                embeds = torch.cat([e for e, _, _ in inputs])
                positions = torch.cat([pos for _, pos, _ in inputs], dim=1)
                plan = lm.plan([item for _, _, item in inputs])
            with phase("prefill"):
                lm.write_kv(embeds, positions, plan)
        except Exception as e:
            fail_all(list(started), e)
            return
        del inputs, started  # their bases hold the heads' pages, which an eviction may now turn in place
        with phase("publish"):
            outputs = _each(chunk_work, ChunkWork._output, between=between_outputs)
        for work, result in outputs.items():
            if result is not None:
                work.future.set_result(result)

    def _input(self) -> tuple[torch.Tensor, torch.Tensor, Item]:
        """What this work adds to the batch's prefill: its chunk, or the next piece of its rebuild."""
        if self.rebuild is not None:
            return self.rebuild.next_piece()
        assert self.chunk.embeds is not None  # made by _vision
        item, positions, segment = self.engine._start(self.chunk)
        self.started, self.positions = (item.dest, item.at, segment), positions
        return self.chunk.embeds, positions, item

    def _output(self) -> Appended | None:
        """After the forward: the result once the chunk's version is published; None while the
        rebuild has pieces left (the head stays the version before the eviction meanwhile)."""
        assert self.started is not None
        cache, (dest, at, segment) = self.engine.cache, self.started
        before = {p.segment.id for p in self.engine.head.placements}
        if self.rebuild is None:
            self.original = self.engine._read_out(segment, dest.kv, at)  # before an eviction turns it
            assert self.positions is not None
            self.features = self.engine._features(dest.kv, at, segment.tokens, self.positions)
            published = cache.publish_chunk(segment, self.chunk.embeds)
            if isinstance(published, Rebuild):
                self.rebuild = published
                return None
            version = published
        elif self.rebuild.finished:
            version = cache.complete(self.rebuild)
        else:
            return None
        return self.engine._appended(before, version, segment, self.original, self.chunk.embeds, self.features)


def _each(
    batch: Sequence[ChunkWork], step: Callable[[ChunkWork], T], between: Callable[[], None] = lambda: None
) -> dict[ChunkWork, T]:
    """`step` of every work not failed yet, by work, with `between()` after each; a work whose step
    raises fails alone."""
    out: dict[ChunkWork, T] = {}
    for work in batch:
        if work.future.done():
            continue
        try:
            out[work] = step(work)
        except Exception as e:
            work.future.set_exception(e)
        between()
    return out


def _vision(batch: Sequence[ChunkWork]) -> None:
    """The vision tower for every chunk still in frames, as one batch."""
    todo = [j.chunk for j in batch if j.chunk.embeds is None]
    if not todo:
        return
    rt = batch[0].engine.rt
    tp = rt.loaded.temporal_patch_size
    pixels = [patchify(c.video.to(rt.device, non_blocking=True), temporal_patch_size=tp) for c in todo]
    for chunk, embeds in zip(todo, rt.vision_batch(pixels), strict=True):
        chunk.embeds = embeds
