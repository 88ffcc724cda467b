"""Why the GPU loop stood still: one log line for every step that took over `slow_s`, one for
every garbage collection that paused the process over `LONG_GC_S`, a watch for a step that never
ends, and a sampler of where every thread is while a step runs long.

Everything waits on the one GPU loop, so a step of seconds is frames dropped and answers late for
every camera. The pipeline has shown such stalls (4.7 s during 64 cameras' first evictions, H200,
2026-11-25) that neither the step metrics nor the log explained. Each slow-step line says what
happened meanwhile that is known to stall the loop: torch.compile work (dynamo frames) and time
spent collecting garbage; and how often the CUDA allocator has run out and retried since start.
With a `StepSampler`, it also says where the loop's thread and the process's other busy threads
were while the step ran long, and how late the sampler woke (a late wake is the GIL or a CPU
held elsewhere): the 1-chunk encode steps of 1.5-1.9 s that 64-camera pipelines showed every
~11 s (H200, 2026-11-27) stopped the questions' decoding too, and nothing logged said why.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from common import metrics

if TYPE_CHECKING:
    from common.engine.scheduler import Scheduler

log = structlog.get_logger()

SLOW_STEP_S = 1.0  # a step of 8 chunks over full 32K caches takes 0.2-0.3 s on an H200
LONG_GC_S = 0.2
SAMPLE_EVERY_S = 0.05  # how often the sampler looks while a step runs long
TOP_PLACES = 4  # places named in a slow step's line, per kind
# files whose innermost frame means a thread waiting, not working (locks, queues, pools)
_WAITING = ("threading.py", "queue.py", "concurrent/futures/thread.py", "concurrent/futures/_base.py")


def freeze_heap() -> int:
    """Once the model is loaded and warmed up: everything alive now (modules, weights' wrappers,
    compiled graphs and their guards, tens of thousands of objects that live as long as the
    process) goes to the permanent generation, which no collection walks again, so full
    collections while serving walk only what serving made. vLLM and SGLang do the same after
    their warm-up. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class StallWatch:
    """The scheduler's step observer (it records every step's metrics too) and a garbage
    collection timer. `close()` takes the timer off again."""

    def __init__(self, slow_s: float = SLOW_STEP_S):
        self.slow_s = slow_s
        self.sampler: StepSampler | None = None  # set once the scheduler it samples exists
        self.gc_s = 0.0  # spent collecting garbage since start
        self._gc_started = 0.0
        self._last = self._totals()
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def on_step(self, kind: str, seconds: float, units: int) -> None:
        metrics.record_gpu_step(kind, seconds, units)
        totals = self._totals()
        samples = self.sampler.take() if self.sampler is not None else {}
        if seconds > self.slow_s:
            during = {name: round(totals[name] - self._last[name], 3) for name in totals}
            log.warning(
                "gpu step slow",
                kind=kind,
                seconds=round(seconds, 2),
                units=units,
                **during,
                # since start: the allocator's stats are a dict built per read, too dear for every step
                alloc_retries_total=metrics.alloc_retries(),
                **samples,
            )
        self._last = totals

    def _totals(self) -> dict[str, float]:
        # read at every step (dozens a second): dict reads only
        return {"compiled_frames": metrics.compiled_frames("total"), "gc_s": self.gc_s}

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # collections run one at a time under the GIL, whichever thread set one off
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        spent = time.perf_counter() - self._gc_started
        self.gc_s += spent
        if spent > LONG_GC_S:
            log.warning(
                "long garbage collection",
                seconds=round(spent, 3),
                generation=info.get("generation"),
                collected=info.get("collected"),
            )


class StuckWatch:
    """A step that never ends (a hung device, a deadlock) cannot be reported by the loop running
    it, and everything waits on that loop: this thread looks at it every second or so, and once a
    step has run past `stuck_s` calls `on_stuck(seconds, stack)`, `stack` the loop thread's Python
    frames, innermost last. A 64-camera worker once stopped like that with not one line logged."""

    def __init__(self, scheduler: Scheduler, stuck_s: float, on_stuck: Callable[[float, list[str]], None]):
        self.scheduler, self.stuck_s, self.on_stuck = scheduler, stuck_s, on_stuck
        self._thread = threading.Thread(target=self._run, name="gpu-stuck-watch", daemon=True)

    def start(self) -> StuckWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.stuck_s / 4))
            began = self.scheduler.step_began
            if began is not None and time.monotonic() - began > self.stuck_s:
                self.on_stuck(time.monotonic() - began, thread_stack(self.scheduler.thread))
                return


class StepSampler:
    """Where the threads are while a GPU step runs long. Every `SAMPLE_EVERY_S`, once the running
    step has passed `after_s`, it counts the loop thread's two innermost frames and those of every
    other thread not waiting on a lock or a queue, and keeps how late it woke. `take()` hands what
    was counted since the last take to the step's observer (StallWatch) and starts afresh."""

    def __init__(self, scheduler: Scheduler, after_s: float = SLOW_STEP_S / 2):
        self.scheduler, self.after_s = scheduler, after_s
        self._lock = threading.Lock()
        self._loop: Counter[str] = Counter()
        self._busy: Counter[str] = Counter()
        self._late_s = 0.0
        self._takes = 0  # a sample begun before a take belongs to the step taken: it is dropped
        self._thread = threading.Thread(target=self._run, name="gpu-step-sampler", daemon=True)

    def start(self) -> StepSampler:
        self._thread.start()
        return self

    def take(self) -> dict[str, object]:
        """`loop_at` and `busy_at`: the most sampled places ("thread file:line function < caller",
        with counts), `sampler_late_max_s`; empty when nothing was sampled."""
        with self._lock:
            self._takes += 1
            if not self._loop and not self._busy:  # nearly every step: nothing new made on the GPU loop
                return {}
            loop, busy, late = self._loop, self._busy, self._late_s
            self._loop, self._busy, self._late_s = Counter(), Counter(), 0.0
        top = dict(loop.most_common(TOP_PLACES)), dict(busy.most_common(TOP_PLACES))
        return {"loop_at": top[0], "busy_at": top[1], "sampler_late_max_s": round(late, 3)}

    def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            time.sleep(SAMPLE_EVERY_S)
            late = time.perf_counter() - t0 - SAMPLE_EVERY_S
            began = self.scheduler.step_began
            if began is not None and time.monotonic() - began > self.after_s:
                self._sample(late)

    def _sample(self, late: float) -> None:
        with self._lock:
            takes = self._takes
        loop = self.scheduler.thread
        names = {t.ident: t.name for t in threading.enumerate()}
        places = []
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            if loop is not None and ident == loop.ident:
                places.append((True, _place(frame)))
            elif not frame.f_code.co_filename.endswith(_WAITING):
                places.append((False, f"{names.get(ident, '?').rstrip('_0123456789')} {_place(frame)}"))
        with self._lock:
            if self._takes != takes:
                return
            self._late_s = max(self._late_s, late)
            for on_loop, place in places:
                (self._loop if on_loop else self._busy)[place] += 1


def _place(frame: Any) -> str:
    """ "file:line function < caller's file:line function", the file's last two path parts."""
    inner = traceback.extract_stack(frame, limit=2)[::-1]
    return " < ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}" for f in inner)


def thread_stack(thread: threading.Thread | None, frames: int = 16) -> list[str]:
    """Where `thread` is now, as "file:line function" from its innermost `frames` frames."""
    frame = sys._current_frames().get(thread.ident) if thread is not None and thread.ident else None
    if frame is None:
        return []
    return [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)[-frames:]]
