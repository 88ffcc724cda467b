"""A stream's KV cache: immutable segments in one arena, published as versions.

The cache holds the prefix (system prompt up to <|vision_start|>) and then one segment per
chunk of frames, packed back to back in an arena tensor (see lm.py for its layout). New
chunks are written past the end of every published version, so a version is a snapshot
that costs nothing to take and never changes. Eviction writes the retained segments into a
fresh arena: versions that still hold the old arena keep it alive until they are dropped.

Re-basing: after eviction the retained chunks get contiguous logical temporal-patch indices,
so positions stay bounded for an unbounded stream. Each placement records how far its keys
have been turned in the temporal band relative to when the segment was encoded (`t_delta`,
one per temporal patch); that, with the segment's original K/V, rebuilds the exact cache
anywhere (the segment store ships segments and versions between processes this way).

Exact eviction (see eviction.py) instead prefills the chunks after the first evicted one again,
from their kept vision embeddings, into a fresh region (a `Rebuild`, run a piece at a time by
whoever runs the stream's chunks: the scheduler batches each piece with other streams' work).
The head stays the version before the eviction until the last piece is written. The re-prefilled
chunks' K/V are new, so they become new segments (`rebuilt_id`) with zero deltas, and travel
between processes like any other segment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fractions import Fraction

import torch

from common.engine.eviction import EvictionPolicy
from common.engine.lm import Item, KVView, LanguageModel
from common.engine.pool import Region
from common.engine.positions import next_text_position, shift_temporal, temporal_offset, video_positions
from common.engine.salience import mean_embedding, salience
from common.engine.spans import capture_ranges


@dataclass(frozen=True)
class Segment:
    """What one encoded piece of the cache is; its K/V live in an arena or a segment store."""

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
    offset: int  # first token in the arena
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


@dataclass(frozen=True)
class Version:
    """An immutable snapshot of a stream's cache."""

    stream: str
    id: int
    view: KVView
    placements: tuple[Placement, ...]
    video_start: int  # position right after <|vision_start|>
    interval: Fraction  # temporal position step per patch
    grid_hw: tuple[int, int]  # merged tokens per patch, (rows, cols)
    next_patch: int  # logical index the next chunk gets
    stats: CacheStats = field(default_factory=CacheStats)

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
        kv = self.view.kv
        return kv[:, :, :, : self.view.length].numel() * kv.element_size()

    @property
    def region(self) -> Region:
        return self.view.region


@dataclass
class Rebuild:
    """An exact eviction under way. The retained chunks before the first one that lost a chunk
    before it are already copied into `region`; the rest are prefilled again from their kept
    embeddings at their re-based positions, a piece of at most `piece_tokens` tokens at a time. Each
    piece runs causally after everything the region holds before it, so together the pieces compute
    what one prefill of all of them would: a fresh encode of exactly the retained frames. Nothing is
    published until `StreamCache.complete`; until then questions read the version before the
    eviction (`base`), never a half-built region."""

    base: Version  # the head it replaces
    region: Region
    placements: tuple[Placement, ...]  # the version to publish
    next_patch: int
    stats: CacheStats
    gone: tuple[str, ...]  # chunk ids evicted (their kept embeddings go when it is published)
    embeds: torch.Tensor  # (T, D): the re-prefilled chunks' kept embeddings, back to back
    positions: torch.Tensor  # (3, T): theirs, re-based
    at: int  # region slot of the first re-prefilled token
    piece_tokens: int
    written: int = 0  # tokens prefilled so far

    @property
    def finished(self) -> bool:
        return self.written == len(self.embeds)

    def next_piece(self) -> tuple[torch.Tensor, torch.Tensor, Item]:
        """(embeds, positions, item) of the next piece, for a forward that runs it now."""
        a = self.written
        b = self.written = min(a + self.piece_tokens, len(self.embeds))
        return self.embeds[a:b], self.positions[:, a:b], Item(b - a, self.region, self.at + a)


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
        interval: Fraction,
        grid_hw: tuple[int, int],
        initial_capacity: int = 4096,
        head_room: int = 1024,
    ):
        self.lm = lm
        self.stream = stream
        self.policy = policy
        self.interval = interval
        self.grid_hw = grid_hw
        capacity = initial_capacity
        if policy.max_cache_tokens is not None:
            capacity = policy.max_cache_tokens + head_room  # for the chunk that goes over budget
        self._region = lm.pool.alloc(capacity)
        self.head: Version | None = None
        self.embeds: dict[str, torch.Tensor] = {}
        self._last_mean: torch.Tensor | None = None  # the newest chunk's, for the next one's salience

    # -- writing -----------------------------------------------------------------------
    def reserve(self, n_tokens: int) -> tuple[Region, int]:
        """Where the next `n_tokens` go: (region, start). Grows into a region twice the size when
        full; the old region stays with the versions that reference it."""
        start = self.head.tokens if self.head else 0
        if start + n_tokens > self._region.size:
            grown = self.lm.pool.alloc(max(2 * self._region.size, start + n_tokens))
            grown.kv[:, :, :, :start] = self._region.kv[:, :, :, :start]
            self._region = grown
        return self._region, start

    def publish_prefix(self, segment: Segment, video_start: int) -> Version:
        placement = Placement(segment, offset=0, first_patch=0)
        return self._publish((placement,), video_start=video_start, next_patch=0, stats=CacheStats())

    def publish_chunk(self, segment: Segment, embeds: torch.Tensor | None = None) -> Version | Rebuild:
        """The chunk's K/V were written by the caller at reserve()'s start; publish the version that
        holds it, evicting first when it would go over budget (no over-budget version is ever seen).
        `embeds` are the chunk's vision embeddings: exact eviction keeps them, salience reads them.
        An exact eviction publishes nothing yet: it returns the `Rebuild` for the caller to run, and
        `complete` publishes once every piece is written."""
        head = self._require_head()
        segment = self._take_embeds(segment, embeds)
        placements = (*head.placements, Placement(segment, head.tokens, segment.first_patch, (0,) * segment.n_patches))
        next_patch = segment.first_patch + segment.n_patches
        chunks = [p.segment for p in placements[1:]]
        drop = self.policy.chunks_to_evict(
            placements[0].segment.tokens, [s.tokens for s in chunks], [s.salience for s in chunks]
        )
        if drop:
            return self._evict(placements, drop, next_patch)
        return self._publish(placements, video_start=head.video_start, next_patch=next_patch, stats=head.stats)

    def apply(self, state: CacheState, load: Callable[[Segment], torch.Tensor]) -> Version:
        """Make the cache equal a version described elsewhere (a manifest): segments this cache
        holds are reused (turned by the change in their deltas), the others come from `load`
        (their original K/V). Appends in place when the current head is a prefix of it."""
        placements = list(state.placements)
        head = self.head
        n_same = 0
        if head is not None:
            while n_same < min(len(head.placements), len(placements)) and head.placements[n_same] == placements[n_same]:
                n_same += 1
        if head is not None and n_same == len(head.placements):
            region, _ = self.reserve(sum(p.segment.tokens for p in placements[n_same:]))
            for p in placements[n_same:]:
                self._place(region.kv, p.offset, load(p.segment), p.t_delta, p.segment.tokens_per_patch)
        else:
            self._region = self._repack(placements, head.placements if head else (), load)
        return self._publish(
            tuple(placements),
            video_start=state.video_start,
            next_patch=state.next_patch,
            stats=state.stats,
            version_id=state.version_id,
        )

    def missing(self, state: CacheState) -> list[Segment]:
        """Segments of `state` that `apply` must load (the rest it reuses from this cache)."""
        held = {p.segment.id for p in self.head.placements} if self.head else set()
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
        """Publish the version a finished rebuild holds."""
        if not rebuild.finished or self.head is not rebuild.base:
            raise RuntimeError("a rebuild is published once, whole, over the head it started from")
        self._region = rebuild.region
        for cid in rebuild.gone:
            self.embeds.pop(cid, None)
        return self._publish(
            rebuild.placements, video_start=rebuild.base.video_start, next_patch=rebuild.next_patch, stats=rebuild.stats
        )

    # -- internals ---------------------------------------------------------------------
    def _require_head(self) -> Version:
        if self.head is None:
            raise RuntimeError("the prefix must be published before any chunk")
        return self.head

    def _publish(
        self,
        placements: tuple[Placement, ...],
        *,
        video_start: int,
        next_patch: int,
        stats: CacheStats,
        version_id: int | None = None,
    ) -> Version:
        last = placements[-1]
        if version_id is None:
            version_id = (self.head.id + 1) if self.head else 0
        version = Version(
            stream=self.stream,
            id=version_id,
            view=KVView(self._region, last.offset + last.segment.tokens),
            placements=placements,
            video_start=video_start,
            interval=self.interval,
            grid_hw=self.grid_hw,
            next_patch=next_patch,
            stats=stats,
        )
        self.head = version
        return version

    def _evict(self, candidate: tuple[Placement, ...], drop: list[int], next_patch: int) -> Version | Rebuild:
        """Write the retained segments of `candidate` into a fresh region, re-based, and publish; or,
        for an exact eviction, start re-prefilling them there (a `Rebuild`)."""
        head = self._require_head()
        dropped = {i + 1 for i in drop}  # placements index = chunk index + 1 (prefix first)
        gone = [candidate[i] for i in sorted(dropped)]
        stats = CacheStats(
            evictions=head.stats.evictions + 1,
            chunks_evicted=head.stats.chunks_evicted + len(gone),
            tokens_evicted=head.stats.tokens_evicted + sum(p.segment.tokens for p in gone),
        )
        placements, next_patch = self._moved([p for i, p in enumerate(candidate) if i not in dropped], next_patch)
        first_stale = min(dropped)  # the first retained chunk that lost a chunk before it
        stale = placements[first_stale:]
        # A chunk without embeddings (encoded before the stream switched to exact) can only be
        # re-based: this eviction then rebases, and later ones are exact once those chunks are gone.
        if self.policy.exact and all(p.segment.chunk_id in self.embeds for p in stale):
            return self._rebuild(placements, first_stale, candidate, next_patch, stats, gone)
        self._region = self._repack(placements, candidate, load=None)
        for p in gone:
            self.embeds.pop(p.segment.chunk_id, None)
        return self._publish(tuple(placements), video_start=head.video_start, next_patch=next_patch, stats=stats)

    def _rebuild(
        self,
        placements: list[Placement],
        first_stale: int,
        candidate: tuple[Placement, ...],
        next_patch: int,
        stats: CacheStats,
        gone: list[Placement],
    ) -> Rebuild:
        """A fresh region with `placements` before `first_stale` copied from `candidate` (nothing
        before them changed, so neither did their K/V), and the rest to prefill again as new segments
        (ids from `rebuilt_id`, zero deltas). `first_stale` is never past the newest chunk, which
        always stays, so there is at least one piece."""
        head = self._require_head()
        fresh = [self._renewed(p, stats.evictions) for p in placements[first_stale:]]
        tokens = sum(p.segment.tokens for p in placements)
        region = self._repack(placements[:first_stale], candidate, load=None, tokens=tokens)
        hw, step = self.grid_hw, self.interval
        positions = [video_positions(head.video_start, p.first_patch, p.segment.n_patches, *hw, step) for p in fresh]
        return Rebuild(
            base=head,
            region=region,
            placements=(*placements[:first_stale], *fresh),
            next_patch=next_patch,
            stats=stats,
            gone=tuple(p.segment.chunk_id for p in gone),
            embeds=torch.cat([self.embeds[p.segment.chunk_id] for p in fresh]),
            positions=torch.cat(positions, dim=1),
            at=fresh[0].offset,
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

    def _repack(
        self,
        placements: list[Placement],
        source: tuple[Placement, ...],
        load: Callable[[Segment], torch.Tensor] | None,
        tokens: int = 0,
    ) -> Region:
        """`placements` written into a fresh region (room for at least `tokens`): segments in `source`
        (placed in the current region) are copied from it, turned by the change in their deltas; the
        rest come from `load` (original K/V). The old region lives on in the versions that hold it."""
        held = {p.segment.id: p for p in source}
        old_kv = self._region.kv
        total = max(tokens, sum(p.segment.tokens for p in placements))
        region = self.lm.pool.alloc(max(self._region.size, total))
        for p in placements:
            n = p.segment.tokens
            if p.segment.id in held:
                src, before = held[p.segment.id], held[p.segment.id].t_delta
                data = old_kv[:, :, :, src.offset : src.offset + n]
            elif load is not None:
                data, before = load(p.segment), (0,) * len(p.t_delta)
            else:
                raise KeyError(f"segment {p.segment.id} is neither cached nor loadable")
            shift = [new - old for new, old in zip(p.t_delta, before, strict=True)]
            self._place(region.kv, p.offset, data, shift, p.segment.tokens_per_patch)
        return region

    def _rebased(self, p: Placement, offset: int, first_patch: int) -> Placement:
        if p.segment.n_patches == 0:
            return replace(p, offset=offset)
        seg = p.segment
        t_delta = tuple(
            temporal_offset(first_patch + k, self.interval) - temporal_offset(seg.first_patch + k, self.interval)
            for k in range(seg.n_patches)
        )
        return Placement(seg, offset, first_patch, t_delta)

    def _place(self, kv: torch.Tensor, offset: int, src: torch.Tensor, t_shift, tokens_per_patch: int) -> None:
        """Copy a segment's K/V (layers, 2, kv_heads, n, hd) into `kv` at `offset`, turning the keys'
        temporal band by `t_shift` (one value per temporal patch)."""
        src = src.to(kv.device)
        n = src.shape[3]
        kv[:, 1, :, offset : offset + n] = src[:, 1]
        if any(t_shift):
            per_token = torch.tensor(t_shift, device=kv.device).repeat_interleave(tokens_per_patch)
            kv[:, 0, :, offset : offset + n] = shift_temporal(
                src[:, 0], per_token, self.lm.inv_freq, self.lm.mrope_section
            )
        else:
            kv[:, 0, :, offset : offset + n] = src[:, 0]
