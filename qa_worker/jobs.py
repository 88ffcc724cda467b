"""Periodic jobs from the cameras file: captions, custom prompts, subtitle transcription, alerts.

A job runs on a stream every `every_s` seconds of capture time and/or every `every_versions`
new cache versions, against the head version at that moment. Caption and custom answers go
to `svqa:{cam}:job:{name}`; subtitle cues go to `svqa:{cam}:transcript` (the source of truth)
and, when a directory is configured, to WebVTT/SRT files rewritten from it. Alert jobs score a
yes/no question and, when it turns to yes, add an entry to `svqa:{cam}:alerts` and hand it to
the delivery thread (`qa_worker.alerts`).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import redis
import structlog

from common import metrics, redisio
from common.config import Job
from common.engine.answer import ask, choose
from common.engine.kvcache import Version
from common.engine.params import GenerationParams, QuestionError
from common.engine.runtime import Runtime
from common.wire import keys
from common.wire.alert_record import Alert, frame_path
from common.wire.transcript import Cue, cues_of, render_transcript
from qa_worker.alerts import YES_NO, AlertSettings, Delivery, Gate, State, p_yes
from qa_worker.subtitles import SUBTITLE_PROMPT, SubtitleTracker, parse_model_output

log = structlog.get_logger()

CAPTION_PROMPT = "Describe what is happening in the video right now in one or two sentences."
TRANSCRIPT_MAXLEN = 100_000
IDLE_FLUSH_S = 10.0  # subtitle cues still open close once a stream has had no new version this long


class Answer(Protocol):
    """The model as jobs use it: free text for prompts, option scores for alerts."""

    def __call__(self, version: Version, prompt: str) -> str: ...
    def choose(self, version: Version, question: str, choices: Sequence[str]) -> list[float]: ...


@dataclass
class Schedule:
    job: Job
    stream: str
    last_version: int = -1
    epoch: str = ""  # the stream's life the last run's version was of (Version.epoch)
    last_t: float | None = None  # capture time of the last run's version end
    last_run: float | None = None  # time.monotonic() of the last run, while subtitle cues may be open
    tracker: SubtitleTracker = field(default_factory=SubtitleTracker)
    gate: Gate | None = None  # alert jobs
    last_alert: str = ""  # alert jobs: id of the newest alert, fired here or before a restart
    told: bool = False  # alert jobs: their state has been sent (MQTT) since start

    def __post_init__(self) -> None:
        if self.job.kind == "alert":
            self.gate = Gate(self.job.debounce, self.job.cooldown_s)

    def started_over(self, version: Version) -> bool:
        """Whether ``version`` is of a later life of the stream than the last run's (its Redis came
        back empty, say): version ids and capture times start over, and so does this schedule."""
        if self.last_version < 0 or version.epoch == self.epoch:
            return False
        self.last_version, self.last_t = -1, None
        return True

    def due(self, version: Version) -> bool:
        if version.id <= self.last_version or not version.chunks:
            return False
        if self.last_version < 0:
            return True
        by_versions = self.job.every_versions is not None and version.id - self.last_version >= self.job.every_versions
        t_end = version.capture_range[1] if version.capture_range else 0.0
        by_time = self.job.every_s is not None and t_end - (self.last_t or 0.0) >= self.job.every_s
        return by_versions or by_time


@dataclass(frozen=True)
class ModelAnswer:
    rt: Runtime
    max_tokens: int = 128

    def __call__(self, version: Version, prompt: str) -> str:
        return ask(self.rt, version, prompt, GenerationParams(max_tokens=self.max_tokens)).text

    def choose(self, version: Version, question: str, choices: Sequence[str]) -> list[float]:
        return choose(self.rt, version, question, list(choices)).scores


def model_answer(rt: Runtime, max_tokens: int = 128) -> Answer:
    return ModelAnswer(rt, max_tokens)


class JobRunner:
    def __init__(
        self,
        r: redis.Redis,
        lookup: Callable[[str], Version | None],
        jobs: list[Job],
        streams: list[str],
        answer: Answer,
        transcript_dir: str | None = None,
        frames: redis.Redis | None = None,
        idle_flush_s: float = IDLE_FLUSH_S,
        alerts: AlertSettings | None = None,
    ):
        self.r, self.lookup, self.answer = r, lookup, answer
        self.alerts = alerts or AlertSettings()
        self.idle_flush_s = idle_flush_s
        self.frames = frames or r  # where ingest keeps the latest frame; an alert's copy goes beside it
        self.transcript_dir = Path(transcript_dir) if transcript_dir else None
        self.schedules = [Schedule(j, s) for j in jobs for s in streams if j.stream in ("*", s)]
        self.delivery = None
        if any(j.kind == "alert" for j in jobs):
            self.delivery = Delivery(discovery_prefix=self.alerts.discovery_prefix)
        for sched in self.schedules:  # a restarted worker does not repeat what it already transcribed
            self._remember(sched)
        self._resume_alerts()

    def run_due(self) -> int:
        """Run every job whose time has come; returns how many ran."""
        ran = 0
        for sched in self.schedules:
            version = self.lookup(sched.stream)
            if version is not None and sched.started_over(version):
                self._start_over(sched, version)
            if version is not None and sched.due(version):
                self._run(sched, version)
                ran += 1
            elif sched.last_run is not None and time.monotonic() - sched.last_run > self.idle_flush_s:
                # no new video for a while (a file that ended, a camera that stopped): the lines on
                # screen at the end are final, so their cues close instead of waiting for more video
                sched.last_run = None
                self._emit_cues(sched, sched.tracker.flush(), None)
        return ran

    def _remember(self, sched: Schedule) -> None:
        if sched.job.kind == "subtitles":
            recent = self.r.xrevrange(keys.transcript(sched.stream), count=sched.tracker.history)
            sched.tracker.resume(cues_of(redisio.text_fields(f) for _, f in reversed(recent)))

    def _resume_alerts(self) -> None:
        """Alert gates go on from each job's newest alert, so a restarted worker does not fire again
        for a state it already alerted on (it did at every restart, with a new id)."""
        gated: dict[str, dict[str, Schedule]] = {}
        for sched in self.schedules:
            if sched.gate is not None:
                gated.setdefault(sched.stream, {})[sched.job.name] = sched
        for stream, scheds in gated.items():
            armed, newest = self._gates(stream, set(scheds))
            now, wall = time.monotonic(), time.time()
            for name, alert in newest.items():
                sched = scheds[name]
                assert sched.gate is not None
                sched.last_alert = alert.id
                sched.gate.resume(wall - alert.at, armed.get(name) == alert.id, now)

    def _gates(self, stream: str, jobs: set[str]) -> tuple[dict[str, str], dict[str, Alert]]:
        """What `_resume_alerts` goes on from; nothing under a users.acl older than it (the gates then
        start afresh, as they did before)."""

        def read() -> tuple[dict[str, str], dict[str, Alert]]:
            return redisio.text_fields(self.r.hgetall(keys.alerts_armed(stream))), newest_alerts(self.r, stream, jobs)

        return redisio.unless_refused(read, ({}, {}), "alert gates across restarts")

    def _start_over(self, sched: Schedule, version: Version) -> None:
        """Cues still open close now (what was seen stays seen); the next ones are told apart from
        what the transcript holds now (nothing, if Redis came back empty), capture times anew."""
        was = {"was_epoch": sched.epoch, "job": sched.job.name}
        log.warning("stream restarted; its job starts over", stream=sched.stream, epoch=version.epoch, **was)
        redisio.event(self.r, sched.stream, "qa", "job_restarted", epoch=version.epoch, version=version.id, **was)
        self._emit_cues(sched, sched.tracker.flush(), None)
        sched.tracker, sched.last_run = SubtitleTracker(), None
        self._remember(sched)

    def _run(self, sched: Schedule, version: Version) -> None:
        job, bound = sched.job, log.bind(job=sched.job.name, stream=sched.stream, version=version.id)
        sched.last_version, sched.epoch = version.id, version.epoch
        t0, t1 = version.capture_range or (0.0, 0.0)
        sched.last_t = t1
        prompt = job.prompt or (SUBTITLE_PROMPT if job.kind == "subtitles" else CAPTION_PROMPT)
        try:
            if job.kind == "alert":
                self._alert(sched, version, bound)
                metrics.JOB_RUNS.labels(job.name, sched.stream, "ok").inc()
                return
            text = self.answer(version, prompt)
        except (RuntimeError, ValueError) as e:  # a bad prompt, or out of GPU or pool memory: this run fails
            # a bad prompt is said in one line; the engine's failures come with their traceback
            bound.error("job failed", error=str(e), exc_info=not isinstance(e, QuestionError))
            metrics.JOB_RUNS.labels(job.name, sched.stream, "error").inc()
            return
        if job.kind == "subtitles":
            self._emit_cues(sched, sched.tracker.observe(t0, t1, parse_model_output(text)), version)
            sched.last_run = time.monotonic()
        else:
            fields = {
                "job": job.name,
                "version": str(version.id),
                "t_start": f"{t0:.3f}",
                "t_end": f"{t1:.3f}",
                "text": text,
            }
            redisio.xadd_capped(self.r, keys.job_output(sched.stream, job.name), fields, TRANSCRIPT_MAXLEN)
        metrics.JOB_RUNS.labels(job.name, sched.stream, "ok").inc()
        bound.info("job ran", chars=len(text))

    def _alert(self, sched: Schedule, version: Version, bound: structlog.typing.FilteringBoundLogger) -> None:
        job, (t0, t1) = sched.job, version.capture_range or (0.0, 0.0)
        assert sched.gate is not None and self.delivery is not None and job.prompt
        score = p_yes(self.answer.choose(version, job.prompt, YES_NO))
        bound.debug("alert scored", score=round(score, 4))
        was_on = not sched.gate.armed
        if not sched.gate.observe(score >= job.threshold, time.monotonic()):
            on = not sched.gate.armed
            if was_on and not on:  # turned to no: kept, so that a restarted worker knows it may fire again
                armed = functools.partial(self.r.hset, keys.alerts_armed(sched.stream), job.name, sched.last_alert)
                redisio.unless_refused(armed, 0, "alert gates across restarts")
            # The state: said at the job's first run here (a state retained from before a restart is
            # replaced; only the worker that runs the job says it) and when the answer turned to no.
            if not sched.told or (was_on and not on):
                self.delivery.tell(State(sched.stream, job.name, on=on), job.mqtt)
                sched.told = True
            return
        sched.told = True
        alert_id = Alert.new_id()
        frame = keys.alert_frame(sched.stream, alert_id)
        pipe = self.frames.pipeline(transaction=False)  # a copy: the latest frame is overwritten every second
        pipe.copy(keys.latest_frame(sched.stream), frame)
        pipe.expire(frame, self.alerts.frame_ttl_s)
        copied = pipe.execute()[0]
        alert = Alert(
            id=alert_id,
            stream=sched.stream,
            job=job.name,
            question=job.prompt,
            score=score,
            threshold=job.threshold,
            version=version.id,
            t_start=t0,
            t_end=t1,
            at=time.time(),
            frame=self.alerts.base_url.rstrip("/") + frame_path(sched.stream, alert_id) if copied else None,
        )
        redisio.xadd_capped(self.r, keys.alerts(sched.stream), alert.fields(), self.alerts.maxlen)
        sched.last_alert = alert_id
        metrics.ALERTS.labels(sched.stream, job.name).inc()
        self.delivery.submit(alert, {"webhook": job.webhook, "mqtt": job.mqtt})
        bound.info("alert", alert=alert_id, score=round(score, 4))

    def flush(self) -> None:
        """End of service: close open cues so the transcript holds everything seen; deliver queued alerts."""
        for sched in self.schedules:
            if sched.job.kind == "subtitles":
                self._emit_cues(sched, sched.tracker.flush(), None)
        if self.delivery is not None:
            self.delivery.close()

    def _emit_cues(self, sched: Schedule, cues: list[Cue], version: Version | None) -> None:
        if not cues:
            return
        for cue in cues:
            fields = {"start": f"{cue.start:.3f}", "end": f"{cue.end:.3f}", "text": cue.text, "job": sched.job.name}
            if version is not None:  # none when the cue closed without a new version (transcript.entry_json)
                fields["version"] = str(version.id)
            redisio.xadd_capped(self.r, keys.transcript(sched.stream), fields, TRANSCRIPT_MAXLEN)
        if self.transcript_dir is not None:
            try:
                self._write_files(sched)
            except OSError as e:
                # A full disk or a read-only volume: the cues are in Redis (the source of truth) and
                # the files are rewritten whole from it at the next cue; questions and jobs go on.
                log.error("subtitle files not written", stream=sched.stream, error=str(e))

    def _write_files(self, sched: Schedule) -> None:
        cues = cues_of(redisio.text_fields(f) for _, f in self.r.xrange(keys.transcript(sched.stream)))
        self.transcript_dir.mkdir(parents=True, exist_ok=True)
        for fmt in sched.job.formats:
            _write_atomic(self.transcript_dir / f"{sched.stream}.{fmt}", render_transcript(cues, fmt))


ALERTS_PAGE = 500  # alerts read at a time, newest first, looking for each job's newest


def newest_alerts(r: redis.Redis, stream: str, jobs: set[str]) -> dict[str, Alert]:
    """The newest alert of each of ``jobs`` on ``stream`` that has one (all other jobs' alerts may
    be newer: read back page by page until each is found or the capped stream ends)."""
    found: dict[str, Alert] = {}
    end = "+"
    while len(found) < len(jobs):
        page = r.xrevrange(keys.alerts(stream), max=end, count=ALERTS_PAGE)
        for _, raw in page:
            fields = redisio.text_fields(raw)
            name = fields.get("job", "")
            if name in jobs and name not in found:
                try:
                    found[name] = Alert.from_fields(fields)
                except ValueError:  # an entry that is no alert (written by hand): nothing to go on from
                    continue
        if len(page) < ALERTS_PAGE:
            break
        end = "(" + redisio.text(page[-1][0])
    return found


def _write_atomic(path: Path, text: str) -> None:
    """Players may read the file at any time: never show them half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
