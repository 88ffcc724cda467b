"""GPU work as the scheduler sees it, and the executor that runs it where there is no scheduler.

Three shapes of work (vLLM's v1 engine separates the same way: the scheduler decides, the work
knows how to run itself):

- a `BatchJob` belongs to a lane (a stream); jobs of one class, one per lane, run together in one
  call (`run_batch`), e.g. the chunks of many streams through one vision forward and one prefill
  forward. A background lane (a temporary cache for a question about the past) gets only the
  places that the others leave. A job usually finishes in one batch; one that does not (a chunk that set off an exact
  eviction, whose rebuild runs a piece per batch) stays first in its lane for the next;
- a `StepJob` runs for many steps; every active job of one class advances by one step in one
  call (`step_batch`), e.g. one decode step of every question being answered. A step is launched
  (`launch_batch`: queued on the device) and completed (`Launched.complete`: its results read
  back, the jobs advanced) apart, so the scheduler can run steps beside an encode step;
- a task is any callable that needs the GPU alone for a moment (a mirror applying a version).

`InlineExecutor` runs each job alone, at once, in the caller's thread: what tests, `replay` and
the benchmarks use. Services install a `Scheduler` (scheduler.py) that batches.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar, Protocol, TypeVar

T = TypeVar("T")


class Job:
    def __init__(self) -> None:
        self.future: Future[Any] = Future()

    @property
    def done(self) -> bool:
        return self.future.done()


class BatchJob(Job):
    lane: str = ""  # jobs of one lane (a stream) run one per batch, in order
    # time.monotonic() since when it has waited: when the scheduler got it, or earlier where the
    # caller knows (a live chunk: since its last frame was captured, not since the stream's
    # thread, done with the chunk before, got to it)
    waiting_since: float = math.inf
    # below every lane that is not: it takes only the places of an encode step those leave, and
    # its wait never makes encoding due (a history question's re-encode yields to live cameras)
    background: bool = False

    @classmethod
    def run_batch(cls, jobs: Sequence[BatchJob]) -> None:
        """Run one batch of every job; resolve the future of each job that is finished (result or
        exception). A job left unresolved runs again, before anything else of its lane."""
        raise NotImplementedError


class Launched(Protocol):
    """A step queued on the device."""

    def ready(self) -> bool:
        """The device has finished it: `complete` will not wait."""
        ...

    def complete(self) -> None:
        """Wait for it if need be, then advance its jobs; a finished job resolves its future."""
        ...

    def device_s(self) -> float | None:
        """Once complete: its time on the device, from its launch to its end (None where the
        device does not time it)."""
        ...


class StepJob(Job):
    """A job class implements `launch_batch`, or only `step_batch` when its steps cannot be
    launched apart from their completion."""

    max_batch: ClassVar[int] = 64

    def may_start_beside(self) -> bool:
        """Whether this job, not started yet, may start beside an encode step in flight: only if
        all it reads is on the device already (a question's version may be one that step is still
        writing). No, unless a job class knows."""
        return False

    @classmethod
    def launch_batch(cls, jobs: Sequence[StepJob], alongside: bool = False) -> Launched:
        """Queue one step of every job. `alongside`: the device may still be running an encode
        step, and the step goes beside it (it reads only what was finished before that step)."""
        cls.step_batch(jobs)
        return _Finished()

    @classmethod
    def step_batch(cls, jobs: Sequence[StepJob]) -> None:
        """Advance every job by one step, now."""
        cls.launch_batch(jobs).complete()


class _Finished:
    def ready(self) -> bool:
        return True

    def complete(self) -> None:
        pass

    def device_s(self) -> float | None:
        return None


class Executor(Protocol):
    def submit(self, job: BatchJob | StepJob) -> Future[Any]: ...
    def call(self, fn: Callable[[], T]) -> T: ...


class InlineExecutor:
    """Runs each job alone and to its end (every batch or step of it), now, in the calling thread; a
    lock keeps threads out of each other's forwards (a `streamvqa qa` mirror thread and its question
    thread, for example)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def submit(self, job: BatchJob | StepJob) -> Future[Any]:
        run = type(job).run_batch if isinstance(job, BatchJob) else type(job).step_batch
        with self._lock:
            while not job.done:
                run([job])
        return job.future

    def call(self, fn: Callable[[], T]) -> T:
        with self._lock:
            return fn()


def fail_all(jobs: Sequence[BatchJob | StepJob], error: BaseException) -> None:
    for job in jobs:
        if not job.future.done():
            job.future.set_exception(error)
