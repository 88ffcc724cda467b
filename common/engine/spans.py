"""The capture-time ranges a cache covers (no torch: status and the API compute them from a
manifest). One range per run of chunks whose frames are consecutive: eviction leaves gaps, so a
cache that keeps salient chunks covers several ranges."""

from __future__ import annotations

from collections.abc import Iterable


def capture_ranges(chunks: Iterable[tuple[tuple[int, int], tuple[float, float]]]) -> list[tuple[float, float]]:
    """`chunks`: (first and last frame seq, capture-time range) of each chunk, oldest first."""
    ranges: list[tuple[float, float]] = []
    last_seq = None
    for (first, last), (start, end) in chunks:
        if ranges and last_seq is not None and first == last_seq + 1:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((start, end))
        last_seq = last
    return ranges
