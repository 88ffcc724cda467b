"""Which chunks leave the cache, and what the rest become: the policy on one page (after
StreamingLLM's attention sinks, plus a "star memory" of salient chunks).

The cache is the prefix, then one segment per chunk. We evict whole chunks only, never part of
a frame. The sink (prefix + the first `sink_chunks` chunks) stays, because attention leans on
the earliest tokens; the newest chunks stay, because questions are mostly about now; up to
`salient_chunks` chunks that differ most from the chunk before them (a scene change, scored by
salience.py) stay, because they are what a long static stretch would otherwise wash out; the
oldest of the other chunks go. Eviction starts when the cache passes the high watermark and brings it down to the
low watermark, so it runs in batches rather than on every chunk.

What the retained chunks become (`mode`):

- `rebase`: their keys are turned to contiguous positions (bounded positions, layer-0 keys equal
  a fresh encode), but deeper layers keep what they computed while evicted chunks were there.
- `exact`: they are prefilled again from their kept vision embeddings at contiguous positions,
  so the cache equals a fresh encode of exactly the retained frames, at every layer. The prefill
  runs in pieces of at most `rebuild_piece_tokens` tokens, one per encode step of the scheduler
  (batched with other streams' chunks, questions served between pieces), so rebuilding a 32K
  cache never holds the GPU for one long step.
- `absolute`: nothing moves; positions keep counting (for comparison).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from common.engine.settings import setting

EvictionMode = Literal["rebase", "exact", "absolute"]
MODES: tuple[str, ...] = get_args(EvictionMode)


@dataclass(frozen=True)
class EvictionPolicy:
    """A field with help is a setting of the encoder (`eviction` for `mode`); the others are for
    tests."""

    # the high watermark; None never evicts (the services' default is a budget: EncoderConfig)
    max_cache_tokens: int | None = setting(
        None, "eviction budget: tokens a stream's cache holds at most; none keeps everything"
    )
    low_watermark: float = setting(0.75, "an eviction brings the cache down to this share of `max_cache_tokens`")
    sink_chunks: int = setting(1, "oldest chunks an eviction always keeps (attention leans on them)")
    mode: EvictionMode = setting(
        "rebase", "what retained chunks become: `rebase`, `exact` or `absolute` (eviction policy, below)"
    )
    salient_chunks: int = setting(0, "chunks kept for a scene change, inside `max_cache_tokens`")
    rebuild_piece_tokens: int = 4096  # exact: tokens re-prefilled per encode step

    def __post_init__(self) -> None:
        if self.max_cache_tokens is not None and self.max_cache_tokens <= 0:
            raise ValueError("max_cache_tokens must be positive or None")
        if not 0.0 < self.low_watermark <= 1.0:
            raise ValueError("low_watermark must be in (0, 1]")
        if self.sink_chunks < 0:
            raise ValueError("sink_chunks must be >= 0")
        if self.salient_chunks < 0:
            raise ValueError("salient_chunks must be >= 0")
        if self.rebuild_piece_tokens <= 0:
            raise ValueError("rebuild_piece_tokens must be positive")
        if self.mode not in MODES:
            raise ValueError(f"eviction mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    @property
    def rebase(self) -> bool:
        """Whether retained chunks move to contiguous positions (rebase and exact do)."""
        return self.mode != "absolute"

    @property
    def exact(self) -> bool:
        return self.mode == "exact"

    def chunks_to_evict(
        self, prefix_tokens: int, chunk_tokens: list[int], salience: list[float] | None = None
    ) -> list[int]:
        """Indices (into `chunk_tokens`, oldest first) of chunks to drop now; [] if under budget.

        Ordinary middle chunks go oldest first; the `salient_chunks` most salient middle chunks
        go last, least salient first, and only if the budget cannot be met without them."""
        total = prefix_tokens + sum(chunk_tokens)
        if self.max_cache_tokens is None or total <= self.max_cache_tokens:
            return []
        target = int(self.max_cache_tokens * self.low_watermark)
        # The newest chunk always stays: a question must see the latest frames.
        middle = list(range(self.sink_chunks, len(chunk_tokens) - 1))
        starred = set(self._salient(middle, salience))
        order = [i for i in middle if i not in starred] + sorted(starred, key=lambda i: (salience or [])[i])
        evict: list[int] = []
        for idx in order:
            if total <= target:
                break
            evict.append(idx)
            total -= chunk_tokens[idx]
        return sorted(evict)

    def _salient(self, middle: list[int], salience: list[float] | None) -> list[int]:
        """The up to `salient_chunks` middle chunks of highest (positive) salience; newer wins ties."""
        if not self.salient_chunks or salience is None:
            return []
        ranked = sorted((i for i in middle if salience[i] > 0), key=lambda i: (salience[i], i), reverse=True)
        return ranked[: self.salient_chunks]
