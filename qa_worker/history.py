"""Questions about the past: chunks of a camera's frames log, encoded again into a temporary cache.

A question with `since` (and `until`) names a span. Its logged frames are cut into chunks of the
stream's `chunk_frames` consecutive frames, oldest first (`logged_chunks`, from the log's indexes
alone), and as many as `history_max_tokens` holds are chosen evenly over the span (`evenly`); a
question looks up only the chunks it chooses (`chosen_chunks`: a week is 300,000 chunks).
`History.cache` reads exactly those frames back from the log, decodes them bit-identically to what
the encoder saw, and appends them to a temporary cache (common/engine/temporary_cache.py: the GPU
scheduler encodes them below live cameras), which the question is then answered from like a live
version; the cache is let go of afterwards, also on an error. The final's `ranges` are the
capture-time ranges of the chunks encoded: exactly what was seen.

Any other choice of logged chunks (a search's best matches) is answered the same way, by
`Answerer.answer_over` (answering.py).

Cameras first (docs/DESIGN.md "Admission"): a temporary cache takes its pages from the pool the
live streams write to, so `CacheGate` lets at most `history_max_concurrent` of them exist at once,
their tokens within the room the pool has beyond what the live streams are guaranteed; the other
questions wait for their turn in order, told their place, and get an error past
`max_queue_wait_s`; that wait is part of the final's `queue_s`. Logged frames are decoded in the
worker's decoder processes (common/decoding.py), not in the question's thread, which would hold the
GPU loop's GIL, all of a question's pieces handed to them at once, and each piece is queued for
the GPU once decoded, behind the one before: while the GPU encodes a piece, the processes decode
the next, so that decoding adds to a question's first token only the first piece's, and the
scheduler finds each next piece waiting (it encodes them back to back, common/engine/scheduler.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import redis

from common.decoding import FrameDecoder, Pending
from common.engine.answer import Waiting
from common.engine.grid import StreamSpec
from common.engine.kvcache import Version
from common.engine.runtime import Runtime
from common.engine.spans import capture_ranges
from common.engine.stream_engine import Appended
from common.engine.temporary_cache import PIECE_TOKENS, TemporaryCache
from common.framelog import FrameLog, FrameLogError, Record, decode
from common.wire import keys
from common.wire.manifest import from_manifest
from common.wire.schemas import FrameMsg, Question, SchemaError, manifest_from_bytes
from common.wire.timeref import in_the_future
from qa_worker.admission import Admission, Ticket

T = TypeVar("T")


class HistoryError(Exception):
    """Why a question about the past cannot be answered: its final's `error` (and `param`)."""

    def __init__(self, message: str, param: str | None = None, queue_s: float | None = None):
        """`queue_s`: how long it waited for a turn at a history cache before it was refused."""
        super().__init__(message)
        self.param, self.queue_s = param, queue_s


@dataclass(frozen=True)
class LoggedChunk:
    """Consecutive frames of one camera as its frames log holds them: the first and last frame
    seq, the first and last capture time, and how many frames (every chunk but a span's last has
    the stream's `chunk_frames`, an even number, so that no padding falls between chunks)."""

    frame_seqs: tuple[int, int]
    capture_range: tuple[float, float]
    frames: int


@dataclass(frozen=True)
class Seen:
    """What a temporary cache holds: its version, and the capture-time ranges of its chunks; how
    long the question waited for its turn at one (`CacheGate.turn`), and then, from its turn, for
    its chunks' records to be read from the log and its first piece decoded, and for the whole
    cache to be encoded."""

    version: Version
    ranges: tuple[tuple[float, float], ...]
    waited_s: float = 0.0
    decoded_s: float = 0.0
    encoded_s: float = 0.0


def logged_chunks(framelog: FrameLog, cam: str, t0: float, t1: float, chunk_frames: int) -> list[LoggedChunk]:
    """The frames the log holds captured at t0 <= ts <= t1, in chunks of `chunk_frames`, oldest
    first (the last one may be shorter)."""
    stamps = framelog.stamps(cam, t0, t1)
    chunks = []
    for i in range(0, len(stamps), chunk_frames):
        part = stamps[i : i + chunk_frames]
        chunks.append(LoggedChunk((part[0][0], part[-1][0]), (part[0][1], part[-1][1]), len(part)))
    return chunks


def chosen_chunks(
    framelog: FrameLog, cam: str, t0: float, t1: float, chunk_frames: int, n: Callable[[], int]
) -> list[LoggedChunk]:
    """`evenly(logged_chunks(...), n())`, with only the chosen chunks' first and last frames looked
    up: what a question builds is as large as what it chooses, not as its span (a list of a
    week's frames at 2 fps is 1.2 M stamps, built holding the GIL). `n()` is asked only of a span
    with frames (one without is the question's error first). A chunk whose file is collected
    meanwhile is left out."""
    ends: list[tuple[int, int]] = []  # the chosen chunks' first and last positions among the span's frames

    def wanted(frames: int) -> list[int]:
        firsts = evenly(range(0, frames, chunk_frames), n()) if frames else []
        ends.extend((a, min(a + chunk_frames, frames) - 1) for a in firsts)
        return [p for pair in ends for p in pair]

    stamps = framelog.stamps_at(cam, t0, t1, wanted)
    return [
        LoggedChunk((stamps[a][0], stamps[b][0]), (stamps[a][1], stamps[b][1]), b - a + 1)
        for a, b in ends
        if a in stamps and b in stamps
    ]


def evenly(chunks: Sequence[T], n: int) -> list[T]:
    """`n` of the chunks spread evenly over them, the first and the last included (the middle one
    alone for n = 1); all of them when they are no more than `n`."""
    if len(chunks) <= n:
        return list(chunks)
    if n == 1:
        return [chunks[len(chunks) // 2]]
    step = (len(chunks) - 1) / (n - 1)
    return [chunks[round(i * step)] for i in range(n)]


def span_of(q: Question, asked_at: float, now: float | None = None) -> tuple[float, float]:
    """The question's span as capture times (unix seconds), `since`/`until` counted from when it
    was asked; an `until` later than now is now. HistoryError when `since` is not before the
    asking (however late a worker takes the question: it asks about the past), or the span is empty."""
    assert q.since is not None
    now = time.time() if now is None else now
    t0 = q.since.resolve(asked_at)
    if future := in_the_future(t0, asked_at):
        raise HistoryError(future, param="since")
    t1 = min(q.until.resolve(asked_at), now) if q.until is not None else min(asked_at, now)
    if t1 <= t0:
        field = "until" if q.until is not None else "since"
        raise HistoryError(f"{field}: the span is empty (until must be later than since)", param=field)
    return t0, t1


class CacheGate:
    """Turns at holding a temporary cache: at most `at_once` at a time, their tokens within
    `room()` (None: no bound); the others wait in the order they came, for `max_wait_s` at most.
    Their places and estimated waits are counted by an `Admission` (admission.py), as the GPU
    queue's are."""

    def __init__(self, at_once: int, room: Callable[[], int | None], max_wait_s: float):
        self.at_once, self.room, self.max_wait_s = at_once, room, max_wait_s
        self.queue = Admission()
        self._changed = threading.Condition()
        self._held: dict[int, int] = {}  # ticket seq -> the tokens its cache may hold

    @contextmanager
    def turn(self, tokens: int, tell: Callable[[Ticket], None]) -> Iterator[float]:
        """The block runs once a cache of `tokens` may be held, given how long it waited for that
        (seconds, on the clock `total_s` counts on); `tell(ticket)` while it waits (after
        `Waiting.first_s`, then every `Waiting.every_s`). HistoryError past `max_wait_s`."""
        ticket, taken = self.queue.take(), time.perf_counter()
        try:
            self._wait(ticket, tokens, tell)
            yield time.perf_counter() - taken
        finally:
            with self._changed:
                self._held.pop(ticket.seq, None)
                self.queue.done(ticket)
                self._changed.notify_all()

    def _wait(self, ticket: Ticket, tokens: int, tell: Callable[[Ticket], None]) -> None:
        start = time.monotonic()
        deadline, report_at = start + self.max_wait_s, start + Waiting.first_s
        while True:
            with self._changed:
                if self._may_start(ticket, tokens):
                    self._held[ticket.seq] = tokens
                    self.queue.start(ticket)
                    return
                if time.monotonic() >= deadline:
                    waited = time.monotonic() - start
                    raise HistoryError(
                        f"busy: this question about the past waited {waited:.1f} s for a history "
                        f"cache (history_max_concurrent {self.at_once}, and the KV pool's room beside the live "
                        f"streams), past max_queue_wait_s ({self.max_wait_s:g} s): ask again later",
                        queue_s=waited,
                    )
                self._changed.wait(max(0.0, min(report_at, deadline) - time.monotonic()))
            if time.monotonic() >= report_at:  # outside the lock: telling writes to Redis
                tell(ticket)
                report_at = time.monotonic() + Waiting.every_s

    def _may_start(self, ticket: Ticket, tokens: int) -> bool:
        """First in line, a turn free, and room for its tokens (under the lock)."""
        if self.queue.position(ticket) != 1 or len(self._held) >= self.at_once:
            return False
        room = self.room()
        return room is None or sum(self._held.values()) + tokens <= room


class History:
    """What a worker needs to answer about the past: the model, the frames log, the budget, the
    turns at a temporary cache (`gate`) and the processes that decode logged frames (none: this
    thread decodes them)."""

    def __init__(
        self,
        rt: Runtime,
        r: redis.Redis,
        framelog_dir: str | None,
        max_tokens: int,
        *,
        max_concurrent: int = 2,
        max_wait_s: float = 30.0,
        live_tokens: int | None = None,
        decoder: FrameDecoder | None = None,
    ):
        """`live_tokens`: the KV pool tokens the live streams of this process are guaranteed
        (`Runtime.live_tokens`); None: no bound but the pool's own."""
        self.rt, self.r, self.max_tokens = rt, r, max_tokens
        self.framelog = FrameLog(framelog_dir) if framelog_dir is not None else None
        self.live_tokens, self.decoder = live_tokens, decoder
        self.gate = CacheGate(max_concurrent, self.room, max_wait_s)

    def room(self) -> int | None:
        """The KV pool tokens temporary caches may hold together: the pool's limit less what the
        live streams are guaranteed; None when either is unbounded (a CPU pool grows as needed)."""
        limit = self.rt.pool.limit_tokens()
        return None if limit is None or self.live_tokens is None else limit - self.live_tokens

    def spec(self, cam: str) -> StreamSpec:
        """The stream's grid, fps and chunk size, as its encoder publishes them (its head)."""
        raw = self.r.get(keys.head(cam))
        if raw is None:
            raise HistoryError(f"stream {cam!r} has no cache yet: its grid is not known")
        try:
            return from_manifest(manifest_from_bytes(raw)).spec
        except SchemaError as e:
            raise HistoryError(f"stream {cam!r}: its head does not decode ({e})") from None

    def choose(self, q: Question, asked_at: float) -> tuple[StreamSpec, list[LoggedChunk]]:
        """The chunks of the question's span to answer over, evenly spaced within the budget."""
        log = self._log()
        t0, t1 = span_of(q, asked_at)
        spec = self.spec(q.stream)
        try:
            chunks = chosen_chunks(log, q.stream, t0, t1, spec.chunk_frames, lambda: self.fit(spec))
        except OSError as e:
            raise HistoryError(f"the frames log is not readable: {e}") from None
        if not chunks:
            # the span asked for is what is wrong: it names no logged video (since sets where it starts)
            message = f"stream {q.stream!r}: the frames log holds no frame of {_span_text(t0, t1)}"
            raise HistoryError(message, param="since")
        return spec, chunks

    def fit(self, spec: StreamSpec) -> int:
        """How many of the stream's chunks a temporary cache of `history_max_tokens` holds (at
        least one, else HistoryError): how many a question over its past may be answered over."""
        fit = (self.max_tokens - len(self.rt.prefix_ids())) // self.tokens(spec, spec.chunk_frames)
        if fit < 1:
            raise HistoryError(f"history_max_tokens ({self.max_tokens}) holds no chunk of stream {spec.name!r}")
        return fit

    def tokens(self, spec: StreamSpec, frames: int) -> int:
        """Cache tokens of a chunk of `frames` frames (an odd one padded to whole temporal patches)."""
        tp = self.rt.loaded.temporal_patch_size
        return -(-frames // tp) * spec.grid.tokens_per_patch

    @contextmanager
    def cache(
        self, spec: StreamSpec, chunks: Sequence[LoggedChunk], tell: Callable[[Ticket], None] = lambda _: None
    ) -> Iterator[Seen]:
        """A temporary cache of exactly these chunks' logged frames, in this order, once it is this
        question's turn (`gate`; `tell(ticket)` while it waits); let go of when the block ends. A
        chunk whose frames the log no longer holds (collected meanwhile) is left out, and so is it
        from the ranges; HistoryError if none is left, or if the pool can never hold such a cache
        (or with the wait as its `queue_s`, past `max_queue_wait_s` waiting for a turn)."""
        log = self._log()
        room = self.room()
        if room is not None and self.rt.in_pages(self.max_tokens) > room:
            raise HistoryError(
                f"history_max_tokens ({self.max_tokens}) is more than the KV pool holds for questions about the "
                f"past ({max(room, 0)} tokens beside what the live streams are guaranteed): lower history_max_tokens"
            )
        tokens = len(self.rt.prefix_ids()) + sum(self.tokens(spec, c.frames) for c in chunks)
        with self.gate.turn(self.rt.in_pages(tokens), tell) as waited, TemporaryCache(self.rt, spec, tokens) as cache:
            t0 = time.perf_counter()
            seen, decoded_s = self._fill(log, spec, chunks, cache)
            if not seen:
                raise HistoryError(f"stream {spec.name!r}: the frames log no longer holds those frames")
            ranges = tuple(capture_ranges((c.frame_seqs, c.capture_range) for c in seen))
            yield Seen(cache.version, ranges, waited, decoded_s - t0, time.perf_counter() - t0)

    def _fill(
        self, log: FrameLog, spec: StreamSpec, chunks: Sequence[LoggedChunk], cache: TemporaryCache
    ) -> tuple[list[LoggedChunk], float]:
        """Append the chunks' frames to the cache piece by piece, in order; the chunks appended,
        and when (`time.perf_counter`) the first piece's frames were decoded (every piece's
        records read by then).
        Every piece is read and handed to the decoder at once, and each is queued for the GPU as
        soon as it is decoded, behind the one before (its lane keeps them in order): the
        scheduler finds the next piece waiting when one is done and can encode them back to back
        (scheduler.py, "the past"), while the later ones still decode. An error drops the pieces
        not yet decoded, and waits for those already queued (they write the cache)."""
        reads = [self._read(log, spec, piece) for piece in self._pieces(spec, chunks)]
        queued: list[Future[Appended]] = []
        seen: list[LoggedChunk] = []
        decoded, first_decoded = 0, 0.0
        try:
            for read in reads:
                frames = self._checked(spec, read.frames)
                decoded += 1
                first_decoded = first_decoded or time.perf_counter()
                if frames:
                    rgb = [m.rgb() for m in frames]
                    queued.append(cache.queue(rgb, [m.ts for m in frames], [m.seq for m in frames]))
                    seen += read.found
            for appended in queued:
                cache.finish(appended)
        finally:
            for read in reads[decoded:]:
                read.cancel()
            futures.wait(queued)
            queued.clear()  # their results hold the cache's pages: an error's traceback keeps this frame
        return seen, first_decoded

    def _pieces(self, spec: StreamSpec, chunks: Sequence[LoggedChunk]) -> Iterator[list[LoggedChunk]]:
        """Runs of consecutive chunks of at most PIECE_TOKENS (a chunk larger alone): one append each."""
        piece: list[LoggedChunk] = []
        tokens = 0
        for chunk in chunks:
            n = self.tokens(spec, chunk.frames)
            if piece and tokens + n > PIECE_TOKENS:
                yield piece
                piece, tokens = [], 0
            piece.append(chunk)
            tokens += n
        if piece:
            yield piece

    def _records(self, log: FrameLog, spec: StreamSpec, chunk: LoggedChunk) -> list[Record]:
        """The chunk's records as logged (its seqs, captured in its time range); none when the log
        lacks one of them."""
        (first, last), (t0, t1) = chunk.frame_seqs, chunk.capture_range
        try:
            records = [rec for rec in log.between(spec.name, t0, t1) if first <= rec.seq <= last]
        except (FrameLogError, OSError) as e:
            raise HistoryError(f"frames {first}-{last} of the frames log are not readable: {e}") from None
        return records if len(records) == chunk.frames else []

    def _read(self, log: FrameLog, spec: StreamSpec, piece: Sequence[LoggedChunk]) -> _Read:
        """The piece's chunks the log still holds, their records handed to the decoder's processes
        (decoded bit-identically to what the encoder saw) or, without one, to be decoded here."""
        found = [(chunk, records) for chunk in piece if (records := self._records(log, spec, chunk))]
        raws = [rec.raw for _, records in found for rec in records]
        return _Read([chunk for chunk, _ in found], raws, self.decoder.submit_logged(raws) if self.decoder else None)

    def _checked(self, spec: StreamSpec, frames: Callable[[], list[FrameMsg]]) -> list[FrameMsg]:
        """The frames `frames()` decodes. One that does not, or of another size than the stream's
        grid (the camera was set up anew since), is an error: not what the stream's chunks are made of."""
        try:
            decoded = frames()
        except ValueError as e:  # SchemaError is a ValueError
            raise HistoryError(f"frames of the frames log do not decode: {e}") from None
        grid = spec.grid
        for m in decoded:
            if (m.h, m.w) != (grid.height, grid.width):
                raise HistoryError(f"frame {m.seq} is not on the stream's {grid.height}x{grid.width} grid")
        return decoded

    def _log(self) -> FrameLog:
        if self.framelog is None:
            raise HistoryError("this worker has no frames log (framelog_dir): it answers about the live cache only")
        return self.framelog


@dataclass
class _Read:
    """A piece's chunks that the frames log still holds, and their records' frames: decoding in the
    decoder's processes (`pending`) or, with none, decoded when asked for."""

    found: list[LoggedChunk]
    raws: list[bytes]
    pending: Pending | None

    def frames(self) -> list[FrameMsg]:
        return self.pending.result() if self.pending is not None else [decode(raw) for raw in self.raws]

    def cancel(self) -> None:
        if self.pending is not None:
            self.pending.cancel()


def _span_text(t0: float, t1: float) -> str:
    fmt = "%Y-%m-%dT%H:%M:%SZ"
    return f"{time.strftime(fmt, time.gmtime(t0))} .. {time.strftime(fmt, time.gmtime(t1))}"
