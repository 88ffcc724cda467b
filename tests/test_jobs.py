"""Periodic jobs: scheduling, subtitle dedupe and cue times, WebVTT/SRT files, and the whole wiring
through `streamvqa worker` (one process: encoder + qa) with metrics scraped while it runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import redis
import yaml

from apps.samplevideo import caption_at, write_sample_video
from common.config import Job
from common.engine.grid import StreamSpec, choose_grid
from common.engine.model import load_model
from common.engine.pool import PoolFull
from common.engine.runtime import Runtime
from common.engine.stream_engine import StreamEngine
from common.segment_store import MemoryStore
from common.wire import keys
from common.wire.schemas import Manifest
from ingest.video import iter_file_frames
from qa_worker.jobs import JobRunner
from qa_worker.mirror import Mirror
from tests.conftest import free_port
from tests.pipeline import Services, head, wait_for
from tests.subtitle_readers import parse_srt, parse_webvtt, validate_srt, validate_webvtt
from tests.test_robust import CAM, drain, encoder, frame

CAPTIONS = ((0.0, "RED BALL"), (3.0, "BLUE BOX"), (6.0, "GREEN STAR"))


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


def reader_of_screen(version, prompt: str) -> str:
    """Stands in for a model that can read (tiny-random cannot): the caption burned in at the
    newest frame, with OCR-like jitter on odd versions so dedupe has work to do."""
    text = caption_at(version.capture_range[1], CAPTIONS)
    return text.replace("O", "0") if version.id % 2 else f"```\n{text}\n```"


def test_subtitle_job_schedule_dedupe_cues_and_files(rt, redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    video = write_sample_video(str(tmp_path / "v.mp4"), seconds=9, fps=10, captions=CAPTIONS)
    frames = list(iter_file_frames(video, 2.0))
    grid = choose_grid(*frames[0].rgb.shape[:2], min_pixels=16 * 28 * 28, max_pixels=64 * 28 * 28)
    engine = StreamEngine(rt, StreamSpec("cam1", 2.0, grid, 2))
    job = Job(name="subs", stream="cam1", kind="subtitles", every_s=1.0, formats=("vtt", "srt"))
    runner = JobRunner(r, lambda s: engine.head, [job], ["cam1"], reader_of_screen, str(tmp_path / "subs"))
    runs = []
    for i in range(0, len(frames), 2):
        chunk = frames[i : i + 2]
        engine.append([f.rgb for f in chunk], [f.pts for f in chunk], [f.index for f in chunk])
        runs.append(runner.run_due())
    runner.flush()
    assert runs == [1] * len(runs), "every chunk adds 1 s of video: the 1 s job runs every time"
    cues = [(float(f[b"start"]), float(f[b"end"]), f[b"text"].decode()) for _, f in r.xrange(keys.transcript("cam1"))]
    assert [c[2] for c in cues] == ["RED BALL", "BLUE BOX", "GREEN STAR"], cues
    (red, blue, green) = cues
    assert red[0] == 0.0 and blue[0] == pytest.approx(2.5) and green[0] == pytest.approx(5.5)
    assert red[1] == pytest.approx(2.5) and blue[1] == pytest.approx(5.5) and green[1] == pytest.approx(8.5)
    vtt = (tmp_path / "subs" / "cam1.vtt").read_text()
    srt = (tmp_path / "subs" / "cam1.srt").read_text()
    validate_webvtt(vtt)
    validate_srt(srt)
    assert [c.text for c in parse_webvtt(vtt)] == [c.text for c in parse_srt(srt)] == [c[2] for c in cues]
    for path in ("cam1.vtt", "cam1.srt"):  # a real, independent parser reads them
        ffmpeg = subprocess.run(
            ["ffmpeg", "-v", "error", "-i", str(tmp_path / "subs" / path), "-f", "srt", "-"],
            capture_output=True,
            text=True,
        )
        assert ffmpeg.returncode == 0 and ffmpeg.stdout.count("-->") == 3, ffmpeg.stderr


def test_every_versions_schedule_and_caption_output(rt, redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    grid = choose_grid(56, 56, min_pixels=4 * 28 * 28)
    engine = StreamEngine(rt, StreamSpec("cam1", 2.0, grid, 2))
    job = Job(name="cap", stream="*", kind="caption", every_versions=3)
    runner = JobRunner(r, lambda s: engine.head, [job], ["cam1"], lambda v, p: f"caption of v{v.id}")
    assert runner.run_due() == 0, "no frames yet: nothing to caption"
    ran = []
    for i in range(7):
        engine.append([np.full((56, 56, 3), i, np.uint8)] * 2, [i, i + 0.5], [2 * i, 2 * i + 1])
        ran.append(runner.run_due())
    assert ran == [1, 0, 0, 1, 0, 0, 1]
    texts = [f[b"text"].decode() for _, f in r.xrange(keys.job_output("cam1", "cap"))]
    assert texts == ["caption of v1", "caption of v4", "caption of v7"]


def test_jobs_and_mirrors_follow_a_stream_restarted_on_an_empty_redis(rt, redis_url):
    """Issue 37.4: Redis came back empty (no AOF, a failover to an empty replica) and the stream
    started over at version 0. Jobs skipped every version id up to the last they had run on, for
    good; now versions carry the stream's epoch, and a new one restarts jobs and mirrors, with
    events."""
    r, store = redis.Redis.from_url(redis_url), MemoryStore()
    job = Job(name="cap", stream=CAM, kind="caption", every_versions=1)

    def encode(n_frames: int) -> Manifest:  # an encoder that opens the stream (continued or new) and encodes
        svc = encoder(rt, r, redis_url, store=store)
        for seq in range(n_frames):
            r.xadd(keys.frames(CAM), frame(seq))
        drain(svc, r)
        return head(r, CAM)

    first = encode(8)
    mirror = Mirror(rt, r, store, [CAM], block_ms=50)
    runner = JobRunner(r, mirror.get, [job], [CAM], lambda v, p: f"{v.epoch}:{v.id}")
    assert runner.run_due() == 1 and mirror.get(CAM).epoch == first.epoch != ""
    r.flushall()
    second = encode(4)
    assert second.epoch != first.epoch and second.version < first.version
    mirror.poll()
    assert (mirror.get(CAM).epoch, mirror.get(CAM).id) == (second.epoch, second.version)
    assert runner.run_due() == 1, "the job runs on the new life's versions"
    assert [f[b"text"].decode() for _, f in r.xrange(keys.job_output(CAM, "cap"))] == [
        f"{second.epoch}:{second.version}"
    ]
    seen = {(f[b"source"], f[b"type"]): f for _, f in r.xrange(keys.events(CAM))}
    assert seen[b"encoder", b"started"][b"epoch"] == second.epoch.encode()
    for kind in (b"restarted", b"job_restarted"):  # the mirror's and the job's
        assert (seen[b"qa", kind][b"was_epoch"], seen[b"qa", kind][b"epoch"]) == (
            first.epoch.encode(),
            second.epoch.encode(),
        )
    encode(6)  # the new life continues (restored from its head): the same epoch, no restart
    mirror.poll()
    assert runner.run_due() == 1 and mirror.get(CAM).epoch == second.epoch
    assert len([f for _, f in r.xrange(keys.events(CAM)) if f[b"type"] == b"job_restarted"]) == 1


def test_worker_runs_jobs_answers_and_exports_metrics(redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    video = write_sample_video(str(tmp_path / "v.mp4"), seconds=6, fps=10, width=160, height=120)
    cameras = tmp_path / "cameras.yaml"
    cameras.write_text(
        yaml.safe_dump(
            {
                "cameras": [{"name": "cam1", "url": video, "fps": 2}],
                "jobs": [
                    {
                        "name": "subs",
                        "stream": "cam1",
                        "kind": "subtitles",
                        "every_versions": 1,
                        "formats": ["vtt", "srt"],
                    },
                    {"name": "cap", "stream": "*", "kind": "caption", "every_versions": 2},
                ],
            }
        )
    )
    services = Services(redis_url, tmp_path, SVQA_CAMERAS_FILE=str(cameras))
    try:
        port = free_port()
        services.start("worker", "--metrics-port", str(port), "--transcript-dir", str(tmp_path / "subs"))
        ingest = services.start("ingest", "--max-backlog", "8", "--metrics-port", str(free_port()))
        assert ingest.wait(timeout=120) == 0, services.logs()
        wait_for(lambda: (h := head(r, "cam1")) and h.last_frame_seq == 11, 120, "frames encoded", services)
        # after a 128-token subtitle run on each version: 50 s measured beside two busy loops
        wait_for(lambda: r.xlen(keys.job_output("cam1", "cap")) >= 1, 300, "a caption job run", services)
        from qa_worker.client import Client

        final = Client(r).ask("cam1", "What is on screen?", max_tokens=4, timeout_s=120)
        assert final.error is None and final.version is not None

        def counted() -> str | None:  # the question's metrics follow its final entry, which the client read
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            return text if _metric(text, "svqa_qa_first_token_seconds_count") >= 1 else None  # the last one set

        scraped = wait_for(counted, 30, "the question counted", services)
        assert _metric(scraped, 'svqa_cache_tokens{stream="cam1"}') > 0
        assert _metric(scraped, 'svqa_encoder_frames_total{stream="cam1"}') == 12
        assert _metric(scraped, 'svqa_qa_job_runs_total{job="cap",outcome="ok",stream="cam1"}') >= 1
        assert _metric(scraped, 'svqa_qa_job_runs_total{job="subs",outcome="ok",stream="cam1"}') >= 1
        assert _metric(scraped, 'svqa_qa_questions_total{outcome="ok"}') >= 1
        assert _metric(scraped, "svqa_qa_first_token_seconds_count") >= 1
        services.stop_all(timeout_s=120)  # the worker flushes open cues on the way out
        transcript = subprocess.run(
            [
                str(Path(sys.executable).parent / "streamvqa"),
                "transcript",
                "--redis-url",
                redis_url,
                "--stream",
                "cam1",
                "--format",
                "vtt",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert transcript.returncode == 0, transcript.stderr
        validate_webvtt(transcript.stdout)
        if r.xlen(keys.transcript("cam1")):  # tiny-random may answer NONE-like text: then there are no cues
            validate_webvtt((tmp_path / "subs" / "cam1.vtt").read_text())
            validate_srt((tmp_path / "subs" / "cam1.srt").read_text())
    finally:
        services.stop_all()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


def test_a_restarted_subtitle_job_does_not_repeat_cues(rt, redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    grid = choose_grid(56, 56, min_pixels=4 * 28 * 28)
    engine = StreamEngine(rt, StreamSpec("cam1", 2.0, grid, 2))
    job = Job(name="subs", stream="cam1", kind="subtitles", every_versions=1)

    def screen(version, prompt: str) -> str:
        return "EXIT ONLY" if version.id < 4 else "EXIT ONLY\nNO PARKING"

    for _restart in range(2):  # the worker restarts between the two runs
        runner = JobRunner(r, lambda s: engine.head, [job], ["cam1"], screen)
        for i in range(3):
            engine.append([np.full((56, 56, 3), i, np.uint8)] * 2, [0.0, 0.5])
            runner.run_due()
        runner.flush()
    texts = [f[b"text"].decode() for _, f in r.xrange(keys.transcript("cam1"))]
    assert texts == ["EXIT ONLY", "NO PARKING"]


def _cues(r: redis.Redis, stream: str) -> list[tuple[float, float, str]]:
    """The transcript's cues as (start, end, text), in the order they were written."""
    entries = r.xrange(keys.transcript(stream))
    return [(float(f[b"start"]), float(f[b"end"]), f[b"text"].decode()) for _, f in entries]


def test_a_restarted_subtitle_job_goes_on_from_its_last_cue(rt, redis_url):
    """After a restart the cache is the same (restored from the segment store): the first new cue
    used to start at the cache's oldest chunk, spanning all of it, over every cue written before."""
    r = redis.Redis.from_url(redis_url)
    grid = choose_grid(56, 56, min_pixels=4 * 28 * 28)
    engine = StreamEngine(rt, StreamSpec("cam1", 2.0, grid, 2))
    job = Job(name="subs", stream="cam1", kind="subtitles", every_versions=1)

    def screen(version, prompt: str) -> str:
        return "EXIT ONLY" if version.id < 4 else "NO PARKING"

    chunk = 0
    for _restart in range(2):  # the worker restarts between the two runs
        runner = JobRunner(r, lambda s: engine.head, [job], ["cam1"], screen)
        for _ in range(3):
            engine.append([np.full((56, 56, 3), chunk, np.uint8)] * 2, [10.0 + chunk, 10.5 + chunk])
            chunk += 1
            runner.run_due()
        runner.flush()
    assert engine.head.capture_range[0] == 10.0, "the cache still holds the first chunk"
    (exit_only, no_parking) = _cues(r, "cam1")
    assert exit_only[2] == "EXIT ONLY" and no_parking[2] == "NO PARKING"
    assert no_parking[0] == exit_only[1] == 12.5, "from the end of the last cue, not the cache's start"


def test_transcript_json_is_in_the_order_of_the_cues(rt, redis_url):
    """A short line closes before a long one that began earlier, so the stream holds their cues out
    of order: `streamvqa transcript --format json` gave them so (the files were sorted)."""
    r = redis.Redis.from_url(redis_url)
    grid = choose_grid(56, 56, min_pixels=4 * 28 * 28)
    engine = StreamEngine(rt, StreamSpec("cam1", 2.0, grid, 2))
    job = Job(name="subs", stream="cam1", kind="subtitles", every_versions=1)
    screens = {1: "EXIT ONLY", 2: "EXIT ONLY\nNO PARKING", 3: "EXIT ONLY"}
    runner = JobRunner(r, lambda s: engine.head, [job], ["cam1"], lambda v, p: screens.get(v.id, "NONE"))
    for i in range(4):
        engine.append([np.full((56, 56, 3), i, np.uint8)] * 2, [i, i + 0.5])
        runner.run_due()
    assert [c[2] for c in _cues(r, "cam1")] == ["NO PARKING", "EXIT ONLY"], "written as they closed"
    argv = ["transcript", "--stream", "cam1", "--format", "json", "--redis-url", redis_url]
    cli = subprocess.run([sys.executable, "-m", "apps.cli", *argv], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    shown = json.loads(cli.stdout)
    assert [e["text"] for e in shown] == ["EXIT ONLY", "NO PARKING"]
    assert [float(e["start"]) for e in shown] == sorted(float(e["start"]) for e in shown)


def test_transcript_json_gives_numbers_as_numbers_and_no_version_as_null(rt, redis_url):
    """The API's and the CLI's JSON: `start`, `end` and `version` are numbers (they were the text
    Redis keeps), and a cue closed with no new version (here: at shutdown) has version null (it
    was "-1"); an entry an older worker wrote with "-1" reads as null too."""
    import asyncio

    import httpx

    from api.app import create_app
    from api.config import ApiConfig

    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("cam1"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})
    grid = choose_grid(56, 56, min_pixels=4 * 28 * 28)
    engine = StreamEngine(rt, StreamSpec("cam1", 2.0, grid, 2))
    job = Job(name="subs", stream="cam1", kind="subtitles", every_versions=1)
    screens = {1: "EXIT ONLY", 2: "EXIT ONLY", 3: "NO PARKING", 4: "NO PARKING"}
    runner = JobRunner(r, lambda s: engine.head, [job], ["cam1"], lambda v, p: screens.get(v.id, "NONE"))
    for i in range(4):
        engine.append([np.full((56, 56, 3), i, np.uint8)] * 2, [i, i + 0.5])
        runner.run_due()
    runner.flush()  # NO PARKING is still on screen: closed with no version
    r.xadd(keys.transcript("cam1"), {"start": "9.000", "end": "9.500", "text": "OLD", "job": "subs", "version": "-1"})

    async def api() -> list[dict]:
        app = create_app(ApiConfig(redis_url=redis_url))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            return (await client.get("/api/streams/cam1/transcript")).json()["cues"]

    argv = ["transcript", "--stream", "cam1", "--format", "json", "--redis-url", redis_url]
    cli = subprocess.run([sys.executable, "-m", "apps.cli", *argv], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    for shown in (asyncio.run(api()), json.loads(cli.stdout)):
        assert [(c["text"], c["version"]) for c in shown] == [("EXIT ONLY", 3), ("NO PARKING", None), ("OLD", None)]
        assert all(isinstance(c["start"], float) and isinstance(c["end"], float) for c in shown), shown
        assert shown[0]["start"] == 0.0 and shown[-1]["end"] == 9.5


def test_job_outputs_json_gives_numbers_as_numbers_and_absent_as_null(rt, redis_url):
    """GET /api/streams/{cam}/jobs/{job}: `version` an int, `t_start` and `t_end` numbers (they
    were the text Redis keeps, as transcripts' were); one an entry lacks (another writer's) null."""
    import asyncio

    import httpx

    from api.app import create_app
    from api.config import ApiConfig

    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("cam1"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})
    grid = choose_grid(56, 56, min_pixels=4 * 28 * 28)
    engine = StreamEngine(rt, StreamSpec("cam1", 2.0, grid, 2))
    job = Job(name="cap", stream="cam1", kind="caption", every_versions=1)
    runner = JobRunner(r, lambda s: engine.head, [job], ["cam1"], lambda v, p: f"caption of v{v.id}")
    engine.append([np.full((56, 56, 3), 1, np.uint8)] * 2, [3.0, 3.5])
    assert runner.run_due() == 1
    r.xadd(keys.job_output("cam1", "cap"), {"job": "cap", "text": "OLD"})

    async def api() -> list[dict]:
        app = create_app(ApiConfig(redis_url=redis_url))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            return (await client.get("/api/streams/cam1/jobs/cap")).json()["outputs"]

    ran, old = asyncio.run(api())
    assert (ran["text"], ran["version"], ran["t_start"], ran["t_end"]) == ("caption of v1", 1, 3.0, 3.5), ran
    assert type(ran["version"]) is int and type(ran["t_start"]) is float and type(ran["t_end"]) is float
    assert (old["text"], old["version"], old["t_start"], old["t_end"]) == ("OLD", None, None, None), old


def test_open_subtitle_cues_close_once_the_stream_goes_quiet(rt, redis_url, tmp_path):
    """A file that ended (or a camera that stopped) leaves its last lines open; they become cues
    after `idle_flush_s` without a new version, not only when the service stops."""
    r = redis.Redis.from_url(redis_url)
    video = write_sample_video(str(tmp_path / "v.mp4"), seconds=2, fps=10, captions=CAPTIONS)
    frames = list(iter_file_frames(video, 2.0))
    grid = choose_grid(*frames[0].rgb.shape[:2], min_pixels=16 * 28 * 28, max_pixels=64 * 28 * 28)
    engine = StreamEngine(rt, StreamSpec("quiet", 2.0, grid, 2))
    job = Job(name="subs", stream="quiet", kind="subtitles", every_s=1.0)
    # Quiet for a minute at most while it still sees video (a loaded machine takes its time over
    # each run), for half a second once the video has stopped.
    runner = JobRunner(r, lambda s: engine.head, [job], ["quiet"], reader_of_screen, idle_flush_s=60)
    for i in range(0, len(frames), 2):
        chunk = frames[i : i + 2]
        engine.append([f.rgb for f in chunk], [f.pts for f in chunk], [f.index for f in chunk])
        runner.run_due()
    assert r.xlen(keys.transcript("quiet")) == 0  # "RED BALL" is still on screen: its cue is open
    runner.run_due()
    assert r.xlen(keys.transcript("quiet")) == 0  # not quiet for long enough yet
    runner.idle_flush_s = 0.5
    time.sleep(0.6)
    assert runner.run_due() == 0
    cues = [f[b"text"].decode() for _, f in r.xrange(keys.transcript("quiet"))]
    assert cues == ["RED BALL"]
    runner.run_due()
    assert r.xlen(keys.transcript("quiet")) == 1  # closed once


def test_unwritable_subtitle_files_do_not_stop_the_job(rt, redis_url, tmp_path):
    """A transcript_dir that cannot be written (full disk, read-only volume, a file in the way)
    used to raise out of the job runner and stop the whole worker, questions included."""
    r = redis.Redis.from_url(redis_url)
    grid = choose_grid(56, 56, min_pixels=4 * 28 * 28)
    engine = StreamEngine(rt, StreamSpec("cam1", 2.0, grid, 2))
    job = Job(name="subs", stream="cam1", kind="subtitles", every_versions=1)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")

    def screen(version, prompt: str) -> str:
        return "EXIT ONLY" if version.id < 2 else "NO PARKING"

    runner = JobRunner(r, lambda s: engine.head, [job], ["cam1"], screen, str(blocker / "subs"))
    for i in range(3):
        engine.append([np.full((56, 56, 3), i, np.uint8)] * 2, [i, i + 0.5])
        assert runner.run_due() == 1
    runner.flush()
    texts = [f[b"text"].decode() for _, f in r.xrange(keys.transcript("cam1"))]
    assert texts == ["EXIT ONLY", "NO PARKING"], "the transcript in Redis is still written"


def test_garbage_in_the_transcript_is_left_out_not_raised(rt, redis_url, tmp_path):
    """Entries of svqa:{cam}:transcript that are no cue (written by hand, by an old or broken
    writer) used to raise out of the job runner (stopping the worker) and `streamvqa transcript`."""
    r = redis.Redis.from_url(redis_url)
    garbage = [
        {"start": "x", "end": "1", "text": "a"},
        {"end": "2", "text": "b"},
        {"start": "3", "end": "2", "text": "c"},
        {"start": "nan", "end": "1", "text": "d"},
        {"start": "0", "end": "1", "text": b"\xff\xfe"},  # no UTF-8: replaced (then cleaned away), not raised
    ]
    for fields in [*garbage, {"start": "0", "end": "1", "text": "EXIT ONLY"}]:
        r.xadd(keys.transcript("cam1"), fields)
    grid = choose_grid(56, 56, min_pixels=4 * 28 * 28)
    engine = StreamEngine(rt, StreamSpec("cam1", 2.0, grid, 2))
    job = Job(name="subs", stream="cam1", kind="subtitles", every_versions=1, formats=("srt",))
    runner = JobRunner(r, lambda s: engine.head, [job], ["cam1"], lambda v, p: "NO PARKING", str(tmp_path / "subs"))
    for i in range(2):
        engine.append([np.full((56, 56, 3), i, np.uint8)] * 2, [2 + i, 2.5 + i])
        assert runner.run_due() == 1
    runner.flush()
    files = [c.text for c in parse_srt((tmp_path / "subs" / "cam1.srt").read_text())]
    assert files == ["EXIT ONLY", "NO PARKING"]
    argv = ["transcript", "--stream", "cam1", "--format", "srt", "--redis-url", redis_url]
    cli = subprocess.run([sys.executable, "-m", "apps.cli", *argv], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert [c.text for c in parse_srt(cli.stdout)] == files


def test_a_job_run_that_runs_out_of_memory_fails_alone_and_the_next_runs(rt, redis_url):
    """The engine running out of pool or GPU memory in a job's run fails that run (logged, counted),
    as it fails a question: it used to leave the job runner and stop the whole worker."""
    r = redis.Redis.from_url(redis_url)
    grid = choose_grid(56, 56, min_pixels=4 * 28 * 28)
    engine = StreamEngine(rt, StreamSpec("oom", 2.0, grid, 2))
    job = Job(name="cap", stream="oom", kind="caption", every_versions=1)

    def caption(version, prompt: str) -> str:
        if version.id == 1:
            raise PoolFull("the KV pool has no room for 4096 tokens")
        return f"version {version.id}"

    runner = JobRunner(r, lambda s: engine.head, [job], ["oom"], caption, None)
    for i in range(3):
        engine.append([np.full((56, 56, 3), i, np.uint8)] * 2, [i, i + 0.5])
        assert runner.run_due() == 1
    texts = [f[b"text"].decode() for _, f in r.xrange(keys.job_output("oom", "cap"))]
    assert texts == ["version 2", "version 3"]  # the first run (version 1) failed
