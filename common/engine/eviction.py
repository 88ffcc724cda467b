"""Which chunks leave the cache: the policy on one page (after StreamingLLM's attention sinks).

The cache is the prefix, then one segment per chunk. We evict whole chunks only, never part of
a frame. The sink (prefix + the first `sink_chunks` chunks) stays, because attention leans on
the earliest tokens; the newest chunks stay, because questions are mostly about now; the
oldest chunks in between go. Eviction starts when the cache passes the high watermark and
brings it down to the low watermark, so it runs in batches rather than on every chunk (each
eviction re-bases and repacks the cache).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvictionPolicy:
    max_cache_tokens: int | None = None  # high watermark; None = never evict
    low_watermark: float = 0.75  # evict down to this fraction of max_cache_tokens
    sink_chunks: int = 1
    rebase: bool = True  # renumber retained chunks so positions stay bounded

    def __post_init__(self) -> None:
        if self.max_cache_tokens is not None and self.max_cache_tokens <= 0:
            raise ValueError("max_cache_tokens must be positive or None")
        if not 0.0 < self.low_watermark <= 1.0:
            raise ValueError("low_watermark must be in (0, 1]")
        if self.sink_chunks < 0:
            raise ValueError("sink_chunks must be >= 0")

    def chunks_to_evict(self, prefix_tokens: int, chunk_tokens: list[int]) -> list[int]:
        """Indices (into `chunk_tokens`, oldest first) of chunks to drop now; [] if under budget."""
        total = prefix_tokens + sum(chunk_tokens)
        if self.max_cache_tokens is None or total <= self.max_cache_tokens:
            return []
        target = int(self.max_cache_tokens * self.low_watermark)
        evict: list[int] = []
        # The newest chunk always stays: a question must see the latest frames.
        for idx in range(self.sink_chunks, len(chunk_tokens) - 1):
            if total <= target:
                break
            evict.append(idx)
            total -= chunk_tokens[idx]
        return evict
