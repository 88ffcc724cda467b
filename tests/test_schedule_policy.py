"""The GPU scheduler's policy, with work that stands in for real GPU work by taking time (no model: what
is under test is who gets the device when, not what runs on it).

Questions that never stop asking and a backlog of chunks compete: encoding gets its guaranteed
share, more (up to the cap) once a chunk is past its deadline, and questions always keep the rest.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from concurrent.futures import Future

import pytest

from common.engine.interleave import between_layers, between_outputs
from common.engine.scheduler import SchedulePolicy, Scheduler
from common.engine.work import BatchWork, StepWork

ENCODE_S = 0.010  # per chunk batch
DECODE_S = 0.004  # per decode step
IDLE_S = 0.25  # a question timed to its parts waits this long between steps, and inside an encode step


class GpuTime:
    """What the stand-in work spends: real sleeps, or, while ``now`` is set, a clock the scheduler
    reads, moved by exactly the time each step stands for (`shares`)."""

    now: float | None = None

    @classmethod
    def spend(cls, seconds: float) -> None:
        if cls.now is None:
            time.sleep(seconds)
        else:
            cls.now += seconds


class Busy(BatchWork):
    def __init__(self, lane: str, order: list[str]):
        super().__init__()
        self.lane, self.order = lane, order

    @classmethod
    def run_batch(cls, batch: Sequence[BatchWork]) -> None:
        GpuTime.spend(ENCODE_S)
        for work in batch:
            assert isinstance(work, Busy)
            work.order.append(work.lane)
            work.future.set_result(None)


class Endless(StepWork):
    """A question that asks for the GPU at every step, never done."""

    @classmethod
    def step_batch(cls, batch: Sequence[StepWork]) -> None:
        GpuTime.spend(DECODE_S)


def shares(policy: SchedulePolicy, seconds: float = 1.5, camera_behind_s: float | None = None) -> dict[str, float]:
    """GPU time by step kind while a question and a deep backlog of chunks compete for ``seconds``
    of GPU time: queued in the scheduler, or (`camera_behind_s`) held back by a camera that hands
    over one chunk at a time, as the encoder worker's threads do, each chunk's last frame captured
    that long before.

    The loop is stepped here, on a clock the work moves: the shares are the policy's. With real
    sleeps in a loop thread, a loaded machine woke each step late by about as much, a decode step's
    4 ms grew as much as an encode step's 10 ms, and the share of encode steps due at every step
    fell under its bound (0.64 of 0.65, beside two busy loops); a camera's thread slow to hand over
    its next chunk left steps with none to encode."""
    spent: dict[str, float] = {"encode": 0.0, "decode": 0.0, "task": 0.0}
    GpuTime.now = 0.0
    scheduler = Scheduler(
        policy, on_step=lambda kind, s, _: spent.__setitem__(kind, spent[kind] + s), clock=lambda: GpuTime.now
    )
    order: list[str] = []
    try:
        scheduler.submit(Endless())
        if camera_behind_s is None:
            for _ in range(int(seconds / ENCODE_S) + 50):  # more than can run: the backlog never empties
                scheduler.submit(Busy("cam", order))
        handed: Future | None = None
        while GpuTime.now < seconds:
            if camera_behind_s is not None and (handed is None or handed.done()):  # the camera's next chunk
                chunk = Busy("cam", order)
                chunk.waiting_since = GpuTime.now - camera_behind_s
                handed = scheduler.submit(chunk)
            scheduler.step()
    finally:
        GpuTime.now = None
        scheduler.stop()
    total = spent["encode"] + spent["decode"]
    return {kind: s / total for kind, s in spent.items()}


def test_encoding_gets_its_guaranteed_share_and_no_more_while_it_keeps_up():
    got = shares(SchedulePolicy(max_chunks=1, encode_share=0.2, chunk_deadline_s=1e9, window_s=0.3))
    assert 0.1 < got["encode"] < 0.35, got


def test_a_chunk_past_its_deadline_takes_more_but_questions_keep_the_rest():
    policy = SchedulePolicy(max_chunks=1, encode_share=0.2, chunk_deadline_s=0.05, max_encode_share=0.8, window_s=0.3)
    got = shares(policy)
    assert 0.65 < got["encode"] < 0.88, got
    assert got["decode"] > 0.12, got


def test_a_live_camera_behind_counts_from_its_frames_not_from_when_its_chunk_was_submitted():
    """The worker's camera threads hand over one chunk at a time, so a backlog waits in Redis,
    not in the scheduler: a chunk just submitted may hold frames seconds old."""
    policy = SchedulePolicy(max_chunks=1, encode_share=0.2, chunk_deadline_s=0.5, max_encode_share=0.8, window_s=0.3)
    assert shares(policy, camera_behind_s=0.0)["encode"] < 0.35  # keeping up: its guaranteed share
    behind = shares(policy, camera_behind_s=2.0)
    assert 0.65 < behind["encode"] < 0.88, behind


def test_lanes_take_turns():
    scheduler = Scheduler(SchedulePolicy(max_chunks=2))
    order: list[str] = []
    for lane in ("a", "a", "a", "b", "c"):
        scheduler.submit(Busy(lane, order))
    while scheduler._lanes:  # driven step by step, in this thread
        scheduler.step()
    assert order == ["a", "b", "c", "a", "a"]


def background(lane: str, order: list[str]) -> Busy:
    work = Busy(lane, order)
    work.background = True
    return work


def cameras_encoding(policy: SchedulePolicy, order: list[str], kinds: list[str], lanes: int = 4) -> Scheduler:
    """A scheduler on the GpuTime clock (set by the caller) whose `lanes` cameras have a deep
    backlog and have had the GPU to themselves for a while: encoding's share is all of it."""
    scheduler = Scheduler(policy, on_step=lambda kind, *_: kinds.append(kind), clock=lambda: GpuTime.now)
    for _ in range(50):
        for cam in range(lanes):
            scheduler.submit(Busy(f"cam{cam}", order))
    for _ in range(10):
        scheduler.step()
    order.clear(), kinds.clear()
    return scheduler


def test_the_past_goes_ahead_of_late_chunks_in_one_burst_whatever_encodings_share():
    """A question about the past is a question: its pieces (a background lane) get steps of their
    own ahead of cameras that are merely behind, back to back while its credit lasts, even with
    encoding below its guaranteed share; then the cameras take the time back."""
    GpuTime.now = 0.0
    try:
        order: list[str] = []
        kinds: list[str] = []
        policy = SchedulePolicy(
            max_chunks=2,
            encode_share=0.8,
            chunk_deadline_s=0.0,
            window_s=0.3,
            history_share=0.0,
            history_burst_s=2.5 * ENCODE_S,  # a step starts while any is left: three
        )  # no refill: the burst alone
        scheduler = cameras_encoding(policy, order, kinds)
        scheduler._encode_s, scheduler._total_s = 0.5, 1.0  # encoding below its share: the burst goes anyway
        for _ in range(4):  # four pieces, one after the other in their lane
            scheduler.submit(background("h", order))
        for _ in range(3):
            scheduler.step()
        assert order == ["h", "h", "h"] and kinds == ["history"] * 3
        scheduler.step()  # the credit spent: the cameras' step, the fourth piece left out
        assert order[3:] == ["cam0", "cam1"] and kinds[3:] == ["encode"]
    finally:
        GpuTime.now = None


def test_askers_about_the_past_who_never_stop_get_their_share_of_the_gpu_and_no_more():
    GpuTime.now = 0.0
    try:
        order: list[str] = []
        kinds: list[str] = []
        policy = SchedulePolicy(max_chunks=2, chunk_deadline_s=0.0, history_share=0.1, history_burst_s=0.05)
        scheduler = cameras_encoding(policy, order, kinds, lanes=2)  # no place left in an encode step
        for _ in range(400):
            scheduler.submit(background("h", order))
        for _ in range(300):
            scheduler.step()
        share = kinds.count("history") / len(kinds)  # every step takes ENCODE_S
        assert 0.08 < share < 0.14, share
    finally:
        GpuTime.now = None


def test_without_credit_the_past_fills_only_the_places_the_cameras_leave():
    """The past's credit spent, it never displaces a camera's chunk from an encode step, however
    long it has waited; it rides along where there is room."""
    order: list[str] = []
    scheduler = Scheduler(SchedulePolicy(max_chunks=2, history_burst_s=0.0))  # never ahead
    for work in (background("h", order), background("h", order), Busy("a", order), Busy("b", order)):
        scheduler.submit(work)
    scheduler.submit(Busy("a", order))
    scheduler.step()  # two cameras wait: the step is theirs
    assert order == ["a", "b"]
    scheduler.step()  # one camera's chunk left: the background lane fills the other place
    assert order == ["a", "b", "a", "h"]


def test_the_past_waits_while_a_camera_is_at_risk():
    order: list[str] = []
    scheduler = Scheduler(SchedulePolicy(max_chunks=1, deadline_share=0.5))
    scheduler.submit(background("h", order))
    camera = Busy("cam", order)
    camera.waiting_since, camera.deadline = time.monotonic() - 2.0, time.monotonic() + 1.0
    scheduler.submit(camera)
    scheduler.step()
    assert order == ["cam"]


def test_a_background_lanes_wait_never_makes_encoding_due():
    scheduler = Scheduler(SchedulePolicy(chunk_deadline_s=0.5))
    old = background("h", [])
    old.waiting_since = time.monotonic() - 60  # as if submitted a minute ago
    scheduler.submit(old)
    assert scheduler._oldest_wait() == 0.0
    camera = Busy("cam", [])
    camera.waiting_since = time.monotonic() - 2.0
    scheduler.submit(camera)
    assert 1.9 < scheduler._oldest_wait() < 5


def test_encoding_leaves_sms_to_questions_only_beside_them_and_while_it_keeps_up():
    """`decode_sms`: SMs are left free only for an encode step that questions decode beside, and
    only while its chunks have waited no longer than the deadline: a camera falling behind gets
    every SM back. Off (0), never."""
    policy = SchedulePolicy(decode_sms=16, chunk_deadline_s=1.0)
    assert policy.leaves_sms(alongside=True, waited_s=0.3)
    assert not policy.leaves_sms(alongside=False, waited_s=0.3)  # nobody to leave them to
    assert not policy.leaves_sms(alongside=True, waited_s=1.2)  # encoding is falling behind
    assert not SchedulePolicy().leaves_sms(alongside=True, waited_s=0.0)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_chunks": 0},
        {"encode_share": 1.1},
        {"max_encode_share": 1.5},
        {"chunk_deadline_s": -1.0},
        {"decode_sms": -1},
        {"history_share": 1.5},
        {"history_burst_s": -0.1},
    ],
)
def test_a_bad_policy_is_refused(bad):
    with pytest.raises(ValueError):
        SchedulePolicy(**bad)


class Broken(StepWork):
    """A step that fails outside any work's own error handling, as a poisoned device does."""

    @classmethod
    def step_batch(cls, batch: Sequence[StepWork]) -> None:
        raise RuntimeError("CUDA error: device-side assert triggered")


def test_a_broken_loop_fails_all_work_and_reports_once():
    fatal: list[BaseException] = []
    scheduler = Scheduler(on_fatal=fatal.append)
    waiting = Busy("cam", [])
    scheduler.submit(waiting)  # queued before the loop runs: it must not hang
    broken = scheduler.submit(Broken())
    scheduler.start()
    with pytest.raises(RuntimeError, match="device-side assert"):
        broken.result(timeout=10)
    with pytest.raises(RuntimeError):
        waiting.future.result(timeout=10)
    with pytest.raises(RuntimeError, match="stopped"):  # and nothing later waits forever either
        scheduler.submit(Busy("cam", [])).result(timeout=10)
    scheduler.stop()
    assert len(fatal) == 1 and "device-side assert" in str(fatal[0])


class Layered(BatchWork):
    """An encode step with layers: the points where questions decode beside it."""

    lane = "cam"

    @classmethod
    def run_batch(cls, batch: Sequence[BatchWork]) -> None:
        for _ in range(4):
            between_layers()
        for work in batch:
            work.future.set_result("encoded")


class BreaksBeside(StepWork):
    """Its first step (in the loop) works; the next one, beside an encode step, breaks."""

    steps = 0

    @classmethod
    def step_batch(cls, batch: Sequence[StepWork]) -> None:
        cls.steps += 1
        if cls.steps > 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_step_that_breaks_beside_an_encode_step_is_the_loop_failing_not_the_chunks():
    scheduler = Scheduler(SchedulePolicy(encode_share=1.0))  # driven by hand
    question = scheduler.submit(BreaksBeside())
    chunk = scheduler.submit(Layered())
    with pytest.raises(RuntimeError, match="illegal memory access"):
        scheduler.step()  # the question's step, then the encode step it breaks beside
    assert chunk.result(timeout=0) == "encoded", "the chunks were not what failed"
    assert not question.done()  # the loop fails it, with everything else, as for any broken step
    assert BreaksBeside.steps == 2


class Counted(StepWork):
    """A question that counts its steps and ends after `steps`; `written`: whether what it reads is
    on the device (a version an encode step in flight published may not be)."""

    def __init__(self, steps: int = 100, written: bool = True):
        super().__init__()
        self.taken, self.steps, self.written = 0, steps, written

    def may_start_beside(self) -> bool:
        return self.written

    @classmethod
    def step_batch(cls, batch: Sequence[StepWork]) -> None:
        for work in batch:
            assert isinstance(work, Counted)
            work.taken += 1
            if work.taken == work.steps:
                work.future.set_result(work.taken)


class Publishing(BatchWork):
    """An encode step's end: its chunks published one by one (`between_outputs` after each); two
    questions arrive meanwhile, one on a version already written, one on a version not written
    until the third chunk is out; then one more layer-like point comes (`between_layers`)."""

    lane = "cam"
    scheduler: Scheduler
    active: Counted
    ready: Counted
    unwritten: Counted
    seen: list[tuple[int, int, int]]

    @classmethod
    def run_batch(cls, batch: Sequence[BatchWork]) -> None:
        cls.scheduler.submit(cls.ready)
        cls.scheduler.submit(cls.unwritten)
        for k in range(3):
            between_outputs()
            cls.seen.append((cls.active.taken, cls.ready.taken, cls.unwritten.taken))
            if k == 1:
                cls.unwritten.written = True  # its version's writes finished on the device
        between_layers()
        cls.seen.append((cls.active.taken, cls.ready.taken, cls.unwritten.taken))
        for work in batch:
            work.future.set_result("encoded")


@pytest.mark.parametrize("join", [True, False])
def test_questions_arriving_during_an_encode_step_start_beside_it_once_what_they_read_is_written(join: bool):
    """Questions being answered decode on at every point of an encode step (a re-layout per
    evicting chunk is tens of milliseconds of host work); with `join_during_encode` a question
    arriving meanwhile starts there too, but only once what it reads is written on the device;
    without, it waits for the next step."""
    scheduler = Scheduler(SchedulePolicy(encode_share=1.0, join_during_encode=join))  # driven by hand
    Publishing.scheduler, Publishing.seen = scheduler, []
    Publishing.active, Publishing.ready, Publishing.unwritten = Counted(), Counted(), Counted(written=False)
    scheduler.submit(Publishing.active)
    chunk = scheduler.submit(Publishing())
    scheduler.step()  # the question's step, then the encode step
    assert chunk.result(timeout=0) == "encoded"
    active = [a for a, _, _ in Publishing.seen]
    assert active == [2, 3, 4, 5], "a decode step at every point of the encode step"
    if join:
        assert Publishing.seen == [(2, 1, 0), (3, 2, 0), (4, 3, 1), (5, 4, 2)]
    else:
        assert [(r, u) for _, r, u in Publishing.seen] == [(0, 0)] * 4


@pytest.mark.parametrize("before", [True, False])
def test_questions_take_a_step_alone_before_an_encode_step_only_if_asked_to(before: bool):
    """With `decode_before_encode` (the default) an encode step that is due waits for a decode step
    of its own; without, the encode step starts at once and the questions decode at its points only
    (on a GPU also beside its first kernels), so the device has no half-idle step between encode
    steps. Either way the questions keep going, and without decoding beside encode steps they
    still get their step first."""
    kinds: list[str] = []
    policy = SchedulePolicy(encode_share=1.0, decode_before_encode=before)
    scheduler = Scheduler(policy, on_step=lambda kind, _s, _n: kinds.append(kind))  # driven by hand
    question = Counted()
    scheduler.submit(question)
    chunk = scheduler.submit(Layered())
    scheduler.step()
    assert chunk.result(timeout=0) == "encoded"
    assert kinds.count("encode") == 1 and kinds.count("decode") == (5 if before else 4)
    assert question.taken == (5 if before else 4)  # the 4 layers' points, and the step alone

    serial = Scheduler(SchedulePolicy(encode_share=1.0, decode_before_encode=before, decode_during_encode=False))
    question = Counted()
    serial.submit(question)
    serial.submit(Layered())
    serial.step()
    assert question.taken == 1, "nothing decodes beside the encode step: the questions' step comes first"


class Timed(StepWork):
    """A question of `steps` steps that notes when its first step began and its last one ended."""

    def __init__(self, steps: int):
        super().__init__()
        self.taken, self.steps = 0, steps
        self.first_began = self.last_ended = 0.0

    @classmethod
    def step_batch(cls, batch: Sequence[StepWork]) -> None:
        for work in batch:
            assert isinstance(work, Timed)
            if not work.taken:
                work.first_began = time.perf_counter()
            time.sleep(DECODE_S)
            work.taken += 1
            work.last_ended = time.perf_counter()
            if work.taken == work.steps:
                work.future.set_result(work.taken)


class SlowToFirstLayer(BatchWork):
    """An encode step whose host work before its first layer (inputs, a plan) takes IDLE_S."""

    lane = "cam"

    @classmethod
    def run_batch(cls, batch: Sequence[BatchWork]) -> None:
        time.sleep(IDLE_S)
        for _ in range(3):
            between_layers()
            time.sleep(0.002)
        for work in batch:
            work.future.set_result("encoded")


def test_a_questions_time_is_its_decode_steps_and_the_idle_time_between_them_inside_and_outside_encode_steps():
    """The scheduler's decode times part an answer's time exactly: from its first step's launch to
    its last step's end it was in a step or idle, and the time an encode step spent before its
    first layer (where the first decode step beside it is launched) is idle inside that step."""
    scheduler = Scheduler(SchedulePolicy(encode_share=1.0))  # driven by hand
    question = Timed(steps=5)  # one before the encode step, one at each of its 3 layers, one after
    scheduler.submit(question)
    chunk = scheduler.submit(SlowToFirstLayer())
    scheduler.step()  # the question's step, then the encode step with 3 more beside it
    time.sleep(IDLE_S)  # between steps: the question waits with nothing in flight
    scheduler.step()  # its last step
    assert chunk.result(timeout=0) == "encoded" and question.future.result(timeout=0) == 5
    times = scheduler.decode_times
    assert times.device == 0.0  # no device times the steps here
    assert times.idle_encode >= IDLE_S and times.idle_between >= IDLE_S
    span = question.last_ended - question.first_began
    parts = times.steps + times.idle_encode + times.idle_between
    # Less than the idle it could count twice: the margin is the scheduler's own bookkeeping at
    # the span's two ends, which a loaded machine may stretch to tens of milliseconds.
    assert span <= parts < span + IDLE_S / 2, (span, times)


def test_a_chunk_near_its_deadline_takes_the_device_however_small_the_share():
    """Cameras first: with encoding's shares at 0 a chunk that has used `deadline_share` of the
    time to its deadline is still encoded at once, ahead of the questions' own step; no waiting
    question starts meanwhile, and the one being answered takes one decode step beside it (of the
    encode step's 4 layers). Once no chunk is at risk, the waiting question starts."""
    ticks = itertools.count()
    policy = SchedulePolicy(encode_share=0.0, max_encode_share=0.0, deadline_share=0.5, join_during_encode=True)
    scheduler = Scheduler(policy, clock=lambda: 100.0 + next(ticks) * 1e-6)  # driven by hand; steps take time
    answering, waiting = Counted(), Counted()
    scheduler.submit(answering)
    scheduler.step()  # no chunk: the question's step alone
    assert answering.taken == 1
    safe, late = Layered(), Layered()
    safe.waiting_since, safe.deadline = 99.0, 110.0  # waited 1 s of 11
    scheduler.submit(safe)
    scheduler.submit(waiting)
    scheduler.step()
    assert not scheduler.at_risk and safe.done is False, "shares of 0: questions first while no camera is at risk"
    assert (answering.taken, waiting.taken) == (2, 1)
    assert scheduler.at_risk_s == 0.0
    late.waiting_since, late.deadline = 94.0, 104.0  # waited 6 s of 10
    late.lane = "cam2"
    scheduler.submit(late)
    starting = Counted()
    scheduler.submit(starting)
    scheduler.step()
    assert scheduler.at_risk and late.done and safe.done, "at risk: encoded at once, with no share limit"
    assert (answering.taken, waiting.taken, starting.taken) == (3, 2, 0), "one decode step beside, none started"
    at_risk_s = scheduler.at_risk_s
    assert at_risk_s > 0.0, "the step chosen at risk is counted (svqa_gpu_cameras_at_risk_seconds)"
    scheduler.step()
    assert not scheduler.at_risk and starting.taken == 1
    assert scheduler.at_risk_s == at_risk_s, "and only it"


def test_at_risk_questions_are_answered_one_at_a_time_never_starved():
    """Cameras that stay at risk (encoding alone cannot keep up) still let questions through: one
    starts whenever none is being answered, and takes a decode step at each encode step."""
    ticks = itertools.count()
    scheduler = Scheduler(SchedulePolicy(deadline_share=0.5), clock=lambda: 100.0 + next(ticks) * 1e-6)
    questions = [Counted(steps=2) for _ in range(3)]
    for q in questions:
        scheduler.submit(q)
    for _ in range(6):  # a chunk at risk in every step
        late = Layered()
        late.waiting_since, late.deadline = 90.0, 100.0
        scheduler.submit(late)
        scheduler.step()
        assert scheduler.at_risk and late.done
        assert sum(q.taken > 0 and not q.done for q in questions) <= 1, "one at a time"
    assert [q.taken for q in questions] == [2, 2, 2] and all(q.done for q in questions)
