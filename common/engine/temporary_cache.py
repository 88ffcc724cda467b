"""A temporary cache of chosen past frames: what a question about a past span is answered from.

It is a fresh stream with the same system prefix and token layout as a live one (stream_engine.py),
whose frames go through the ordinary append path: the GPU scheduler encodes them (vision and
prefill) as a background lane: a question's work, in steps of its own while the cameras keep
their guaranteed share of the GPU, otherwise in the places of an encode step they leave
(scheduler.py, "the past"). Positions come out contiguous, as offline inference lays
out exactly these frames, so an answer from it equals one-shot inference on them
(tests/test_history.py). Given the tokens it will hold, it takes them from the pool at once, as a
budgeted stream takes its run, and never more (it never reaches its budget, so it never evicts):
what the question's turn at a history cache counted (qa_worker/history.py). When the block ends,
also on an error, the cache is let go of: its pages return to the pool once no question reads it
any more.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import Future
from types import TracebackType

import numpy as np

from common.engine.eviction import EvictionPolicy
from common.engine.grid import StreamSpec
from common.engine.kvcache import Version
from common.engine.runtime import Runtime
from common.engine.stream_engine import Appended, StreamEngine

# Frames appended at once are one chunk to the scheduler: several chosen chunks of the past a step
# (fewer encode steps than one each), but never so many tokens that one step holds cameras up long
# (about what 4 live 448² chunks are).
PIECE_TOKENS = 2048

_numbers = itertools.count(1)


class TemporaryCache:
    """A cache of past frames for the length of a `with` block (see module doc)."""

    def __init__(self, rt: Runtime, spec: StreamSpec, tokens: int | None = None):
        """`tokens`: all it will hold, the prefix included (None: it grows as it is appended to)."""
        # A lane of its own: history questions of one camera do not queue behind each other.
        lane = StreamSpec(f"{spec.name}~history{next(_numbers)}", spec.fps, spec.grid, spec.chunk_frames)
        policy = EvictionPolicy(max_cache_tokens=tokens)
        self._engine: StreamEngine | None = StreamEngine(rt, lane, policy, background=True)

    def append(self, frames: Sequence[np.ndarray], capture_times: Sequence[float], frame_seqs: Sequence[int]) -> None:
        """Encode these frames after those appended before (an odd count is padded, as a live
        stream's last chunk is: only the very last append may have one)."""
        self.finish(self.queue(frames, capture_times, frame_seqs))

    def queue(
        self, frames: Sequence[np.ndarray], capture_times: Sequence[float], frame_seqs: Sequence[int]
    ) -> Future[Appended]:
        """`append` without waiting: the frames are queued for the GPU behind those queued before
        (the cache's lane keeps its work in order); `finish` each, in the same order."""
        engine = self._held()
        return engine.submit(engine.prepare(frames, capture_times, frame_seqs))

    def finish(self, queued: Future[Appended]) -> None:
        """Wait for frames `queue`d and hand on what they made (stream_engine.py `finish`)."""
        self._held().finish(queued.result())

    @property
    def version(self) -> Version:
        """Everything appended so far (the prefix alone before the first append)."""
        return self._held().head

    def close(self) -> None:
        """Let go of the cache; its pages return to the pool once no question reads it."""
        self._engine = None

    def _held(self) -> StreamEngine:
        if self._engine is None:
            raise RuntimeError("the temporary cache was let go of")
        return self._engine

    def __enter__(self) -> TemporaryCache:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
