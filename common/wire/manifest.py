"""Cache versions on the wire: Version <-> Manifest (the msgpack map on `head` and `versions`).

A manifest names the segments of a version in order and, for each, what rebuilds its exact
K/V from the segment's original encoding: its place (offset, logical patch index) and how far
its keys were turned (t_delta). With the segment store, that is enough for a QA worker to
mirror a version, or for a restarted encoder to continue where it stopped.
"""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass

from common.engine.grid import Grid, StreamSpec
from common.engine.kvcache import CacheState, CacheStats, Placement, Segment, Version
from common.wire.schemas import Manifest, SegmentRecord

RECORDS_CACHED = 16384  # a worker's streams' placements in their heads, with room (64 streams x ~130)


@dataclass(frozen=True)
class ManifestState:
    """A manifest decoded: the stream it describes and the cache state `StreamCache.apply` rebuilds."""

    spec: StreamSpec
    cache: CacheState


def new_epoch() -> str:
    """A stream's new life (``Manifest.epoch``): random, so a stream restarted on an empty Redis
    never repeats one its readers saw."""
    return uuid.uuid4().hex[:16]


def to_manifest(version: Version, spec: StreamSpec) -> Manifest:
    capture = version.capture_range
    return Manifest(
        version=version.id,
        stream=version.stream,
        fps=spec.fps,
        grid=(spec.grid.height, spec.grid.width),
        chunk_frames=spec.chunk_frames,
        video_start=version.video_start,
        next_patch=version.next_patch,
        segments=tuple(_record(p) for p in version.placements),
        last_frame_seq=version.last_frame_seq,
        first_ts=capture[0] if capture else None,
        last_ts=capture[1] if capture else None,
        cache_tokens=version.tokens,
        evictions=version.stats.evictions,
        evicted_segments=version.stats.chunks_evicted,
        evicted_tokens=version.stats.tokens_evicted,
        created_at=time.time(),
        epoch=version.epoch,
    )


def from_manifest(m: Manifest) -> ManifestState:
    placements = tuple(_placement(s) for s in m.segments)
    spec = StreamSpec(m.stream, m.fps, Grid(*m.grid), m.chunk_frames)
    stats = CacheStats(m.evictions, m.evicted_segments, m.evicted_tokens)
    return ManifestState(spec, CacheState(placements, m.version, m.video_start, m.next_patch, stats, m.epoch))


@functools.lru_cache(maxsize=RECORDS_CACHED)
def _record(p: Placement) -> SegmentRecord:  # a version repeats its head's placements but the last few
    s = p.segment
    return SegmentRecord(
        id=s.id,
        tokens=s.tokens,
        offset=p.offset,
        first_patch=s.first_patch,
        patch_now=p.first_patch,
        n_patches=s.n_patches,
        t_delta=p.t_delta,
        frame_seqs=s.frame_seqs,
        capture_range=s.capture_range,
        padded_frames=s.padded_frames,
        salience=s.salience,
    )


def _placement(r: SegmentRecord) -> Placement:
    segment = Segment(
        r.id, r.tokens, r.first_patch, r.n_patches, r.frame_seqs, r.capture_range, r.padded_frames, r.salience
    )
    return Placement(segment, r.offset, r.patch_now, r.t_delta)
