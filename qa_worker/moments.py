"""What a search returns: moments, not chunks. An event of 30 s is some 15 chunks scoring alike;
ranked one by one they would crowd every other event out of the top `limit`. So a camera's
matching chunks that are adjacent in time are merged into one ranked range (a `SearchHit` of
several chunks), scored by its best chunk, which it names (the thumbnail shows that one).

Adjacent: two chunks of one camera, the later starting at most one chunk's span (first to last
frame, the longer of the two) after the earlier ends. Consecutive chunks are one frame interval
apart; with one chunk missing between them (not indexed, or not matching) they are that chunk's
span and two intervals apart, so a chunk that does not match splits a moment rather than being
jumped over. Frame seqs are not used: an encoder may drop frames, and a rebuilt stream numbers
them again.

Matching: with no absolute meaning to a score (it depends on the model, README "Search"), the cut
is relative, by rank. The `limit` best chunks, what a search listed one by one before moments,
always match: every chunk it used to list is in a result. Beyond them, chunks are taken best first:
one adjacent to a taken chunk joins its moment (or joins two moments into one), one adjacent to
none starts a new moment. The taking stops before the chunk that would make `limit` + 1 moments;
when there is none (a span of few chunks), after the last chunk that started a moment. So a chunk
outside the `limit` best is merged in only if it scores at least as well as the best chunk of
some moment (the next one, left out, or the last one found): a weaker neighbour is not, however
close it is. A moment's extent is thus relative to the others: asking for more moments lowers the
bar and may widen one. An event whose chunks score unevenly may show as more than one moment when
its best chunks are not adjacent and other moments come before its weaker chunks join them up.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import groupby

from common.wire.schemas import SearchHit


def adjacent(a: SearchHit, b: SearchHit) -> bool:
    """Whether chunk ``b``, of ``a``'s camera and starting no earlier, follows ``a`` with no whole
    chunk between them (the module's rule)."""
    return b.start - a.end <= max(a.end - a.start, b.end - b.start)


def order(chunks: Sequence[SearchHit]) -> list[SearchHit]:
    """Best first; ties in camera and time order, so a search's answer does not depend on the
    order the indexes gave."""
    return sorted(chunks, key=lambda c: (-c.score, c.stream, c.start, c.first_seq))


def taken(ranked: Sequence[SearchHit], limit: int) -> tuple[int, float | None]:
    """How many of ``ranked`` (best first) make the moments, and the score of the chunk that would
    have made moment ``limit`` + 1 (None: there was none, the chunks ran out first). ``limit``
    chunks make at most ``limit`` moments: that chunk, when there is one, comes after them."""
    runs: dict[str, list[SearchHit]] = {}  # each camera's taken chunks in time order
    count = last_start = 0
    for i, c in enumerate(ranked):
        change, started = _added(runs.setdefault(c.stream, []), c)
        count += change
        if count > limit:
            return i, c.score
        if started:
            last_start = i + 1
    return max(last_start, min(limit, len(ranked))), None


def _added(line: list[SearchHit], c: SearchHit) -> tuple[int, bool]:
    """Put ``c`` in its place in its camera's taken chunks: how the count of runs changed (one
    more, less one for each neighbour it is adjacent to, plus one if those two were adjacent), and
    whether it started a run of its own (adjacent to neither)."""
    at = bisect.bisect(line, _when(c), key=_when)
    before, after = (line[at - 1] if at else None), (line[at] if at < len(line) else None)
    line.insert(at, c)
    joins = (before is not None and adjacent(before, c)) + (after is not None and adjacent(c, after))
    split = before is not None and after is not None and adjacent(before, after)
    return 1 - joins + split, joins == 0


def _when(c: SearchHit) -> tuple[float, float, int]:
    return (c.start, c.end, c.first_seq)


def moments(ranked: Sequence[SearchHit], limit: int) -> tuple[list[SearchHit], float | None]:
    """The moments of ``ranked`` chunks (best first, `order`): at most ``limit``, best first; and the
    score at which the taking stopped (`taken`)."""
    cut, stop = taken(ranked, limit)
    out = []
    for _, chunks in groupby(sorted(ranked[:cut], key=lambda c: (c.stream, *_when(c))), key=lambda c: c.stream):
        run: list[SearchHit] = []
        for c in chunks:
            if run and not adjacent(run[-1], c):
                out.append(merged(run))
                run = []
            run.append(c)
        out.append(merged(run))
    return order(out)[:limit], stop


def merged(run: Sequence[SearchHit]) -> SearchHit:
    """One moment of a camera's adjacent chunks (in time order): their range, their best chunk's
    score and place."""
    best = min(run, key=lambda c: (-c.score, c.start))
    first, last = run[0], run[-1]
    return SearchHit(
        best.stream,
        first.start,
        max(c.end for c in run),
        best.score,
        first.first_seq,
        last.last_seq,
        sum(c.frames for c in run),
        len(run),
        best.start,
        best.end,
        best.first_seq,
        best.last_seq,
    )
