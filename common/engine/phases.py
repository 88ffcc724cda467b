"""The GPU loop's phases (vision, plan, prefill, publish, a decode step's launch, waiting for the
device...): labelled ranges in a trace while one is taken (profiling.py), and, always, a clock of
the host time each took in the loop's thread.

The clock answers, in a running worker and at no cost worth measuring (two clock reads a phase),
the question a trace answers only with its own host cost on top: is the loop waiting for the
device, or is the device waiting for the loop? Each phase gets its exclusive wall time (a
decode step launched between a prefill's layers is the decode launch's, not the prefill's) and
the thread's CPU time over the same stretches. Wall well above CPU where the loop never waits
for the device (a launch, a plan) is the thread waiting for the GIL: other threads' Python.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any

_local = threading.local()
_tracing = False  # a StepProfiler is recording (set and read in the GPU loop's thread)


class PhaseClock:
    """Seconds of wall and of the thread's CPU, by phase, exclusive of the phases nested in it,
    since the clock started. Written by one thread (the GPU loop's); metrics read the dicts from
    another (each value a float replaced whole)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._stack: list[str] = []
        self._since = (0.0, 0.0)

    def enter(self, name: str) -> None:
        self._charge()
        self._stack.append(name)

    def exit(self) -> None:
        self._charge()
        self._stack.pop()

    def _charge(self) -> None:
        now = (time.perf_counter(), time.thread_time())
        if self._stack:
            name = self._stack[-1]
            self.wall[name] = self.wall.get(name, 0.0) + now[0] - self._since[0]
            self.cpu[name] = self.cpu.get(name, 0.0) + now[1] - self._since[1]
        self._since = now


def clock_this_thread(clock: PhaseClock | None) -> None:
    """Phases entered in this thread from now on are timed on `clock` (None: no longer)."""
    _local.clock = clock


def set_tracing(on: bool) -> None:
    global _tracing
    _tracing = on


def phase(name: str) -> contextlib.AbstractContextManager[Any]:
    """A labelled range inside a step: timed on this thread's clock, if any, and a range of the
    trace being taken, if one is."""
    clock: PhaseClock | None = getattr(_local, "clock", None)
    if clock is None and not _tracing:
        return contextlib.nullcontext()
    return _Phase(name, clock)


class _Phase:
    __slots__ = ("clock", "name", "traced")

    def __init__(self, name: str, clock: PhaseClock | None):
        self.name, self.clock = name, clock
        # torch is imported wherever a trace is being taken; this module does not import it
        self.traced = sys.modules["torch"].profiler.record_function(name) if _tracing else None

    def __enter__(self) -> None:
        if self.clock is not None:
            self.clock.enter(self.name)
        if self.traced is not None:
            self.traced.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.traced is not None:
            self.traced.__exit__(*exc)
        if self.clock is not None:
            self.clock.exit()
