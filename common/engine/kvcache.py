"""A stream's KV cache: immutable segments in pages of the device's pool, published as versions.

Layout. The cache writes into a *run*: contiguous slots of the pool (pool.py) that it holds. The
prefix and then one segment per chunk go back to back in it (segments ignore page boundaries). A
version is its placements (logical offsets) plus a `KVView`: the slot ranges of its tokens in
order, usually one, each held by the version itself. New chunks are written past every published
version's tokens, so a version is a snapshot that costs nothing to take and never changes. A
budgeted stream's run is its budget (`max_cache_tokens`) and no more: the chunk that goes over it
is written to pages of its own (a *spill*) until the eviction it sets off brings the cache back
into the run. An unbudgeted stream's run doubles, in place or by a copy to a new run: every
version is one extent.

Eviction. The version after an eviction keeps its leading segments that do not change (prefix,
sink) where they are and writes the others back to back right after them, each turned by the
change in its temporal deltas (re-basing). When nobody but the cache holds the pages this
overwrites, it happens in place: the retained chunks move down over the evicted ones, the
newest out of its spill, and nothing new is allocated. When somebody does (a question answering
from an older version, a mirror's recent versions), the whole cache is copied to a fresh run
instead (copy-on-write; the unchanged leading segments too, a few thousand tokens, so the new
version is one extent and its chunks keep the one-range attention path), and the old pages live
on with the versions that hold them. The version the cache itself held is no holder once
replaced. Pages that no version and no run holds return to the pool at once: no second copy of
the cache unless somebody reads the old one, no 2x peak.

Re-basing: after eviction the retained chunks get contiguous logical temporal-patch indices,
so positions stay bounded for an unbounded stream. Each placement records how far its keys
have been turned in the temporal band relative to when the segment was encoded (`t_delta`,
one per temporal patch); that, with the segment's original K/V, rebuilds the exact cache
anywhere (the segment store ships segments and versions between processes this way).

Exact eviction (see eviction.py) instead prefills the chunks after the first evicted one again,
from their kept vision embeddings, into a fresh run (a `Rebuild`, run a piece at a time by
whoever runs the stream's chunks: the scheduler batches each piece with other streams' work),
right after a copy of the unchanged prefix and sink, so the rebuilt version is one extent.
The head stays the version before the eviction until the last piece is written. The re-prefilled
chunks' K/V are new, so they become new segments (`rebuilt_id`) with zero deltas, and travel
between processes like any other segment.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import structlog
import torch

from common.engine.eviction import EvictionPolicy
from common.engine.lm import Item, KVView, LanguageModel
from common.engine.pool import PoolFull, Region
from common.engine.positions import TemporalStep, next_text_position, shift_temporal, video_positions
from common.engine.salience import mean_embedding, salience
from common.engine.spans import capture_ranges

log = structlog.get_logger()

RELAYOUT_BLOCK_TOKENS = 4096  # K/V moved and turned at once (their keys in fp32: 150 MB at 3B)


@dataclass(frozen=True)
class Segment:
    """What one encoded piece of the cache is; its K/V live in the pool or a segment store."""

    id: str
    tokens: int
    first_patch: int = 0  # logical temporal-patch index it was encoded at
    n_patches: int = 0  # 0 for the prefix
    frame_seqs: tuple[int, int] = (-1, -1)  # first, last frame sequence number
    capture_range: tuple[float, float] = (0.0, 0.0)
    padded_frames: int = 0  # frames repeated to fill the last temporal patch
    salience: float = 0.0  # how much it differs from the chunk before it (salience.py)

    @property
    def tokens_per_patch(self) -> int:
        return self.tokens // self.n_patches if self.n_patches else 0

    @property
    def chunk_id(self) -> str:
        """The id the chunk was first encoded under; re-prefilled versions of it share it."""
        return chunk_id(self.id)


_REBUILT = ".r"


def rebuilt_id(segment_id: str, eviction: int) -> str:
    """Id of a chunk re-prefilled at eviction number `eviction`: `f000000000012.r3`."""
    return f"{chunk_id(segment_id)}{_REBUILT}{eviction}"


def chunk_id(segment_id: str) -> str:
    """`f000000000012.r3` -> `f000000000012` (ids we encode under never contain `.r`)."""
    return segment_id.split(_REBUILT, 1)[0]


@dataclass(frozen=True)
class Placement:
    segment: Segment
    offset: int  # first token in the version (its logical position in the cache)
    first_patch: int  # logical temporal-patch index now (differs from the segment's after re-basing)
    t_delta: tuple[int, ...] = ()  # per patch: temporal position now minus at encode time


@dataclass(frozen=True)
class CacheStats:
    evictions: int = 0
    chunks_evicted: int = 0
    tokens_evicted: int = 0


@dataclass(frozen=True)
class CacheState:
    """A version described without its K/V (decoded from a manifest, say): what `StreamCache.apply`
    rebuilds exactly, given each segment's original K/V."""

    placements: tuple[Placement, ...]
    version_id: int
    video_start: int
    next_patch: int
    stats: CacheStats
    epoch: str = ""  # the stream's life (see Version.epoch)


@dataclass(frozen=True)
class Version:
    """An immutable snapshot of a stream's cache."""

    stream: str
    id: int
    view: KVView
    placements: tuple[Placement, ...]
    video_start: int  # position right after <|vision_start|>
    interval: TemporalStep  # temporal position step per patch
    grid_hw: tuple[int, int]  # merged tokens per patch, (rows, cols)
    next_patch: int  # logical index the next chunk gets
    stats: CacheStats = field(default_factory=CacheStats)
    layout: object = None  # the same object for every version between two evictions (or re-layouts)
    # Which life of the stream this is: chosen at random when its cache starts empty, kept for as
    # long as it continues; version ids count within one epoch ("" for a stream older than epochs).
    epoch: str = ""
    # recorded on the device after the work that writes this version was queued (None: written
    # when published, as on the CPU)
    written: torch.cuda.Event | None = field(default=None, compare=False, repr=False)
    # the slots its cache's run takes (a budgeted stream's: its budget): what an eviction that must
    # copy the cache, somebody holding this version's pages, allocates (0: not known)
    run_tokens: int = 0

    def is_written(self) -> bool:
        """Whether the device has written every token of this version: a version published by an
        encode step still in flight may not be."""
        return self.written is None or self.written.query()

    @property
    def tokens(self) -> int:
        return self.view.length

    @property
    def chunks(self) -> tuple[Placement, ...]:
        return self.placements[1:]

    @property
    def text_start(self) -> int:
        """Position of the first text token after the video (<|vision_end|>)."""
        return next_text_position(self.video_start, self.next_patch, *self.grid_hw, self.interval)

    @property
    def last_frame_seq(self) -> int:
        return self.chunks[-1].segment.frame_seqs[1] if self.chunks else -1

    @property
    def capture_range(self) -> tuple[float, float] | None:
        if not self.chunks:
            return None
        return self.chunks[0].segment.capture_range[0], self.chunks[-1].segment.capture_range[1]

    @property
    def capture_ranges(self) -> list[tuple[float, float]]:
        return capture_ranges((p.segment.frame_seqs, p.segment.capture_range) for p in self.chunks)

    def kv_bytes(self) -> int:
        kv = self.view.extents[0].kv
        return self.view.length * kv[:, :, :, :1].numel() * kv.element_size()


@dataclass
class Rebuild:
    """An exact eviction under way. The retained chunks before the first one that lost a chunk
    before it did not change: `region`, a fresh run, starts with a copy of them (`kept` tokens).
    The rest are prefilled again from their kept embeddings at their re-based positions right
    after, a piece of at most `piece_tokens` tokens at a time, each causally after everything the
    region holds before it, so together the pieces compute what one prefill of all of them would:
    a fresh encode of exactly the retained frames. Nothing is published until
    `StreamCache.complete`; until then questions read the version before the eviction (`base`),
    never a half-built region."""

    base: Version  # the head it replaces
    kept: int  # tokens at the region's start: the unchanged leading segments, copied
    region: Region  # the kept segments, then the re-prefilled chunks, back to back from its start
    placements: tuple[Placement, ...]  # the version to publish
    next_patch: int
    stats: CacheStats
    gone: tuple[str, ...]  # chunk ids evicted (their kept embeddings go when it is published)
    embeds: torch.Tensor  # (T, D): the re-prefilled chunks' kept embeddings, back to back
    positions: torch.Tensor  # (3, T): theirs, re-based
    piece_tokens: int
    written: int = 0  # tokens prefilled so far

    @property
    def finished(self) -> bool:
        return self.written == len(self.embeds)

    def next_piece(self) -> tuple[torch.Tensor, torch.Tensor, Item]:
        """(embeds, positions, item) of the next piece, for a forward that runs it now."""
        a = self.written
        b = self.written = min(a + self.piece_tokens, len(self.embeds))
        return self.embeds[a:b], self.positions[:, a:b], Item(b - a, self.region, self.kept + a)


class StreamCache:
    """The writer side: appends chunks, evicts, publishes versions. One writer per stream.

    With exact eviction it also holds every cached chunk's vision embeddings (`embeds`, by
    chunk id, on the cache's device): what `rebuild` prefills again after an eviction."""

    def __init__(
        self,
        lm: LanguageModel,
        stream: str,
        policy: EvictionPolicy,
        *,
        interval: TemporalStep,
        grid_hw: tuple[int, int],
        initial_capacity: int = 4096,
    ):
        self.lm = lm
        self.stream = stream
        self.policy = policy
        self.interval = interval
        self.grid_hw = grid_hw
        self._head: Version | None = None
        # Held while the head is let go of and its successor laid out: a reader on another thread
        # waits for the new head rather than take the old one as its pages are overwritten.
        self._swap = threading.RLock()
        self.embeds: dict[str, torch.Tensor] = {}  # chunk id -> (tokens, D) vision embeddings, kept for exact eviction
        self._last_mean: torch.Tensor | None = None  # (D,) the newest chunk's, for the next one's salience
        self._run_tokens = policy.max_cache_tokens or initial_capacity  # a budgeted stream's run is its budget
        self._run: Region | None = None  # where the cache writes
        self._used = 0  # slots of the run in use, from its start
        self._spill: Region | None = None  # a chunk past a budgeted run, until its version is published
        self._pinned: list[Region] = []  # what a re-layout keeps held until its version is published
        self._written: tuple[int, int] = (0, 0)  # (slab, slot) where reserve() put the next tokens
        self._where: dict[str, tuple[int, int]] = {}  # segment id -> (slab, slot) of its first token
        self._layout = object()
        self._last_id = -1  # the newest version's (the head may be let go of while a new one is laid out)
        self.epoch = ""  # stamped on every version (Version.epoch); set before the first one

    @property
    def head(self) -> Version | None:
        """The newest version (None before the prefix)."""
        with self._swap:
            return self._head

    # -- writing -----------------------------------------------------------------------
    def reserve(self, n_tokens: int) -> Item:
        """Where the next `n_tokens` go, and what they attend to: every token of the head first."""
        self._spill = None
        if self._run is None or self._used + n_tokens > self._run.size:
            self._grow(n_tokens)
        base = self._head.view.extents if self._head else ()
        if self._spill is not None:
            dest, at, since = self._spill, 0, 0
        else:
            dest, at, since = self._run, self._used, self._used
            last = base[-1] if base else None
            if last is not None and last.slab == dest.slab and dest.start <= last.start and last.end == dest.start + at:
                base, since = base[:-1], last.start - dest.start  # one causal range: today's common case
        self._written = (dest.slab, dest.start + at)
        return Item(n_tokens, dest, at, KVView(base) if base else None, since)

    def rewind(self, version: Version) -> None:
        """Make `version` the head again, forgetting the versions after it, so that a benchmark can
        repeat a step on the same cache. Only back within the current layout (no eviction since):
        the slots after it are then free to write again."""
        if version.layout is not self._layout:
            raise ValueError(f"version {version.id} is of another layout: a cache rewinds only to before its appends")
        with self._swap:
            self._head, self._spill = version, None
            self._where = {p.segment.id: self._where[p.segment.id] for p in version.placements}
            last = version.view.extents[-1]
            if last.slab == self._run.slab and self._run.start <= last.start < self._run.end:
                self._used = last.end - self._run.start

    def publish_prefix(self, segment: Segment, video_start: int) -> Version:
        self._wrote(segment)
        placement = Placement(segment, offset=0, first_patch=0)
        return self._publish((placement,), video_start=video_start, next_patch=0, stats=CacheStats())

    def publish_chunk(self, segment: Segment, embeds: torch.Tensor | None = None) -> Version | Rebuild:
        """The chunk's K/V were written by the caller where reserve() said; publish the version that
        holds it, evicting first when it would go over budget (no over-budget version is ever seen).
        `embeds` are the chunk's vision embeddings: exact eviction keeps them, salience reads them.
        An exact eviction publishes nothing yet: it returns the `Rebuild` for the caller to run, and
        `complete` publishes once every piece is written."""
        if any(p.segment.id == segment.id for p in self._require_head().placements):
            raise ValueError(f"segment {segment.id} is in the cache already (a chunk's id is its first frame's seq)")
        segment = self._take_embeds(segment, embeds)
        self._wrote(segment)
        offset = self._head.tokens
        placements = (*self._head.placements, Placement(segment, offset, segment.first_patch, (0,) * segment.n_patches))
        next_patch = segment.first_patch + segment.n_patches
        chunks = [p.segment for p in placements[1:]]
        drop = self.policy.chunks_to_evict(
            placements[0].segment.tokens, [s.tokens for s in chunks], [s.salience for s in chunks]
        )
        if drop:
            try:
                return self._evict(placements, drop, next_patch)
            except PoolFull:  # no room for the copy (or rebuild) it needs: the chunk is refused, the head stays
                self.embeds.pop(segment.chunk_id, None)
                raise
        head = self._head
        return self._publish(placements, video_start=head.video_start, next_patch=next_patch, stats=head.stats)

    def apply(self, state: CacheState, load: Callable[[Segment], torch.Tensor]) -> Version:
        """Make the cache equal a version described elsewhere (a manifest): segments this cache
        holds are reused (turned by the change in their deltas), the others come from `load`
        (their original K/V). Appends in place when the current head is a prefix of it."""
        placements = list(state.placements)
        held = self._head.placements if self._head else ()
        self.epoch = state.epoch
        with self._swap:
            if self.appends(state):
                self._append_loaded(placements[len(held) :], load)
            else:
                self._relayout(placements, held, load)
            return self._publish(
                tuple(placements),
                video_start=state.video_start,
                next_patch=state.next_patch,
                stats=state.stats,
                version_id=state.version_id,
            )

    def appends(self, state: CacheState) -> bool:
        """Whether `apply(state)` only appends to the head (else it lays the cache out anew)."""
        held = self._head.placements if self._head else ()
        return bool(held) and _common_prefix(state.placements, held) == len(held)

    def missing(self, state: CacheState) -> list[Segment]:
        """Segments of `state` that `apply` must load (the rest it reuses from this cache)."""
        held = {p.segment.id for p in self._head.placements} if self._head else set()
        return [p.segment for p in state.placements if p.segment.id not in held]

    def next_chunk_patch(self) -> int:
        return self._require_head().next_patch

    def keep_embeds(self, load: Callable[[str], torch.Tensor | None]) -> None:
        """After `apply` on a restarted writer: the kept embeddings of the head's chunks, by chunk id
        (`load` returns None for a chunk that has none, e.g. encoded under another policy)."""
        chunk_ids = [p.segment.chunk_id for p in self._require_head().chunks]
        loaded = {cid: load(cid) for cid in chunk_ids}
        self.embeds = {cid: e.to(self.lm.device) for cid, e in loaded.items() if e is not None}
        if chunk_ids and chunk_ids[-1] in self.embeds:
            self._last_mean = mean_embedding(self.embeds[chunk_ids[-1]])

    def complete(self, rebuild: Rebuild) -> Version:
        """Publish the version a finished rebuild holds; its region becomes the run."""
        if not rebuild.finished or self._head is not rebuild.base:
            raise RuntimeError("a rebuild is published once, whole, over the head it started from")
        region = self._run = rebuild.region
        self._used = 0
        for p in rebuild.placements:
            self._where[p.segment.id] = (region.slab, region.start + self._used)
            self._used += p.segment.tokens
        self._layout = object()
        for cid in rebuild.gone:
            self.embeds.pop(cid, None)
        return self._publish(
            rebuild.placements, video_start=rebuild.base.video_start, next_patch=rebuild.next_patch, stats=rebuild.stats
        )

    # -- internals ---------------------------------------------------------------------
    def _require_head(self) -> Version:
        if self._head is None:
            raise RuntimeError("the prefix must be published before any chunk")
        return self._head

    def _grow(self, n_tokens: int) -> None:
        """Room for `n_tokens` past the run's end. A budgeted stream's run stays its budget: the
        chunk that goes over it gets a spill of its own, which the eviction it sets off empties. An
        unbudgeted one's run doubles: in place when the pages after it are free, else the cache is
        copied to a new run twice the size, so that it stays one extent (one causal range for its
        chunks, one graph key for its questions) while the old pages stay with the versions that
        hold them. Copies add up to less than the cache, like a growing array's."""
        pool = self.lm.pool
        if self._run is None:
            self._run, self._used = pool.alloc(max(n_tokens, self._run_tokens)), 0
        elif self.policy.max_cache_tokens is not None:
            self._spill = pool.alloc(n_tokens)
        else:
            old, needed = self._run, self._used + n_tokens
            grown = pool.extend(old, max(needed - old.size, old.size))
            if grown is None:
                grown = pool.alloc(max(needed, 2 * old.size))
                grown.kv[:, :, :, : self._used] = old.kv[:, :, :, : self._used]
                self._where = {
                    sid: (grown.slab, grown.start + slot - old.start)
                    if slab == old.slab and old.start <= slot < old.end
                    else (slab, slot)
                    for sid, (slab, slot) in self._where.items()
                }
                self._layout = object()  # versions before it pin the old pages (see qa_worker/mirror.py)
            self._run = grown

    def _wrote(self, segment: Segment) -> None:
        """The segment's tokens are where reserve() said."""
        slab, slot = self._written
        self._where[segment.id] = self._written
        if self._spill is None:
            self._used = slot - self._run.start + segment.tokens
        self._written = (slab, slot + segment.tokens)

    def _append_loaded(self, placements: list[Placement], load: Callable[[Segment], torch.Tensor]) -> None:
        """Segments loaded from their original K/V, written after the head, turned by their deltas."""
        if not placements:
            return
        item = self.reserve(sum(p.segment.tokens for p in placements))
        slab = self.lm.pool.slabs[item.dest.slab]
        for p in placements:
            self._place(slab, self._written[1], load(p.segment), _token_shift(p))
            self._wrote(p.segment)

    def _publish(
        self,
        placements: tuple[Placement, ...],
        *,
        video_start: int,
        next_patch: int,
        stats: CacheStats,
        version_id: int | None = None,
    ) -> Version:
        if version_id is None:
            version_id = self._last_id + 1
        self._last_id = version_id
        self._where = {p.segment.id: self._where[p.segment.id] for p in placements}
        version = Version(
            stream=self.stream,
            id=version_id,
            view=self._view(placements),
            placements=placements,
            video_start=video_start,
            interval=self.interval,
            grid_hw=self.grid_hw,
            next_patch=next_patch,
            stats=stats,
            layout=self._layout,
            epoch=self.epoch,
            written=_queued_so_far(self.lm.pool.device),
            run_tokens=self._run_tokens,
        )
        self._head, self._spill, self._pinned = version, None, []  # the version holds their pages now
        return version

    def _view(self, placements: Sequence[Placement]) -> KVView:
        """The placements' slots as held extents: neighbouring segments merge into one."""
        ranges: list[list[int]] = []  # [slab, start, size]
        for p in placements:
            slab, slot = self._where[p.segment.id]
            if ranges and ranges[-1][0] == slab and ranges[-1][1] + ranges[-1][2] == slot:
                ranges[-1][2] += p.segment.tokens
            else:
                ranges.append([slab, slot, p.segment.tokens])
        return KVView(tuple(self.lm.pool.hold(*r) for r in ranges))

    def _evict(self, candidate: tuple[Placement, ...], drop: list[int], next_patch: int) -> Version | Rebuild:
        """Lay the retained segments of `candidate` out re-based, and publish; or, for an exact
        eviction, start re-prefilling them (a `Rebuild`)."""
        head = self._require_head()
        video_start, stats = head.video_start, head.stats
        del head  # the head the cache replaces is nobody's but the cache's (see _relayout)
        dropped = {i + 1 for i in drop}  # placements index = chunk index + 1 (prefix first)
        gone = [candidate[i] for i in sorted(dropped)]
        stats = CacheStats(
            evictions=stats.evictions + 1,
            chunks_evicted=stats.chunks_evicted + len(gone),
            tokens_evicted=stats.tokens_evicted + sum(p.segment.tokens for p in gone),
        )
        placements, next_patch = self._moved([p for i, p in enumerate(candidate) if i not in dropped], next_patch)
        first_stale = min(dropped)  # the first retained chunk that lost a chunk before it
        stale = placements[first_stale:]
        # A chunk without embeddings (encoded before the stream switched to exact) can only be
        # re-based: this eviction then rebases, and later ones are exact once those chunks are gone.
        if self.policy.exact and all(p.segment.chunk_id in self.embeds for p in stale):
            return self._rebuild(placements, first_stale, next_patch, stats, gone)
        for p in gone:
            self.embeds.pop(p.segment.chunk_id, None)
        with self._swap:
            self._relayout(placements, candidate, load=None)
            return self._publish(tuple(placements), video_start=video_start, next_patch=next_patch, stats=stats)

    def _rebuild(
        self,
        placements: list[Placement],
        first_stale: int,
        next_patch: int,
        stats: CacheStats,
        gone: list[Placement],
    ) -> Rebuild:
        """The placements before `first_stale` are copied to the start of a fresh run (nothing
        before them changed, so neither did their K/V); the rest are prefilled again after them, as
        new segments (ids from `rebuilt_id`, zero deltas). `first_stale` is never past the newest
        chunk, which always stays, so there is at least one piece."""
        head = self._require_head()
        fresh = [self._renewed(p, stats.evictions) for p in placements[first_stale:]]
        keep = self._view(placements[:first_stale])
        tokens = sum(p.segment.tokens for p in fresh)
        region = self.lm.pool.alloc(max(keep.length + tokens, self._run_tokens))
        region.kv[:, :, :, : keep.length] = keep.kv  # (layers, 2, kv_heads, kept, hd)
        hw, step = self.grid_hw, self.interval
        positions = [video_positions(head.video_start, p.first_patch, p.segment.n_patches, *hw, step) for p in fresh]
        return Rebuild(
            base=head,
            kept=keep.length,
            region=region,
            placements=(*placements[:first_stale], *fresh),
            next_patch=next_patch,
            stats=stats,
            gone=tuple(p.segment.chunk_id for p in gone),
            embeds=torch.cat([self.embeds[p.segment.chunk_id] for p in fresh]),
            positions=torch.cat(positions, dim=1),
            piece_tokens=self.policy.rebuild_piece_tokens,
        )

    def _moved(self, kept: list[Placement], next_patch: int) -> tuple[list[Placement], int]:
        """`kept` packed back to back from offset 0, re-based when the policy says so; and the
        logical patch index the next chunk gets."""
        placements, offset, patch = [], 0, 0
        for p in kept:
            moved = self._rebased(p, offset, patch) if self.policy.rebase else replace(p, offset=offset)
            placements.append(moved)
            offset += p.segment.tokens
            patch = moved.first_patch + p.segment.n_patches
        return placements, (patch if self.policy.rebase else next_patch)

    def _take_embeds(self, segment: Segment, embeds: torch.Tensor | None) -> Segment:
        """Keep the chunk's embeddings when exact eviction needs them; score its salience when the
        policy keeps salient chunks. Returns the segment with its salience."""
        if embeds is None:
            if self.policy.exact:
                raise ValueError("exact eviction needs every chunk's vision embeddings")
            return segment
        if self.policy.exact:
            self.embeds[segment.chunk_id] = embeds
        if not self.policy.salient_chunks:
            return segment
        mean = mean_embedding(embeds)
        score, self._last_mean = salience(self._last_mean, mean), mean
        return replace(segment, salience=score)

    def _renewed(self, p: Placement, eviction: int) -> Placement:
        """A placement's chunk as a new segment, encoded where it now is (so its deltas are zero)."""
        segment = replace(p.segment, id=rebuilt_id(p.segment.id, eviction), first_patch=p.first_patch)
        return Placement(segment, p.offset, p.first_patch, (0,) * segment.n_patches)

    def _relayout(
        self,
        placements: list[Placement],
        source: Sequence[Placement],
        load: Callable[[Segment], torch.Tensor] | None,
    ) -> None:
        """Lay the cache out as `placements` (under `_swap`, `_publish` next). Their leading ones
        that `source` (the cache's current layout) has unchanged keep their slots; the rest go back
        to back after them: segments in `source` turned by the change in their deltas, the others
        from `load` (original K/V). They are written within the run when nobody but the cache holds
        the pages that overwrites (no new memory); else every placement is written into a fresh run
        (copy-on-write: the old pages stay, unchanged, with the versions that hold them)."""
        pool = self.lm.pool
        held = {p.segment.id: p for p in source}
        n_keep = _common_prefix(placements, source)
        keep, moved = placements[:n_keep], placements[n_keep:]
        # What is read or kept stays held while the head lets go: the cache's own head is no
        # holder of pages it is replacing, but a version somebody else still holds is. Its pages
        # stay held here too, so that with no room for a copy it can be put back as it was.
        mine = [pool.hold(*self._where[p.segment.id], p.segment.tokens) for p in placements if p.segment.id in held]
        old = self._head
        pages = [pool.hold(e.slab, e.start, e.size) for e in old.view.extents] if old else []
        was = {f.name: getattr(old, f.name) for f in fields(Version) if f.name != "view"} if old else None
        self._head, self._pinned, old = None, [*mine, *pages], None
        tokens = sum(p.segment.tokens for p in moved)
        at = self._in_place(keep, moved, held, tokens, self._pinned)
        copied = at is None
        if copied:  # copy-on-write, all of it: the new version is one extent
            moved, tokens = placements, sum(p.segment.tokens for p in placements)
            try:
                self._run, at = pool.alloc(max(tokens, self._run_tokens)), 0
            except PoolFull:  # nothing was written: the head is what it was, and the caller is told
                self._head, self._pinned = (Version(view=KVView(tuple(pages)), **was) if was else None), []
                raise
        if source:  # a layout replaced (a first one, a restore, replaces none)
            pool.relayouts["copied" if copied else "in_place"] += 1
            log.info("cache re-laid out", stream=self.stream, copied=copied, tokens=tokens)
        slab, start = self._run.slab, self._run.start
        kv, dest = pool.slabs[slab], start + at
        run: _Run | None = None  # held segments back to back in their slab: one write for all of them
        for p in moved:
            if p.segment.id in held:
                src, shift = self._where[p.segment.id], _token_shift(p, held[p.segment.id].t_delta)
                if run is None or not run.continued_by(src):
                    self._write_run(kv, run)
                    run = _Run(*src, dest)
                run.shifts.append(shift)
            elif load is not None:
                self._write_run(kv, run)
                run = None
                self._place(kv, dest, load(p.segment), _token_shift(p))
            else:
                raise KeyError(f"segment {p.segment.id} is neither cached nor loadable")
            self._where[p.segment.id] = (slab, dest)
            dest += p.segment.tokens
        self._write_run(kv, run)
        at = dest - start
        self._used, self._layout = at, object()

    def _in_place(
        self, keep: list[Placement], moved: list[Placement], held: dict[str, Placement], tokens: int, mine: list[Region]
    ) -> int | None:
        """The run slot from which `moved` can be written in place, or None. They go right after
        the kept segments in the run (or from its start), need room there, must each move down or
        stay (so none overwrites one not yet moved), and nobody but the cache may hold the pages
        they overwrite."""
        run = self._run
        if run is None:
            return None

        def in_run(p: Placement) -> int | None:
            slab, slot = self._where[p.segment.id]
            return slot - run.start if slab == run.slab and run.start <= slot < run.end else None

        kept_ends = [at + p.segment.tokens for p in keep if (at := in_run(p)) is not None]
        first = max(kept_ends, default=0)
        if first + tokens > run.size:
            return None
        end, at = first + tokens, first
        for p in moved:
            src = in_run(p) if p.segment.id in held else None
            if src is not None:
                if src < at:
                    return None
                end = max(end, src + p.segment.tokens)
            at += p.segment.tokens
        return first if self.lm.pool.exclusive(run.slab, run.start + first, end - first, [run, *mine]) else None

    def _rebased(self, p: Placement, offset: int, first_patch: int) -> Placement:
        if p.segment.n_patches == 0:
            return replace(p, offset=offset)
        seg = p.segment
        moved_to = self.interval.offsets(first_patch, seg.n_patches)
        t_delta = tuple(int(d) for d in moved_to - self.interval.offsets(seg.first_patch, seg.n_patches))
        return Placement(seg, offset, first_patch, t_delta)

    def _write_run(self, kv: torch.Tensor, run: _Run | None) -> None:
        if run is not None:
            src = self.lm.pool.slabs[run.slab][:, :, :, run.src : run.src + run.tokens]  # (layers, 2, kv_heads, n, hd)
            self._place(kv, run.dest, src, np.concatenate(run.shifts))

    def _place(self, kv: torch.Tensor, offset: int, src: torch.Tensor, token_shift: np.ndarray) -> None:
        """Write K/V `src` (layers, 2, kv_heads, n, hd) into slab `kv` from slot `offset`, turning the
        keys' temporal band by `token_shift` (one value per token). `src` may be slots of `kv` at or
        above `offset` (an eviction moving chunks down in place, or turning them where they are): it
        is written in blocks in order, each read before it is written, so none overwrites slots
        still to be read. A few large blocks, not a loop over chunks: chunk by chunk, 8 caches of
        32K evicting in one encode step took 21,000 kernel launches and 368 waits for the device."""
        src = src.to(kv.device)
        at = _slot_of(src, kv)
        turn = _on_device(token_shift, kv.device) if token_shift.any() else None  # (n,) int64
        for i in range(0, src.shape[3], RELAYOUT_BLOCK_TOKENS):
            block = src[:, :, :, i : i + RELAYOUT_BLOCK_TOKENS]  # (layers, 2, kv_heads, b, hd)
            n = block.shape[3]
            dest = kv[:, :, :, offset + i : offset + i + n]  # the same shape, a view of the slab
            if at is not None and at != offset and abs(at - offset) < n:
                block = block.clone()  # it overlaps its destination
            if turn is not None:
                dest[:, 0] = shift_temporal(block[:, 0], turn[i : i + n], self.lm.inv_freq, self.lm.mrope_section)
            elif at != offset:
                dest[:, 0] = block[:, 0]
            if at != offset:
                dest[:, 1] = block[:, 1]


@dataclass
class _Run:
    """Cached segments that lie back to back in one slab from slot `src`, going to slot `dest` on."""

    slab: int
    src: int
    dest: int
    shifts: list[np.ndarray] = field(default_factory=list)  # per segment: (tokens,) int64, its tokens' turn

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.shifts)

    def continued_by(self, where: tuple[int, int]) -> bool:
        return where == (self.slab, self.src + self.tokens)


def _token_shift(p: Placement, before: Sequence[int] | None = None) -> np.ndarray:
    """How far each token of `p`'s segment turns in time, (tokens,) int64: its temporal patch's new
    delta less the one its K/V hold (`before`; None: K/V as first encoded, deltas zero)."""
    seg = p.segment
    if not seg.n_patches:
        return np.zeros(seg.tokens, dtype=np.int64)
    per_patch = np.subtract(p.t_delta, before if before is not None else 0, dtype=np.int64)
    return np.repeat(per_patch, seg.tokens_per_patch)


def _slot_of(t: torch.Tensor, slab: torch.Tensor) -> int | None:
    """The slot of `slab` at which `t` (a token range of it) starts; None when `t` is not in it."""
    if t.device != slab.device or t.untyped_storage().data_ptr() != slab.untyped_storage().data_ptr():
        return None
    return (t.data_ptr() - slab.data_ptr()) // (slab.stride(3) * slab.element_size())


def _on_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host values on `device` without waiting for the device (through page-locked memory)."""
    host = torch.from_numpy(values)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _queued_so_far(device: torch.device) -> torch.cuda.Event | None:
    """An event after the work queued so far on this thread's stream (where its writes went)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _common_prefix(a: Sequence[Placement], b: Sequence[Placement]) -> int:
    """How many leading placements `a` and `b` share (same segment, offset and deltas)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
