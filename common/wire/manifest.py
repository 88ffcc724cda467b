"""Cache versions on the wire: Version <-> Manifest (the msgpack map on `head` and `versions`).

A manifest names the segments of a version in order and, for each, what rebuilds its exact
K/V from the segment's original encoding: its place (offset, logical patch index) and how far
its keys were turned (t_delta). With the segment store, that is enough for a QA worker to
mirror a version, or for a restarted encoder to continue where it stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.engine.frames import Grid, StreamSpec
from common.engine.kvcache import CacheState, CacheStats, Placement, Segment, Version, capture_ranges
from common.wire.schemas import Manifest


@dataclass(frozen=True)
class ManifestState:
    """A manifest decoded: the stream it describes and the cache state `StreamCache.apply` rebuilds."""

    spec: StreamSpec
    cache: CacheState


def to_manifest(version: Version, spec: StreamSpec) -> Manifest:
    segments = [
        {
            "tokens": p.segment.tokens,
            "first_patch": p.segment.first_patch,
            "n_patches": p.segment.n_patches,
            "frame_seqs": list(p.segment.frame_seqs),
            "capture_range": list(p.segment.capture_range),
            "padded_frames": p.segment.padded_frames,
            "salience": p.segment.salience,
            "offset": p.offset,
            "patch_now": p.first_patch,
        }
        for p in version.placements
    ]
    capture = version.capture_range
    return Manifest(
        version=version.id,
        stream=version.stream,
        segment_ids=[p.segment.id for p in version.placements],
        temporal_deltas=[list(p.t_delta) for p in version.placements],
        last_frame_seq=version.last_frame_seq,
        first_ts=capture[0] if capture else None,
        last_ts=capture[1] if capture else None,
        cache_tokens=version.tokens,
        next_patch=version.next_patch,
        evicted_segments=version.stats.chunks_evicted,
        evicted_tokens=version.stats.tokens_evicted,
        created_at=time.time(),
        extra={
            "segments": segments,
            "video_start": version.video_start,
            "evictions": version.stats.evictions,
            "fps": spec.fps,
            "grid": [spec.grid.height, spec.grid.width],
            "chunk_frames": spec.chunk_frames,
        },
    )


def from_manifest(m: Manifest) -> ManifestState:
    extra = m.extra
    placements = []
    for sid, deltas, meta in zip(m.segment_ids, m.temporal_deltas, extra["segments"], strict=True):
        segment = Segment(
            id=sid,
            tokens=meta["tokens"],
            first_patch=meta["first_patch"],
            n_patches=meta["n_patches"],
            frame_seqs=tuple(meta["frame_seqs"]),
            capture_range=tuple(meta["capture_range"]),
            padded_frames=meta["padded_frames"],
            salience=meta.get("salience", 0.0),  # absent in manifests from before salient chunks
        )
        placements.append(Placement(segment, meta["offset"], meta["patch_now"], tuple(deltas)))
    spec = StreamSpec(m.stream, extra["fps"], Grid(*extra["grid"]), extra["chunk_frames"])
    stats = CacheStats(extra["evictions"], m.evicted_segments, m.evicted_tokens)
    return ManifestState(spec, CacheState(tuple(placements), m.version, extra["video_start"], m.next_patch, stats))


def manifest_ranges(m: Manifest) -> list[tuple[float, float]]:
    """The capture-time ranges a manifest's version covers (several once salient chunks are kept)."""
    return capture_ranges(from_manifest(m).cache.placements)
