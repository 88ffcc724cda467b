"""Periodic jobs from the cameras file: captions, custom prompts, subtitle transcription.

A job runs on a stream every `every_s` seconds of capture time and/or every `every_versions`
new cache versions, against the head version at that moment. Caption and custom answers go
to `svqa:{cam}:job:{name}`; subtitle cues go to `svqa:{cam}:transcript` (the source of truth)
and, when a directory is configured, to WebVTT/SRT files rewritten from it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
import structlog

from common import metrics, redisio
from common.config import Job
from common.engine.answer import ask
from common.engine.kvcache import Version
from common.engine.params import GenerationParams, QuestionError
from common.engine.runtime import Runtime
from common.wire import keys
from qa_worker.subtitles import SUBTITLE_PROMPT, Cue, SubtitleTracker, parse_model_output, to_srt, to_webvtt

log = structlog.get_logger()

CAPTION_PROMPT = "Describe what is happening in the video right now in one or two sentences."
TRANSCRIPT_MAXLEN = 100_000

Answer = Callable[[Version, str], str]  # (version, prompt) -> model text


@dataclass
class Schedule:
    job: Job
    stream: str
    last_version: int = -1
    last_t: float | None = None  # capture time of the last run's version end
    tracker: SubtitleTracker = field(default_factory=SubtitleTracker)

    def due(self, version: Version) -> bool:
        if version.id <= self.last_version or not version.chunks:
            return False
        if self.last_version < 0:
            return True
        by_versions = self.job.every_versions is not None and version.id - self.last_version >= self.job.every_versions
        t_end = version.capture_range[1] if version.capture_range else 0.0
        by_time = self.job.every_s is not None and t_end - (self.last_t or 0.0) >= self.job.every_s
        return by_versions or by_time


def model_answer(rt: Runtime, max_tokens: int = 128) -> Answer:
    return lambda version, prompt: ask(rt, version, prompt, GenerationParams(max_tokens=max_tokens)).text


class JobRunner:
    def __init__(
        self,
        r: redis.Redis,
        lookup: Callable[[str], Version | None],
        jobs: list[Job],
        streams: list[str],
        answer: Answer,
        transcript_dir: str | None = None,
    ):
        self.r, self.lookup, self.answer = r, lookup, answer
        self.transcript_dir = Path(transcript_dir) if transcript_dir else None
        self.schedules = [Schedule(j, s) for j in jobs for s in streams if j.stream in ("*", s)]
        for sched in self.schedules:  # a restarted worker does not repeat what it already transcribed
            if sched.job.kind == "subtitles":
                recent = self.r.xrevrange(keys.transcript(sched.stream), count=sched.tracker.history)
                sched.tracker.remember(f[b"text"].decode() for _, f in reversed(recent))

    def run_due(self) -> int:
        """Run every job whose time has come; returns how many ran."""
        ran = 0
        for sched in self.schedules:
            version = self.lookup(sched.stream)
            if version is not None and sched.due(version):
                self._run(sched, version)
                ran += 1
        return ran

    def _run(self, sched: Schedule, version: Version) -> None:
        job, bound = sched.job, log.bind(job=sched.job.name, stream=sched.stream, version=version.id)
        sched.last_version = version.id
        t0, t1 = version.capture_range or (0.0, 0.0)
        sched.last_t = t1
        prompt = job.prompt or (SUBTITLE_PROMPT if job.kind == "subtitles" else CAPTION_PROMPT)
        try:
            text = self.answer(version, prompt)
        except QuestionError as e:
            bound.error("job failed", error=str(e))
            metrics.JOB_RUNS.labels(job.name, sched.stream, "error").inc()
            return
        if job.kind == "subtitles":
            self._emit_cues(sched, sched.tracker.observe(t0, t1, parse_model_output(text)), version)
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

    def flush(self) -> None:
        """End of service: close open cues so the transcript holds everything seen."""
        for sched in self.schedules:
            if sched.job.kind == "subtitles":
                self._emit_cues(sched, sched.tracker.flush(), None)

    def _emit_cues(self, sched: Schedule, cues: list[Cue], version: Version | None) -> None:
        if not cues:
            return
        for cue in cues:
            fields = {
                "start": f"{cue.start:.3f}",
                "end": f"{cue.end:.3f}",
                "text": cue.text,
                "job": sched.job.name,
                "version": str(version.id if version else -1),
            }
            redisio.xadd_capped(self.r, keys.transcript(sched.stream), fields, TRANSCRIPT_MAXLEN)
        if self.transcript_dir is not None:
            self._write_files(sched)

    def _write_files(self, sched: Schedule) -> None:
        cues = [
            Cue(float(f[b"start"]), float(f[b"end"]), f[b"text"].decode())
            for _, f in self.r.xrange(keys.transcript(sched.stream))
        ]
        cues.sort(key=lambda c: c.start)
        origin = cues[0].start if cues[0].start > 1e8 else 0.0  # live streams carry unix times
        self.transcript_dir.mkdir(parents=True, exist_ok=True)
        for fmt in sched.job.formats:
            text = to_webvtt(cues, origin) if fmt == "vtt" else to_srt(cues, origin)
            _write_atomic(self.transcript_dir / f"{sched.stream}.{fmt}", text)


def _write_atomic(path: Path, text: str) -> None:
    """Players may read the file at any time: never show them half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
