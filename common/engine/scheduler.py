"""One scheduler per GPU: a loop that owns the device and decides, every step, what runs.

**Invariant.** Only the loop's thread runs forwards; callers in any thread submit work (work.py)
and wait on futures, so no lock is taken in turns around the device. Steps run one at a time, and
each ends with the device idle (a sync): what a step wrote is on the device before the next step
is chosen, and pages the pool let go of during it are free again only then (`on_settled`). Given
that, every step guarantees:

- cameras first: a live chunk carries its deadline, when its camera starts dropping frames (its
  newest frame's capture plus the encoder's `max_lag_s`). Once a waiting chunk has used
  `deadline_share` of the time to its deadline, the cameras are at risk: every step encodes, first,
  with no share limit; questions take one decode step an encode step, beside it, and start only
  while none is being answered (one at a time: never starved, and one question's steps cost
  encoding little), until no chunk is that late. Questions can slow encoding down (their steps
  beside it, their batch growing), but not past that point: they never make a camera that
  encoding alone keeps up with drop a frame;
- encoding: otherwise, whenever chunks wait, they get at least `encode_share` of recent GPU time,
  up to `max_encode_share` once one has waited past `chunk_deadline_s`, and all of it when no
  question waits; streams are served round-robin, one chunk each an encode step, so when the GPU
  cannot keep up every stream falls behind (and drops frames) alike;
- the past: background lanes (a question's temporary cache of past frames) are questions' work,
  not the cameras'. While no camera is at risk and the past has credit left, a step of their own
  encodes them (one piece each, questions decoding beside it), ahead of chunks that are merely
  late: a question about the last minutes gets its cache in one burst instead of the places the
  cameras leave, which at a full GPU are none (118 s to a first token, 64 cameras, H200,
  2026-11-29). The credit is a token bucket of GPU seconds (`_PastCredit`): it fills at
  `history_share` of the clock's time up to `history_burst_s`, and the past's own steps spend it.
  So a lone question's pieces run back to back (gated by encoding's share instead, they got one
  step in every few; with the credit a question's four pieces took 0.57-1.07 s while the cameras
  had room, 64 cameras, H200, 2026-11-29), and askers about the past who never stop get at most
  `history_share` of the GPU. Without credit
  they fill the places of an encode step the streams leave; their wait never makes encoding
  due, and their steps count as questions' time in the shares, so the cameras get it back after
  (a burst is borrowed from encoding's share, never from a camera at risk);
- questions: every active question advances one token a step (at most `max_batch` active), and
  with `decode_during_encode` never waits out a whole encode step: it decodes beside the step's
  layers. The others wait in order of arrival, and start (`StepWork.start`) in that order;
- room to evict: a question reading a stream's version makes that stream's next eviction copy
  its whole cache (kvcache.py: copy-on-write), so, given the pool's `room` (tokens allocations
  can still get), a waiting question starts only if, after it, the pool keeps room for one such
  copy per distinct stream that active questions pin, this one's counted, plus its own scratch
  (and that of those starting with it): room >= sum over pinned streams of their run (budget)
  + scratch (`StepWork.pins`, `StepWork.scratch_tokens`). One that does not fit waits, and
  those after it wait behind it (no overtaking); they start as active questions finish. With
  no question active one starts regardless (a pool too small for the rule would otherwise hold
  questions forever). So questions never take the room a camera's eviction needs: without the
  rule, questions queued and answered at once pinned old caches until a chunk found no room
  (`PoolFull`, 64 cameras, H200, 2026-11-28);
- failures: work that fails fails alone (its future); a failure outside any work (a CUDA error
  that poisons the device) fails all work and stops the loop (`on_fatal`).

**A step**, in order:

1. tasks (a mirror applying a version, a stream restoring from the store): short, and questions
   may be waiting on them;
2. questions: waiting ones start, in order, up to `max_batch` (one at a time at risk) and while
   the pool keeps room to evict (above); one
   batched forward advances every active generation by a token (the prefill of those just started
   rides in it), and while the loop would choose nothing else (no task, no question waiting, no
   encode step due) up to `AHEAD_STEPS` more, each queued before the one before is read
   (`Launched.ahead`). Skipped when an encode step is due and `decode_before_encode` is off, or the
   cameras are at risk: it then runs beside that step's first kernels;
3. or, while the past may go ahead (above), one step of the background lanes alone, like an
   encode step;
4. chunks, when none but they wait or encoding is due (above): up to `max_chunks`, one vision and
   one prefill forward. Questions being answered decode beside it, launched between its layers
   (interleave.py), and those arriving meanwhile join them once all they read is on the device
   (`StepWork.may_start_beside`), unless the cameras are at risk. A stream whose chunk set off an
   exact eviction adds one piece of its rebuild (at most `EvictionPolicy.rebuild_piece_tokens`
   tokens) to each encode step instead, until its rebuilt version is published; its next chunk
   waits for that, as it must.

**Settings** (`SchedulePolicy` declares each with its default and help; the services set them as
`gpu_*`, see README):

| setting | decides |
|---|---|
| `max_batch` | questions advanced together; the rest wait in order |
| `max_chunks` | chunks encoded together: bounds how long one encode step holds up questions |
| `encode_share` | share of recent GPU time encoding always gets while questions also wait |
| `chunk_deadline_s` | a chunk waiting longer makes encoding due up to `max_encode_share` |
| `max_encode_share` | the most encoding takes from waiting questions while no camera is at risk |
| `deadline_share` | a chunk that used this share of the time to its deadline puts the cameras at risk (above) |
| `window_s` | about how long the shares are measured over (an exponential decay) |
| `decode_during_encode` | questions being answered decode beside an encode step, between its layers |
| `decode_before_encode` | questions take a step alone before each encode step; off, beside its first kernels |
| `join_during_encode` | questions arriving during an encode step start beside it (needs the pool to defer frees) |
| `decode_sms` | SMs an encode step leaves to the decode kernels beside it (a green context), while encoding keeps up |
| `history_share`, `history_burst_s` | the past's steps of its own: their share of GPU time, how much at once |
| `room` (argument) | tokens the KV pool can still give (`KVPool.room_tokens`), kept for evictions' copies |
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from common.engine.interleave import interleaved
from common.engine.phases import PhaseClock, clock_this_thread, phase
from common.engine.settings import setting
from common.engine.work import BatchWork, Launched, StepWork, fail_all, start

if TYPE_CHECKING:  # not imported at run time: settings load SchedulePolicy without torch
    from common.engine.profiling import StepProfiler

log = structlog.get_logger()
T = TypeVar("T")
STOPPED = "the GPU scheduler stopped"  # the error of work given to a scheduler that stopped
# Decode steps in a row, each queued before the one before is read (`Launched.ahead`), while the
# loop would choose decoding again anyway; then it decides afresh (a question to start, say).
AHEAD_STEPS = 8


StepObserver = Callable[[str, float, int], None]  # (kind, seconds, units) after every step
# The kinds of step `on_step` sees: chunks encoded, the past (background lanes) alone, questions
# advanced, tasks run.
STEP_KINDS = ("encode", "history", "decode", "task")


@dataclass
class DecodeTimes:
    """Where the time of the questions being answered goes, in seconds since the loop started:
    what separates an answer's time a token from the time of a decode step (metrics read it from
    another thread; each field is a float written by the loop alone).

    - `steps`: decode steps from launch until the loop read their tokens;
    - `device`: the same steps on the device, from launch to their end, where the device times
      them (a GPU). `steps - device` is how long finished steps waited for the loop to look:
      beside an encode step it looks only at the step's hooks (interleave.py);
    - `idle_encode`, `idle_between`: questions were being answered and no decode step was in
      flight, inside an encode step (before one of its hooks launched one) or outside them."""

    steps: float = 0.0
    device: float = 0.0
    idle_encode: float = 0.0
    idle_between: float = 0.0


@dataclass(frozen=True)
class SchedulePolicy:
    """How the loop shares the device. A field with help is a setting of every service that loads a
    model, `gpu_<name>` (common/config.py `GPUSettings`); the others are for tests."""

    max_batch: int = setting(64, "questions decoded together in one step")
    max_chunks: int = setting(
        8, "chunks (one per stream) encoded together: bounds how long one encode step holds up questions"
    )
    encode_share: float = setting(
        0.8,
        "questions go first, but encoding always gets this share of GPU time while questions also wait "
        "(they decode beside it)",
    )
    chunk_deadline_s: float = setting(
        1.0, "a chunk waiting longer than this gets encoding up to `gpu_max_encode_share` (live cameras stay live)"
    )
    max_encode_share: float = setting(
        0.9, "encoding's share of GPU time while a chunk is late and no camera is at risk (questions keep the rest)"
    )
    deadline_share: float = setting(
        0.5,
        "cameras first: once a live chunk has waited this share of the time its camera allows (the encoder's "
        "`max_lag_s`, after which its frames are dropped), every step encodes, with no share limit, questions take "
        "one decode step an encode step and are answered one at a time, until no chunk is that late",
    )
    history_share: float = setting(
        0.1,
        "questions about the past get steps of their own, ahead of cameras that are merely behind, for at most "
        "this share of GPU time (a token bucket, `gpu_history_burst_s` deep); beyond it they fill the places "
        "encode steps leave",
    )
    history_burst_s: float = setting(
        1.5,
        "GPU seconds the past may take at once in steps of its own: a question about the last minutes "
        "(`history_max_tokens` 8192: about 0.5 s of an H200) is encoded in one burst, not between the cameras' steps",
    )
    window_s: float = 2.0  # the shares are measured over about this long
    decode_during_encode: bool = setting(
        True,
        "questions already being answered keep decoding beside an encode step (on a high-priority CUDA "
        "stream, launched between the encode step's layers) instead of waiting for it to end",
    )
    decode_before_encode: bool = setting(
        True,
        "questions being answered take a decode step alone before each encode step that is due; off, the "
        "encode step starts at once and that step goes beside its first kernels (a decode step alone leaves "
        "the GPU's compute idle between encode steps). Measured at 64 cameras with `gpu_max_encode_share` "
        "0.97 (docs/BENCHMARKS.md)",
    )
    # Off here: it needs the KV pool to defer frees (pool.py), which boot.py turns on with it; the
    # services' setting is on by default (GPUSettings).
    join_during_encode: bool = setting(
        False,
        "questions that arrive during an encode step start beside it, each once its version is written on "
        "the device, instead of after it; exact on the CPU and the GPU. Measured at 64 cameras (H200, 150 s): "
        "first tokens halved (p50 0.14 → 0.07 s), encode steps 7-9 % longer, client p95 1.04-1.05 → "
        "0.98-1.0 s (docs/BENCHMARKS.md). Off gives encoding a few percent more of the GPU",
    )
    decode_sms: int = setting(
        0,
        "SMs an encode step leaves free while questions decode beside it, as long as encoding keeps up (its "
        "chunks waited at most `gpu_chunk_deadline_s`): the step runs in a CUDA green context of the other "
        "SMs, so each small decode kernel finds a free SM. Answers come faster, encoding slows (H200, 48 "
        "cameras, 20 SMs: decode steps 23 → 19 ms, median answer 0.96 → 0.87 s, p95 not better; "
        "docs/BENCHMARKS.md). Needs a torch built for CUDA 12.8 or later; on a CPU it does nothing",
    )

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_chunks < 1:
            raise ValueError("max_batch and max_chunks must be at least 1")
        if not (0.0 <= self.encode_share <= 1.0 and 0.0 <= self.max_encode_share <= 1.0):
            raise ValueError("encode_share and max_encode_share are shares of GPU time, from 0 to 1")
        if not 0.0 < self.deadline_share <= 1.0:
            raise ValueError("deadline_share is a share of the time to a chunk's deadline: above 0, at most 1")
        if self.decode_sms < 0:
            raise ValueError("decode_sms must be >= 0")
        if self.chunk_deadline_s < 0 or self.window_s <= 0:
            raise ValueError("chunk_deadline_s must be >= 0 and window_s > 0")
        if not 0.0 <= self.history_share <= 1.0 or self.history_burst_s < 0:
            raise ValueError("history_share is a share of GPU time, from 0 to 1, and history_burst_s >= 0")

    def leaves_sms(self, alongside: bool, waited_s: float) -> bool:
        """Whether an encode step leaves `decode_sms` SMs to questions: only with questions beside
        it, and only while encoding keeps up (its oldest chunk waited at most `chunk_deadline_s`).
        A camera falling behind gets every SM back: reserving SMs costs encoding throughput
        (measured: 12-16 % with 12-28 SMs of an H200's 132)."""
        return self.decode_sms > 0 and alongside and waited_s <= self.chunk_deadline_s


class Scheduler:
    def __init__(
        self,
        policy: SchedulePolicy | None = None,
        on_step: StepObserver | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        profiler: StepProfiler | None = None,
        on_settled: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        room: Callable[[], int | None] | None = None,
    ):
        """`on_step(kind, seconds, units)` sees every step: "decode" (units: generations advanced),
        "encode" (chunk work runs), "history" (background work alone) and "task" (tasks run);
        metrics hook in here. `on_fatal(error)` runs in the loop's thread when a step fails outside
        any work (a CUDA error that poisons the device, say): all work has failed and no more will
        run, so a service exits there. `profiler` traces steps when asked to (profiling.py).
        `on_settled()` runs after every step, once the device has finished it (the KV pool's
        deferred frees, pool.py). `clock`: what the decisions read (waits, deadlines, the shares'
        step times); tests drive one by hand.
        `room()`: tokens the KV pool can still give (None or absent: no limit), what questions
        must leave for evictions (module doc, "room to evict")."""
        self.policy = policy or SchedulePolicy()
        self.clock, self.room = clock, room
        self.on_step, self.on_fatal, self.profiler = on_step, on_fatal, profiler
        self.on_settled = on_settled
        self._lock = threading.Condition()
        self._tasks: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._lanes: OrderedDict[str, deque[BatchWork]] = OrderedDict()  # round-robin by stream
        self._waiting: deque[StepWork] = deque()
        self._active: list[StepWork] = []
        self._in_flight: tuple[float, list[tuple[Launched, list[StepWork]]]] | None = None  # launched when, steps
        self._broken: Exception | None = None  # raised by a decode step beside an encode step
        self._encode_s = self._total_s = 0.0  # decayed GPU seconds, for the encode share
        self._past = _PastCredit(self.policy.history_share, self.policy.history_burst_s, clock())
        self.at_risk = False  # this step: a waiting chunk is near its deadline (cameras first)
        self.at_risk_s = 0.0  # seconds of steps chosen with the cameras at risk, since start
        self._beside = 0  # decode steps launched beside the encode step under way
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # (green context, its CUDA stream) without `decode_sms` SMs; made here, so that a platform
        # without green contexts fails when the service starts
        self._fewer_sms: tuple[Any, Any] | None = None
        if self.policy.decode_sms and _cuda_in_use():
            self._fewer_sms = _cuda_stream_without_sms(self.policy.decode_sms)
        self.steps = 0
        self.step_began: float | None = None  # time.monotonic() when the step running now began
        self.decode_times = DecodeTimes()
        self.phase_clock = PhaseClock()  # the loop's host time by phase (phases.py)
        self._idle_since: float | None = None  # questions active, no decode step in flight, since
        self._encoding = False  # inside an encode step (where idle time is counted)

    # -- the callers' side (any thread) ----------------------------------------------------
    # Work is queued only while `_stop` is clear, looked at under the lock: the loop's last
    # `_fail_everything` takes the lock after `_stop` is set, so it fails whatever was queued
    # before, and nothing is queued after. (Looked at outside the lock, work queued between the
    # look and that last sweep waited forever.)
    def submit(self, work: BatchWork | StepWork) -> Future[Any]:
        with self._lock:
            stopped = self._stop.is_set()
            if not stopped:
                self._queue(work)
                self._lock.notify()
        if stopped:  # failed outside the lock: its callbacks may submit again
            work.future.set_exception(RuntimeError(STOPPED))
        return work.future

    def _queue(self, work: BatchWork | StepWork) -> None:
        if isinstance(work, BatchWork):
            work.waiting_since = min(work.waiting_since, self.clock())
            self._lanes.setdefault(work.lane, deque()).append(work)
        else:
            self._waiting.append(work)

    def call(self, fn: Callable[[], T]) -> T:
        if threading.current_thread() is self._thread:
            return fn()  # already on the GPU loop (work calling in)
        future: Future[T] = Future()
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError(STOPPED)
            self._tasks.append((fn, future))
            self._lock.notify()
        return future.result()

    def start(self) -> Scheduler:
        self._thread = threading.Thread(target=self._run, name="gpu-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        else:  # never started: no loop to fail what was queued
            self._fail_everything(RuntimeError(STOPPED))

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        policy = self.policy
        log.info(
            "gpu scheduler started",
            max_batch=policy.max_batch,
            max_chunks=policy.max_chunks,
            decode_sms=policy.decode_sms,
        )
        clock_this_thread(self.phase_clock)
        try:
            while not self._stop.is_set():
                with self._lock:
                    while not self._stop.is_set() and not (self._tasks or self._lanes or self._waiting or self._active):
                        self._lock.wait(timeout=1.0)
                self.step()
        except BaseException as e:  # work fails on its own; this is the device or the loop broken
            self._stop.set()
            self._fail_everything(e)
            if self.on_fatal is None:
                raise
            self.on_fatal(e)
        self._fail_everything(RuntimeError(STOPPED))

    @property
    def queued(self) -> int:
        """Step work (questions) waiting to start."""
        return len(self._waiting)

    @property
    def thread(self) -> threading.Thread | None:
        """The loop's thread, once started."""
        return self._thread

    def step(self) -> None:
        """One scheduling decision and the work it chose."""
        self.steps += 1
        with self.profiler.step() if self.profiler is not None else contextlib.nullcontext():
            self.step_began = time.monotonic()  # inside: writing a trace after the step is not the step
            try:
                self._step()
            finally:
                self.step_began = None

    def _step(self) -> None:
        self._run_tasks()
        self.at_risk = self._cameras_at_risk()
        self._admit()
        if self._past_goes_ahead():
            self._timed("history", lambda: self._encode(past_only=True))
            return
        questions = bool(self._active)
        encode_first = questions and self._encodes_first()
        if questions and not encode_first:  # so a question that just arrived is prefilled before any encoding
            self._timed("decode", self._decode, accounted=True)
        if encode_first or (self._lanes and (not questions or self._encode_is_due())):  # due after the decode step
            self._timed("encode", self._encode)

    def _encodes_first(self) -> bool:
        """Without `decode_before_encode`, or with the cameras at risk, an encode step that is due
        starts at once, and the questions' step goes beside its first kernels (_encode_batch)
        instead of alone before it, the device half idle (a decode step alone leaves the GPU's
        compute unused)."""
        policy = self.policy
        return (
            (self.at_risk or not policy.decode_before_encode)
            and policy.decode_during_encode
            and bool(self._lanes)
            and self._encode_is_due()
        )

    def _past_goes_ahead(self) -> bool:
        """Whether a step of the background lanes alone comes next (module doc, "the past"): one
        waits, no camera is at risk, and the past has credit left."""
        if self.at_risk or self._past.left(self.clock()) <= 0.0:
            return False
        with self._lock:
            return any(lane[0].background for lane in self._lanes.values() if lane)

    def _cameras_at_risk(self) -> bool:
        """Whether a waiting chunk has used `deadline_share` of the time from when it began to
        wait to its deadline (when its camera would start dropping frames)."""
        share, now = self.policy.deadline_share, self.clock()
        with self._lock:
            heads = [lane[0] for lane in self._lanes.values() if lane]
        return any(
            work.deadline != math.inf and now >= work.waiting_since + share * (work.deadline - work.waiting_since)
            for work in heads
        )

    def _run_tasks(self) -> None:
        if self._tasks:
            self._timed("task", self._run_queued_tasks)

    def _run_queued_tasks(self) -> int:
        n = 0
        while True:
            with self._lock:
                if not self._tasks:
                    return n
                fn, future = self._tasks.popleft()
            n += 1
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)

    def _admit(self, beside: bool = False) -> None:
        """Waiting work starts and becomes active, in order, up to `max_batch` (with the cameras at
        risk, 1); `beside` an encode step in flight, only what may start there (the rest keeps its
        place)."""
        most = 1 if self.at_risk else self.policy.max_batch
        with self._lock:
            starting: list[StepWork] = []
            room = _Room(self.room, self._active)
            for work in list(self._waiting):
                if len(self._active) + len(starting) >= most or not room.fits(work):
                    break
                if not beside or work.may_start_beside():
                    self._waiting.remove(work)
                    starting.append(work)
                    room.starts(work)
        self._active += [work for work in starting if start(work)]  # outside the lock: callers submit meanwhile

    def _decode(self) -> int:
        """Decode steps: one, and while the loop's next choice would be another (`_decode_is_next`),
        up to AHEAD_STEPS, each queued before the last is read, so the device does not wait for
        the host between them. Each step is accounted and reported on its own."""
        steps, since = 0, self.clock()  # before the launch: the host's launch is part of the step
        self._launch()  # nothing is in flight here: an encode step completes what it launched
        while self._in_flight is not None:
            ahead = self._ahead() if steps + 1 < AHEAD_STEPS and self._decode_is_next() else None
            units = self._complete_in_flight(report=False)
            steps, now = steps + 1, self.clock()
            self._account("decode", now - since, units)
            since = now
            if ahead is not None:
                self._in_flight = (time.perf_counter(), [ahead])
        return steps

    def _ahead(self) -> tuple[Launched, list[StepWork]] | None:
        """The step after the one in flight, queued behind it (`Launched.ahead`), with its work."""
        assert self._in_flight is not None
        _, steps = self._in_flight
        if len(steps) != 1:
            return None
        ahead = steps[0][0].ahead()
        return None if ahead is None else (ahead, list(ahead.work))

    def _decode_is_next(self) -> bool:
        """Whether `_step` would choose this decode step alone next: not stopping, no task, no
        work waiting to start, and no encode step due (the cameras' risk looked at again)."""
        if self._stop.is_set():
            return False
        with self._lock:
            if self._tasks or self._waiting:
                return False
        if not self._lanes:
            return True
        self.at_risk = self._cameras_at_risk()
        return not self._encode_is_due() and not self._past_goes_ahead()

    def _launch(self, alongside: bool = False) -> None:
        self._end_idle()
        launched_at = time.perf_counter()  # before: the host's launch is part of the step
        # One class of step work today (Generation); grouped by class should another appear.
        by_class: dict[type, list[StepWork]] = {}
        for work in self._active:
            by_class.setdefault(type(work), []).append(work)
        steps = [(cls.launch_batch(group, alongside), group) for cls, group in by_class.items()]
        self._in_flight = (launched_at, steps)

    def _complete_in_flight(self, report: bool = True) -> int:
        """Complete the step in flight; the work it advanced."""
        if self._in_flight is None:
            return 0
        launched_at, steps = self._in_flight
        self._in_flight = None
        n = sum(len(group) for _, group in steps)  # what the device ran (one that stopped a step before too)
        for launched, _ in steps:
            launched.complete()
        self._active = [j for j in self._active if not j.done]
        now = time.perf_counter()
        self.decode_times.steps += now - launched_at
        self.decode_times.device += sum(launched.device_s() or 0.0 for launched, _ in steps)
        if self._active:
            self._idle_since = now
        if report and self.on_step is not None:
            self.on_step("decode", now - launched_at, n)
        return n

    def _end_idle(self) -> None:
        if self._idle_since is None:
            return
        idle = time.perf_counter() - self._idle_since
        if self._encoding:
            self.decode_times.idle_encode += idle
        else:
            self.decode_times.idle_between += idle
        self._idle_since = None

    def _count_idle_as(self, encoding: bool) -> None:
        """Idle time so far is where the loop was; from now on it is inside an encode step or not."""
        idle = self._idle_since is not None
        self._end_idle()
        if idle:
            self._idle_since = time.perf_counter()
        self._encoding = encoding

    def _decode_alongside(self, wait: bool = False) -> None:
        """Inside an encode step: the next decode step, once the device has finished the last (or
        after waiting for it), with the questions waiting that may start beside the step (with
        `join_during_encode`). A failure outside any work is kept for after the encode step: it is
        not the chunks'."""
        if self._broken is not None:
            return
        try:
            self._next_alongside(wait)
        except Exception as e:
            self._broken = e

    def _next_alongside(self, wait: bool) -> None:
        if self._in_flight is not None:
            if not wait and not all(launched.ready() for launched, _ in self._in_flight[1]):
                return
            self._complete_in_flight()
        if self.policy.join_during_encode and not self.at_risk:
            self._admit(beside=True)
        if self._active and not (self.at_risk and self._beside):  # at risk: one a step, the rest is encoding's
            self._launch(alongside=True)
            self._beside += 1

    def _encode(self, past_only: bool = False) -> int:
        self._count_idle_as(encoding=True)
        try:
            return self._encode_batch(past_only)
        finally:
            self._count_idle_as(encoding=False)

    def _encode_batch(self, past_only: bool) -> int:
        self._beside = 0
        with self._lock:
            batch: list[BatchWork] = []
            for lane in self._lanes_first(past_only)[: self.policy.max_chunks]:
                queue = self._lanes.pop(lane)
                batch.append(queue.popleft())
                if queue:
                    self._lanes[lane] = queue  # back of the line: the next batch starts elsewhere
        alongside = self.policy.decode_during_encode and (self.policy.join_during_encode or bool(self._active))
        waited = self.clock() - min(work.waiting_since for work in batch)
        leave = self._fewer_sms is not None and self.policy.leaves_sms(alongside, waited)
        with interleaved(self._decode_alongside) if alongside else contextlib.nullcontext():
            # A decode step now, beside the step's first kernels: the first hook comes only after
            # the vision graph, the chunks' inputs and the plan, host work during which questions
            # had no step in flight (33 ms an encode step at 64 cameras, H200, 2026-11-27). On a
            # CPU nothing runs beside anything: the hooks alone interleave there.
            if alongside and _cuda_in_use():
                self._decode_alongside()
            with _on_cuda_stream(self._fewer_sms[1] if leave else None):
                self._run_batches(batch)
            if alongside:
                self._drain(_device_done())
        if self._broken is not None:
            broken, self._broken = self._broken, None
            raise broken
        self._complete_in_flight()
        self._requeue([work for work in batch if not work.done])
        return len(batch)

    def _lanes_first(self, past_only: bool) -> list[str]:
        """The lanes in the order an encode step takes them: round-robin, background lanes after
        all the others, or (`past_only`) they alone (under the lock)."""
        background = [n for n in self._lanes if self._lanes[n][0].background]
        return background if past_only else [n for n in self._lanes if n not in background] + background

    def _run_batches(self, batch: list[BatchWork]) -> None:
        by_class: dict[type, list[BatchWork]] = {}
        for work in batch:
            by_class.setdefault(type(work), []).append(work)
        for cls, group in by_class.items():
            try:
                cls.run_batch(group)
            except Exception as e:
                fail_all(group, e)

    def _drain(self, done: Callable[[], bool]) -> None:
        """Until the device has finished the encode step (`done`), decode beside it."""
        while self._broken is None and not done():
            if self._in_flight is None and not self._may_join():
                return
            self._decode_alongside(wait=True)  # a high-priority step: a few milliseconds

    def _may_join(self) -> bool:
        """Whether a waiting question would start beside the encode step now (`_admit(beside=True)`)."""
        if not self.policy.join_during_encode or self.at_risk or len(self._active) >= self.policy.max_batch:
            return False
        with self._lock:
            room = _Room(self.room, self._active)
            for work in self._waiting:
                if not room.fits(work):
                    return False  # in order: nothing after it starts first
                if work.may_start_beside():
                    return True
        return False

    def _requeue(self, unfinished: list[BatchWork]) -> None:
        """Work that needs more batches (an exact eviction's rebuild) stays first in its lane, and
        the lane goes to the back of the line like any other with work left."""
        with self._lock:
            for work in unfinished:
                queue = self._lanes.pop(work.lane, deque())
                queue.appendleft(work)
                self._lanes[work.lane] = queue

    def _encode_is_due(self) -> bool:
        """Questions are waiting too: encode while the cameras are at risk, while below the
        guaranteed share, or while a chunk is past `chunk_deadline_s` and below the most encoding
        may take from questions."""
        if self.at_risk or self._total_s == 0.0:
            return True
        share = self._encode_s / self._total_s
        return share < self.policy.encode_share or (
            share < self.policy.max_encode_share and self._oldest_wait() > self.policy.chunk_deadline_s
        )

    def _oldest_wait(self) -> float:
        with self._lock:
            waits = (lane[0].waiting_since for lane in self._lanes.values() if lane and not lane[0].background)
            oldest = min(waits, default=None)
        return 0.0 if oldest is None else self.clock() - oldest

    def _timed(self, kind: str, fn: Callable[[], int], accounted: bool = False) -> None:
        """Run `fn` (its units returned) to the device's end and account it as one step, unless
        it `accounted` for its steps itself."""
        t0 = self.clock()
        with phase(kind):  # also the step's range in a trace being taken
            units = fn()
            with phase("device wait"):
                _settle()
        if self.on_settled is not None:
            self.on_settled()
        if not accounted:
            self._account(kind, self.clock() - t0, units)

    def _account(self, kind: str, spent: float, units: int) -> None:
        """A step's time in the shares (encoding's against all), and to `on_step`."""
        decay = 0.5 ** (spent / self.policy.window_s)
        self._encode_s = self._encode_s * decay + (spent if kind == "encode" else 0.0)
        self._total_s = self._total_s * decay + spent
        if self.at_risk:
            self.at_risk_s += spent
        if kind == "history":
            self._past.spend(spent, self.clock())
        if self.on_step is not None:
            self.on_step(kind, spent, units)

    def _fail_everything(self, error: BaseException) -> None:
        with self._lock:
            pending: list[BatchWork | StepWork] = [*self._waiting, *self._active]
            pending += [j for lane in self._lanes.values() for j in lane]
            tasks = list(self._tasks)
            self._waiting.clear(), self._lanes.clear(), self._tasks.clear()
            self._active = []
        fail_all(pending, error)
        for _, future in tasks:
            future.set_exception(error)


class _PastCredit:
    """GPU seconds the past may still take in steps of its own (module doc, "the past"): a token
    bucket that fills at `share` of the clock's time and holds at most `burst`. A step starts
    while any is left, so the bucket may go below zero by one step, paid back before the next."""

    def __init__(self, share: float, burst: float, now: float):
        self.share, self.burst = share, burst
        self._left, self._at = burst, now

    def left(self, now: float) -> float:
        self._left = min(self.burst, self._left + self.share * (now - self._at))
        self._at = now
        return self._left

    def spend(self, seconds: float, now: float) -> None:
        self._left = self.left(now) - seconds


class _Room:
    """One admission pass's check of the pool's room (module doc, "room to evict"): whether a
    waiting work may start beside the active work and the work starting in this pass. The pool's
    room is read once a pass, when first needed: nothing is allocated until the pass is over. Each
    check costs the same however much is active (the pass runs on the GPU loop, every step)."""

    def __init__(self, room: Callable[[], int | None] | None, active: list[StepWork]):
        self.room, self.busy = room, bool(active)
        self.copies: dict[object, int] = {}  # pinned key -> tokens of its copy
        self.need = 0  # the copies' tokens, plus the scratch of the work starting in this pass
        self._left: int | None = None
        self._read = False
        for work in active:
            self.need += self._more(work.pins(), keep=True)

    def fits(self, work: StepWork) -> bool:
        """Always with nothing active or starting, or with nothing pinned (a pool too small for
        the rule would otherwise hold questions forever)."""
        if self.room is None or not self.busy:
            return True
        copies = self.need + self._more(work.pins(), keep=False)
        if not self.copies and copies == self.need:  # nothing pinned, by it or before it
            return True
        if not self._read:
            self._left, self._read = self.room(), True
        return self._left is None or self._left >= copies + work.scratch_tokens()

    def starts(self, work: StepWork) -> None:
        if self.room is None:
            return
        self.need += self._more(work.pins(), keep=True) + work.scratch_tokens()
        self.busy = True

    def _more(self, pinned: tuple[object, int] | None, keep: bool) -> int:
        """What pinning `pinned` adds to the copies (a key pinned already costs only the excess)."""
        if pinned is None:
            return 0
        key, tokens = pinned
        more = max(0, tokens - self.copies.get(key, 0))
        if keep and more:
            self.copies[key] = tokens
        return more


def _device_done() -> Callable[[], bool]:
    """Whether the device has finished what was queued on this thread's stream so far."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return lambda: True
    event = torch.cuda.Event()
    event.record()
    return event.query


def _cuda_in_use() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def _cuda_stream_without_sms(free: int) -> tuple[Any, Any]:
    """A CUDA stream whose kernels run on every SM but `free` of them (a green context of the
    rest; on Hopper SMs are split in groups of 8, so the driver may leave a few more free). The
    SMs left free are not the questions' alone: their CUDA stream runs on every SM."""
    import torch
    from torch.cuda import green_contexts

    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 < free < total:
        raise ValueError(f"decode_sms must be below the GPU's {total} SMs, got {free}")
    if not (green_contexts.SUPPORTED and hasattr(green_contexts.GreenContext, "Stream")):
        raise RuntimeError("decode_sms needs CUDA green contexts: a torch built for CUDA 12.8 or later")
    context = green_contexts.GreenContext.create(num_sms=total - free, device_id=device)
    return context, context.Stream()  # the context must live as long as its CUDA stream


@contextlib.contextmanager
def _on_cuda_stream(cuda_stream: Any) -> Iterator[None]:
    """Run the block's GPU work on `cuda_stream` (None: where it would run anyway), ordered after what
    was queued before it and before what is queued after it."""
    if cuda_stream is None:
        yield
        return
    import torch

    before = torch.cuda.current_stream()
    cuda_stream.wait_stream(before)
    try:
        with torch.cuda.stream(cuda_stream):
            yield
    finally:
        before.wait_stream(cuda_stream)


def _settle() -> None:
    """Wait for the GPU to finish the step: the shares must count each step's GPU time, not the
    launch (a step that never syncs would pass its GPU time to the next one that does)."""
    torch = sys.modules.get("torch")  # not imported here: settings load SchedulePolicy without torch
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
