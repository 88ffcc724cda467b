"""Why the GPU loop stood still: one log line for every step that took over `slow_s`, and one for
every garbage collection that paused the process over `LONG_GC_S`.

Everything waits on the one GPU loop, so a step of seconds is frames dropped and answers late for
every camera. The pipeline has shown such stalls (4.7 s during 64 cameras' first evictions, H200,
2026-11-25) that neither the step metrics nor the log explained. Each slow-step line says what
happened meanwhile that is known to stall the loop: torch.compile work (dynamo frames) and time
spent collecting garbage; and how often the CUDA allocator has run out and retried since start.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import structlog

from common import metrics

log = structlog.get_logger()

SLOW_STEP_S = 1.0  # a step of 8 chunks over full 32K caches takes 0.2-0.3 s on an H200
LONG_GC_S = 0.2


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
        self.gc_s = 0.0  # spent collecting garbage since start
        self._gc_started = 0.0
        self._last = self._totals()
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def on_step(self, kind: str, seconds: float, units: int) -> None:
        metrics.record_gpu_step(kind, seconds, units)
        totals = self._totals()
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
