"""GPU work as the scheduler sees it, and the executor that runs it where there is no scheduler.

Three shapes of work (vLLM's v1 engine separates the same way: the scheduler decides, the work
knows how to run itself):

- a `BatchWork` belongs to a lane (a stream); work of one class, one per lane, run together in one
  call (`run_batch`), e.g. the chunks of many streams through one vision forward and one prefill
  forward. A background lane (a temporary cache for a question about the past) is a question's
  work: steps of its own while encoding holds its guaranteed share, otherwise the places the
  others leave (scheduler.py). Such work usually finishes in one batch; one that does not (a
  chunk that set off an exact eviction, whose rebuild runs a piece per batch) stays first in its
  lane for the next;
- a `StepWork` runs for many steps; all active work of one class advances by one step in one
  call (`step_batch`), e.g. one decode step of every question being answered. A step is launched
  (`launch_batch`: queued on the device) and completed (`Launched.complete`: its results read
  back, the work advanced) apart, so the scheduler can run steps beside an encode step, and the
  next step can be queued before this one is read (`Launched.ahead`, `run_ahead`) where its
  inputs are this one's outputs on the device;
- a task is any callable that needs the GPU alone for a moment (a mirror applying a version).

`InlineExecutor` runs each work alone, at once, in the caller's thread: what tests, `replay` and
the benchmarks use. Services install a `Scheduler` (scheduler.py) that batches.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar, Protocol, TypeVar

T = TypeVar("T")


class Work:
    def __init__(self) -> None:
        self.future: Future[Any] = Future()

    @property
    def done(self) -> bool:
        return self.future.done()


class BatchWork(Work):
    lane: str = ""  # work of one lane (a stream) runs one per batch, in order
    # time.monotonic() since when it has waited: when the scheduler got it, or earlier where the
    # caller knows (a live chunk: since its last frame was captured, not since the stream's
    # thread, done with the chunk before, got to it)
    waiting_since: float = math.inf
    # a question's work, not a camera's (a history question's re-encode): steps of its own while
    # encoding holds its guaranteed share, otherwise only the places of an encode step the other
    # lanes leave; its wait never makes encoding due (scheduler.py, "the past")
    background: bool = False
    # time.monotonic() by which it must be done, or its camera drops frames (a live chunk: its
    # newest frame's capture plus the encoder's lag limit); inf: none (a file, a rebuild)
    deadline: float = math.inf

    @classmethod
    def run_batch(cls, batch: Sequence[BatchWork]) -> None:
        """Run one batch of every work; resolve the future of each that is finished (result or
        exception). Work left unresolved runs again, before anything else of its lane."""
        raise NotImplementedError


class Launched(Protocol):
    """A step queued on the device."""

    work: Sequence[StepWork]  # what it advances (a step queued ahead: what goes on, see `ahead`)

    def ready(self) -> bool:
        """The device has finished it: `complete` will not wait."""
        ...

    def complete(self) -> None:
        """Wait for it if need be, then advance its work; finished work resolves its future."""
        ...

    def device_s(self) -> float | None:
        """Once complete: its time on the device, from its launch to its end (None where the
        device does not time it)."""
        ...

    def ahead(self) -> Launched | None:
        """Before `complete`: the next step of its work queued behind it, fed from its outputs
        on the device, so the device does not wait for the host to read it; None where the
        next step needs what the host reads first (then `complete`, and launch as usual)."""
        ...


class StepWork(Work):
    """A work class implements `launch_batch`, or only `step_batch` when its steps cannot be
    launched apart from their completion."""

    max_batch: ClassVar[int] = 64

    def start(self) -> None:
        """It leaves the queue for its first step: the executor calls this once, before that
        step, in the thread that runs it (work takes what it needs only now, not while it waits)."""

    def pins(self) -> tuple[object, int] | None:
        """What it keeps from being written in place while it is active, if anything: a key (a
        stream) and the tokens the holder of the pages (the stream's cache) would need to write
        around it (an eviction's copy of the cache). The scheduler starts work only while the pool
        keeps room for one such copy per key that active work pins (scheduler.py)."""
        return None

    def scratch_tokens(self) -> int:
        """Pool tokens it takes when it starts."""
        return 0

    def may_start_beside(self) -> bool:
        """Whether this work, not started yet, may start beside an encode step in flight: only if
        all it reads is on the device already (a question's version may be one that step is still
        writing). No, unless a work class knows."""
        return False

    @classmethod
    def launch_batch(cls, batch: Sequence[StepWork], alongside: bool = False) -> Launched:
        """Queue one step of every work. `alongside`: the device may still be running an encode
        step, and the step goes beside it (it reads only what was finished before that step)."""
        cls.step_batch(batch)
        return _Finished(batch)

    @classmethod
    def step_batch(cls, batch: Sequence[StepWork]) -> None:
        """Advance every work by one step, now."""
        cls.launch_batch(batch).complete()


class _Finished:
    def __init__(self, work: Sequence[StepWork]):
        self.work = work

    def ready(self) -> bool:
        return True

    def complete(self) -> None:
        pass

    def device_s(self) -> float | None:
        return None

    def ahead(self) -> Launched | None:
        return None


class Executor(Protocol):
    def submit(self, work: BatchWork | StepWork) -> Future[Any]: ...
    def call(self, fn: Callable[[], T]) -> T: ...


class InlineExecutor:
    """Runs each work alone and to its end (every batch or step of it), now, in the calling thread; a
    lock keeps threads out of each other's forwards (a `streamvqa qa` mirror thread and its question
    thread, for example)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def submit(self, work: BatchWork | StepWork) -> Future[Any]:
        with self._lock:
            if isinstance(work, BatchWork):
                while not work.done:
                    type(work).run_batch([work])
            elif start(work):
                while not work.done:
                    run_ahead(type(work).launch_batch([work]))
        return work.future

    def call(self, fn: Callable[[], T]) -> T:
        with self._lock:
            return fn()


def run_ahead(launched: Launched) -> int:
    """Complete `launched` and the steps after it, each queued before the one before is read
    while the work allows it (`Launched.ahead`); the steps completed."""
    steps = 0
    step: Launched | None = launched
    while step is not None:
        ahead = step.ahead()
        step.complete()
        steps += 1
        step = ahead
    return steps


def start(work: StepWork) -> bool:
    """`work.start()`; False, with the work failed, if that raised (its own failure, e.g. no room)."""
    try:
        work.start()
    except Exception as e:
        fail_all([work], e)
        return False
    return True


def fail_all(batch: Sequence[BatchWork | StepWork], error: BaseException) -> None:
    for work in batch:
        if not work.future.done():
            work.future.set_exception(error)
