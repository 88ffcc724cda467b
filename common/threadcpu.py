"""CPU time of this process's threads, by role: which part of a worker keeps its cores (and, for
Python code, its GIL) busy. A GPU worker whose loop thread waits for the GIL launches kernels
late and leaves the device idle (docs/BENCHMARKS.md); this says who else was running.

A thread's role is its name less its number: `stream_12` is `stream`, `question_3` is `question`,
`ingest:cam1` is `ingest`. Threads Python did not start (torch's, CUDA's, the allocator's) are
`native`. Totals only grow: a thread that ends keeps what it used. Linux (/proc); elsewhere empty.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

_TASKS = Path("/proc/self/task")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_TARGET = re.compile(r"\s*\(.*\)$")  # threading's "Thread-5 (run)"
_NUMBER = re.compile(r"[_-]\d+$")


def role(name: str) -> str:
    return _NUMBER.sub("", _TARGET.sub("", name.split(":", 1)[0])) or name


class ThreadCPU:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[int, float] = {}  # tid -> CPU seconds at the last reading
        self._totals: dict[str, float] = {}

    def totals(self) -> dict[str, float]:
        """CPU seconds by role since the first reading's threads started."""
        if not _TASKS.is_dir():
            return {}
        names = {t.native_id: role(t.name) for t in threading.enumerate() if t.native_id is not None}
        with self._lock:
            for tid, seconds in _cpu_seconds().items():
                used = seconds - self._seen.get(tid, 0.0)
                self._seen[tid] = seconds
                key = names.get(tid, "native")
                self._totals[key] = self._totals.get(key, 0.0) + used
            return dict(self._totals)


def _cpu_seconds() -> dict[int, float]:
    out = {}
    for task in _TASKS.iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime
    return out
