"""The streaming engine: frames in, cache versions out. Each frame is encoded exactly once.

Token layout, one continuous video block (exactly what offline Qwen2.5-VL builds for "this
video so far + a question"):

    <|im_start|>system\\n…<|im_end|>\\n<|im_start|>user\\n<|vision_start|>  [chunk][chunk]…

A question appends `<|vision_end|>{question}<|im_end|>\\n<|im_start|>assistant\\n` to a version
(see answer.py). Without eviction a streamed answer therefore equals the offline answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from common.engine.eviction import EvictionPolicy
from common.engine.frames import frames_to_pixels, pad_to_temporal
from common.engine.grid import FrameError, StreamSpec
from common.engine.kvcache import CacheState, Segment, Version
from common.engine.positions import text_positions, video_positions
from common.engine.runtime import Runtime

SegmentSink = Callable[[Segment, torch.Tensor], None]


class StreamEngine:
    """One stream's writer: append(chunk of frames) -> new Version (the head).

    `on_segment(segment, kv)` sees each new segment's original K/V (layers, 2, kv_heads, n, hd)
    before it is published, which is where the encoder worker persists it. `restore` continues
    a stream from a published manifest instead of starting empty.
    """

    def __init__(
        self,
        runtime: Runtime,
        spec: StreamSpec,
        policy: EvictionPolicy | None = None,
        *,
        on_segment: SegmentSink | None = None,
        restore: tuple[CacheState, Callable[[Segment], torch.Tensor]] | None = None,
    ):
        self.rt = runtime
        self.spec = spec
        self.cache = runtime.new_cache(spec, policy or EvictionPolicy())
        self.on_segment = on_segment
        if restore is None:
            self._prefill_prefix()
        else:
            state, load = restore
            with self.rt.gpu_lock:
                self.cache.apply(state, load)

    @property
    def head(self) -> Version:
        assert self.cache.head is not None
        return self.cache.head

    def _prefill_prefix(self) -> None:
        ids = self.rt.prefix_ids()
        with self.rt.gpu_lock:
            kv, start = self.cache.reserve(len(ids))
            self.rt.lm.forward(self.rt.lm.embed(ids), text_positions(0, len(ids)), kv, start)
            segment = Segment(id="prefix", tokens=len(ids))
            original = self._read_out(segment, kv, start)
        self._emit(segment, original)
        self.cache.publish_prefix(segment, video_start=len(ids))

    def _read_out(self, segment: Segment, kv: torch.Tensor, start: int) -> torch.Tensor | None:
        """The segment's original K/V, copied to host memory for `on_segment` (slow storage I/O then
        happens outside the GPU lock)."""
        if self.on_segment is None:
            return None
        return kv[:, :, :, start : start + segment.tokens].to("cpu", copy=True)

    def _emit(self, segment: Segment, original: torch.Tensor | None) -> None:
        if self.on_segment is not None and original is not None:
            self.on_segment(segment, original)

    def append(
        self,
        frames: Sequence[np.ndarray],
        capture_times: Sequence[float] | None = None,
        frame_seqs: Sequence[int] | None = None,
    ) -> Version:
        """Encode one chunk (any positive count; an odd tail is padded by repeating the last
        frame) and publish the version that contains it. Bad input raises before any state
        changes."""
        frames = list(frames)
        if not frames:
            raise FrameError("empty chunk: no frames")
        times = list(capture_times) if capture_times is not None else [0.0] * len(frames)
        first = self.head.last_frame_seq + 1
        seqs = list(frame_seqs) if frame_seqs is not None else list(range(first, first + len(frames)))
        if len(times) != len(frames) or len(seqs) != len(frames):
            raise FrameError(f"{len(frames)} frames but {len(times)} capture times and {len(seqs)} seqs")
        padded, n_pad = pad_to_temporal(frames, self.rt.loaded.temporal_patch_size)
        pixels, grid_thw = frames_to_pixels(padded, self.spec.grid)
        with self.rt.gpu_lock:
            embeds = self.rt.vision(pixels, grid_thw)
        return self.append_embeddings(embeds, grid_thw[0], (seqs[0], seqs[-1]), (times[0], times[-1]), n_pad)

    def append_embeddings(
        self,
        embeds: torch.Tensor,
        n_patches: int,
        frame_seqs: tuple[int, int],
        capture_range: tuple[float, float],
        padded_frames: int = 0,
    ) -> Version:
        """Prefill already-encoded video tokens (n_patches * tokens per patch, in (t, h, w) order)."""
        with self.rt.gpu_lock:
            first_patch = self.cache.next_chunk_patch()
            cache = self.cache
            pos = video_positions(self.head.video_start, first_patch, n_patches, *cache.grid_hw, cache.interval)
            kv, start = self.cache.reserve(embeds.shape[0])
            self.rt.lm.forward(embeds, pos, kv, start)
        segment = Segment(
            id=f"f{frame_seqs[0]:012d}",  # frames enter the cache once, so their seq names the chunk
            tokens=embeds.shape[0],
            first_patch=first_patch,
            n_patches=n_patches,
            frame_seqs=frame_seqs,
            capture_range=(float(capture_range[0]), float(capture_range[1])),
            padded_frames=padded_frames,
        )
        with self.rt.gpu_lock:  # reading the segment out and evicting are GPU work too
            original = self._read_out(segment, kv, start)
            version = self.cache.publish_chunk(segment)
        self._emit(segment, original)
        return version
