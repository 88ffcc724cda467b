"""Traces of the GPU scheduler's steps on demand: what to look at when a step in a running worker
takes longer than the engine benchmark says the same work should.

`request()` only sets a flag, so a signal handler may call it (a worker with `gpu_profile_dir`
set calls it on SIGUSR2). The scheduler's loop then runs its next `steps` steps under
torch.profiler (host and CUDA activity, each step labelled with its kind) and writes two files
to `out_dir`: a Chrome trace (open it in Perfetto: it shows where the device sat idle while the
host launched) and a table of the ops that took the most device time. Profiling is off
otherwise and costs nothing then. A trace that cannot be taken or written is a warning in the
log; serving goes on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import structlog
import torch

from common.engine.phases import set_tracing

log = structlog.get_logger()


class StepProfiler:
    def __init__(self, out_dir: str | Path, steps: int = 20):
        if steps < 1:
            raise ValueError("a profile covers at least one step")
        self.out_dir, self.steps = Path(out_dir), steps
        self._requested = False
        self._profile: torch.profiler.profile | None = None
        self._left = 0
        self.written: list[Path] = []  # every file written so far, in order

    def request(self) -> None:
        """Profile the next `steps` steps (a request while one runs is ignored)."""
        self._requested = True

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one scheduler step."""
        if self._requested and self._profile is None:
            self._start()
        try:
            yield
        finally:
            if self._profile is not None:
                self._left -= 1
                if self._left <= 0:
                    self._finish()

    def _start(self) -> None:
        self._requested = False
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities)
        try:
            profile.start()
        except RuntimeError as e:  # another profiler running, or CUPTI missing
            log.warning("gpu profile not taken", error=str(e))
            return
        self._profile, self._left = profile, self.steps
        set_tracing(True)
        log.info("gpu profile started", steps=self.steps)

    def _finish(self) -> None:
        profile, self._profile = self._profile, None
        assert profile is not None
        set_tracing(False)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        trace = self.out_dir / f"gpu-steps-{stamp}.json.gz"
        table = self.out_dir / f"gpu-steps-{stamp}.txt"
        device = "self_cuda_time_total" if torch.cuda.is_initialized() else "self_cpu_time_total"
        try:
            profile.stop()
            self.out_dir.mkdir(parents=True, exist_ok=True)
            profile.export_chrome_trace(str(trace))
            table.write_text(profile.key_averages().table(sort_by=device, row_limit=40) + "\n")
        except Exception as e:  # a full disk, or the profiler's own failure (with_stack=True once
            # failed to decode a frame's name and, uncaught here, stopped the worker): serving goes on
            log.warning("gpu profile not written", dir=str(self.out_dir), error=f"{type(e).__name__}: {e}")
            return
        self.written += [trace, table]
        log.info("gpu profile written", trace=str(trace), table=str(table), steps=self.steps)
