"""The live pipeline end to end: generated H.264 -> ingest -> encoder -> qa, over a real Redis.

Oracle: the answer a client reads back equals offline one-shot inference over exactly the frames
of the cache version the answer reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import redis
import yaml

from apps.samplevideo import write_sample_video
from common.engine.grid import Grid
from common.engine.model import load_model
from common.engine.offline import offline_answer
from common.engine.runtime import Runtime
from common.lease import holder_name
from common.wire import keys
from common.wire.schemas import FinalAnswer, decode_answer, new_question_id
from ingest.video import iter_file_frames
from qa_worker.client import Client
from tests.pipeline import Services, chunk_frames_in_history, head, manifest_of, manifests, wait_for

FPS = 2.0
CAM = "cam1"


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


@pytest.fixture
def video(tmp_path):
    return write_sample_video(str(tmp_path / "clip.mp4"), seconds=6, fps=10, width=160, height=120)


@pytest.fixture
def services(redis_url, tmp_path):
    s = Services(redis_url, tmp_path, SVQA_STREAMS=CAM)
    yield s
    s.stop_all()


def file_frames(video: str, r: redis.Redis) -> list:
    meta = r.hgetall(keys.meta(CAM))
    grid = Grid(int(meta[b"height"]), int(meta[b"width"]))
    return [f.rgb for f in iter_file_frames(video, FPS, grid=grid)]


def assert_matches_offline(rt: Runtime, r: redis.Redis, video: str, final: FinalAnswer, question: str, n: int):
    assert final.error is None, final.error
    m = manifest_of(r, CAM, final.version)
    frames = file_frames(video, r)[: m.last_frame_seq + 1]
    grid = Grid(*m.grid)
    offline = offline_answer(rt, frames, grid, FPS, question, max_tokens=n)
    assert final.text == offline.text
    assert final.tokens == len(offline.token_ids) > 0


def ingest(services: Services, video: str, *args: str) -> subprocess.Popen:
    return services.start("ingest", "--url", video, "--stream", CAM, "--fps", str(FPS), "--max-backlog", "8", *args)


def test_file_to_answers_with_redis_cli_and_python_client(rt, redis_url, redis_cli, services, video):
    r = redis.Redis.from_url(redis_url)
    services.start("encoder")
    services.start("qa")
    assert ingest(services, video).wait(timeout=120) == 0, services.logs()
    wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq == 11, 120, "all 12 frames encoded", services)

    # a real client that is not ours: redis-cli
    question = "What is written on the screen?"
    qid = new_question_id()
    subprocess.run(
        [
            redis_cli,
            "-u",
            redis_url,
            "XADD",
            keys.QUESTIONS,
            "*",
            "id",
            qid,
            "stream",
            CAM,
            "question",
            question,
            "max_tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    reply = subprocess.run(
        [redis_cli, "-u", redis_url, "--no-raw", "XREAD", "BLOCK", "60000", "STREAMS", keys.answer(qid), "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert reply.stdout.strip(), "redis-cli read no answer"
    final = wait_for(lambda: _final(r, qid), 60, "final answer", services)
    assert_matches_offline(rt, r, video, final, question, 8)
    assert final.t_start == 0.0 and final.t_end == pytest.approx(5.5)

    # our Python client, streaming deltas
    deltas: list[str] = []
    final = Client(r).ask(CAM, "Which shape moves?", on_delta=deltas.append, max_tokens=8)
    assert "".join(deltas) == final.text
    assert_matches_offline(rt, r, video, final, "Which shape moves?", 8)
    audit = [decode_answer(f) for _, f in r.xrange(keys.ANSWERS)]
    assert {a.id for a in audit} >= {qid, final.id}

    # the CLI
    cli = [str(Path(sys.executable).parent / "streamvqa"), "ask", "--redis-url", redis_url, "--stream", CAM]
    out = subprocess.run([*cli, "--max-tokens", "4", "Is it raining?"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stderr.strip().splitlines()[-1])["version"] == head(r, CAM).version
    out = subprocess.run(
        [*cli, "Is the door open?", "--choices", "yes", "no"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    final = json.loads(out.stderr.strip().splitlines()[-1])
    assert out.stdout.strip() in ("yes", "no") and final["choice"] == out.stdout.strip()
    assert set(final["scores"]) == {"yes", "no"}


def test_hostile_input_gets_error_replies_and_workers_survive(redis_url, redis_cli, services, video):
    r = redis.Redis.from_url(redis_url)
    encoder, qa = services.start("encoder"), services.start("qa")
    client = Client(r)
    # before any frame: "no frames yet" is an answer, not a hang
    assert "unknown stream" in client.ask("nope", "anything?", timeout_s=60).error
    early = client.ask(CAM, "anything?", timeout_s=60)
    assert early.error and "no frames yet" in early.error
    # malformed frames on the stream are dead-lettered, the encoder keeps going
    r.xadd(keys.frames(CAM), {"m": b"\xc1 not msgpack"})
    r.xadd(keys.frames(CAM), {"wrong": b"field"})
    assert ingest(services, video).wait(timeout=120) == 0, services.logs()
    wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq == 11, 120, "frames encoded", services)
    dead = r.xrange(keys.DEAD_LETTER)
    assert len(dead) >= 2
    # malformed questions: each gets a final error reply
    bad = {
        "huge": {"stream": CAM, "question": "x" * 100_000},
        "no question": {"stream": CAM},
        "bad max_tokens": {"stream": CAM, "question": "hi", "max_tokens": "many"},
        "bad choices": {"stream": CAM, "question": "hi", "choices": "[1"},
        "bad stream name": {"stream": "a b/c", "question": "hi"},
    }
    for name, fields in bad.items():
        qid = r.xadd(keys.QUESTIONS, fields).decode()
        final = wait_for(lambda q=qid: _final(r, q), 60, f"error reply to {name}", services)
        assert final.error, name
    # and the workers still answer
    alive = client.ask(CAM, "still there?", max_tokens=4, timeout_s=60, reply_ttl=120)
    assert alive.error is None
    pinned = client.ask(CAM, "and at that version?", max_tokens=4, timeout_s=60, at=alive.version)
    assert pinned.error is None and pinned.version == alive.version
    assert "not available" in client.ask(CAM, "long ago?", timeout_s=60, at=10_000).error
    assert 0 < r.ttl(keys.answer(alive.id)) <= 120, "every reply stream expires, per question when asked"
    assert encoder.poll() is None and qa.poll() is None, services.logs()


def test_encoder_kill9_and_restart_encodes_every_frame_once(rt, redis_url, services, video):
    r = redis.Redis.from_url(redis_url)
    encoder = services.start("encoder", "--chunk-frames", "2")
    services.start("qa")
    feeder = ingest(services, video, "--max-backlog", "2")
    wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq >= 3, 120, "a few chunks", services)
    encoder.kill()  # SIGKILL: no cleanup, frames pending, lease still held
    encoder.wait()
    services.start("encoder", "--chunk-frames", "2", "--lease-ms", "3000")
    assert feeder.wait(timeout=180) == 0, services.logs()
    wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq == 11, 180, "the rest after restart", services)
    # every frame of the file in exactly one chunk of the cache's history
    assert chunk_frames_in_history(r, CAM) == list(range(12))
    final = Client(r).ask(CAM, "What happened?", max_tokens=6)
    assert_matches_offline(rt, r, video, final, "What happened?", 6)


def test_qa_kill9_with_question_in_flight_is_answered_exactly_once(rt, redis_url, services, video):
    r = redis.Redis.from_url(redis_url)
    services.start("encoder")
    qa = services.start("qa", "--consumer", "qa-a")
    assert ingest(services, video).wait(timeout=120) == 0, services.logs()
    wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq == 11, 120, "frames encoded", services)
    question = "Tell me everything about the video in great detail."
    reader = Reader(r, question, max_tokens=2048)  # a client reading the deltas all along
    qid = reader.qid
    # the tiny model's whole answer takes under 0.1 s: polled slower, the kill could come after it
    wait_for(lambda: reader.deltas, 60, "the first delta read", services, poll_s=0.002)
    qa.kill()
    qa.wait()
    assert _final(r, qid) is None, "the killed worker had already finished"
    # a different worker takes over the dead one's pending question
    services.start("qa", "--consumer", "qa-b", "--claim-idle-ms", "2000")
    final = reader.result(180)
    # the audit copy follows the final (a step of its own), and the ack follows both
    wait_for(lambda: r.xpending(keys.questions(CAM), keys.QA_GROUP)["pending"] == 0, 30, "the ack", services)
    finals = [f for _, f in r.xrange(keys.answer(qid)) if f[b"type"] == b"final"]
    audit = [f for _, f in r.xrange(keys.ANSWERS) if f[b"id"] == qid.encode()]
    assert len(finals) == 1 and len(audit) == 1
    assert_matches_offline(rt, r, video, final, question, 2048)
    # what the client kept concatenates to exactly the final text: the dead attempt's part is dropped
    assert reader.restarts == [2] and reader.dropped, "the client saw the first attempt and its restart"
    assert "".join(reader.deltas) == final.text


def test_worker_kill9_mid_answer_and_restart_with_questions_queued(redis_url, tmp_path, video):
    """`streamvqa worker` killed (-9) while it streams an answer and a new one started while
    questions wait: the `streamvqa ask` reading that answer ends with exactly the final text after
    its restart notice (the dead attempt's text is not shown again as part of it), and every queued
    question is answered from the restored stream — none gets "no frames yet" because the new
    worker answered before it had reopened the stream (its predecessor's lease still held)."""
    r = redis.Redis.from_url(redis_url)
    services = Services(redis_url, tmp_path, SVQA_STREAMS=CAM, SVQA_LEASE_MS="8000", SVQA_CLAIM_IDLE_MS="2000")
    try:
        worker = services.start("worker", "--consumer", "worker-a")
        assert ingest(services, video).wait(timeout=120) == 0, services.logs()
        wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq == 11, 120, "all 12 frames encoded", services)
        cli = [str(Path(sys.executable).parent / "streamvqa"), "ask", "--redis-url", redis_url, "--stream", CAM]
        ask = subprocess.Popen(
            [*cli, "--max-tokens", "2048", "--timeout", "240", "Describe every detail."],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        (answer,) = wait_for(lambda: list(r.scan_iter(keys.answer("*"))), 60, "the answer stream", services)
        wait_for(lambda: r.xlen(answer) > 2, 60, "a few deltas", services)
        worker.kill()
        worker.wait()
        qid = answer.decode().removeprefix(keys.answer(""))
        assert _final(r, qid) is None, "the killed worker had already finished"
        queued = [Client(r).submit(CAM, f"Question {i}?", max_tokens=4) for i in range(8)]  # no worker running
        services.start("worker", "--consumer", "worker-b")

        out, err = ask.communicate(timeout=240)
        assert ask.returncode == 0, err.decode()
        final = _final(r, qid)
        printed = out.decode()
        assert b"answer restarted from the beginning" in err, err.decode()
        assert printed.endswith("\n" + final.text + "\n"), "stdout ends with the whole answer, once"
        dead_attempt = printed[: -len(final.text) - 2]
        assert dead_attempt, "the client showed the dead attempt's text before the restart notice"
        for q in queued:
            got = wait_for(lambda q=q: _final(r, q), 120, "a queued question's answer", services)
            assert got.error is None, got.error
            assert got.version == head(r, CAM).version
    finally:
        services.stop_all()


class Reader:
    """A client in a thread asking one question and keeping deltas as the protocol says (the
    highest attempt's only): ``dropped`` holds what it had of earlier attempts."""

    def __init__(self, r: redis.Redis, question: str, **options):
        self.r, self.deltas, self.dropped, self.restarts = r, [], [], []
        self.qid = uuid.uuid4().hex
        self.box: dict = {}
        options = {**options, "id": self.qid}
        self.thread = threading.Thread(target=self._ask, args=(question, options), daemon=True)
        self.thread.start()

    def _ask(self, question: str, options: dict) -> None:
        try:
            self.box["final"] = Client(self.r).ask(
                CAM, question, on_delta=self.deltas.append, on_restart=self._restart, timeout_s=240, **options
            )
        except Exception as e:  # re-raised by result()
            self.box["error"] = e

    def _restart(self, attempt: int) -> None:
        self.restarts.append(attempt)
        self.dropped += self.deltas
        self.deltas.clear()

    def result(self, timeout_s: float) -> FinalAnswer:
        self.thread.join(timeout_s)
        if "error" in self.box:
            raise self.box["error"]
        assert "final" in self.box, "no final answer"
        return self.box["final"]


def _final(r: redis.Redis, qid: str) -> FinalAnswer | None:
    for _, fields in r.xrange(keys.answer(qid)):
        reply = decode_answer(fields)
        if isinstance(reply, FinalAnswer):
            return reply
    return None


def test_two_encoders_share_two_streams_through_leases_without_double_writes(redis_url, tmp_path, video):
    r = redis.Redis.from_url(redis_url)
    services = Services(redis_url, tmp_path, SVQA_STREAMS="cam1,cam2")
    try:
        services.start("encoder", "--consumer", "enc-a")
        services.start("encoder", "--consumer", "enc-b")
        cameras = tmp_path / "cameras.yaml"  # one ingest process serving both sources
        sources = [{"name": cam, "url": video, "fps": FPS} for cam in ("cam1", "cam2")]
        cameras.write_text(yaml.safe_dump({"cameras": sources}))
        feeder = services.start("ingest", "--cameras-file", str(cameras), "--max-backlog", "4")
        assert feeder.wait(timeout=180) == 0, services.logs()
        for cam in ("cam1", "cam2"):
            wait_for(lambda c=cam: (h := head(r, c)) and h.last_frame_seq == 11, 180, f"{cam} encoded", services)
            history = manifests(r, cam)
            ids = [m.version for m in history]
            assert ids == sorted(set(ids)), f"{cam}: versions written twice or out of order: {ids}"
            assert chunk_frames_in_history(r, cam) == list(range(12))
        # A stream being handed off (enc-a took both before enc-b's first beat) is free for up to
        # a lease check until the other worker takes it: every stream held again is what must hold.
        wait_for(
            lambda: {holder_name(r.get(keys.lease(cam)) or b"") for cam in ("cam1", "cam2")} <= {"enc-a", "enc-b"},
            30,
            "both streams held by the two encoders",
            services,
        )
    finally:
        services.stop_all()


def test_live_stream_behind_real_time_drops_frames_and_says_so_while_a_file_waits(redis_url, tmp_path, video):
    r = redis.Redis.from_url(redis_url)
    services = Services(redis_url, tmp_path, SVQA_STREAMS="live,file", SVQA_MAX_LAG_S="0.000001")
    try:
        services.start("encoder")
        live = services.start("ingest", "--url", video, "--stream", "live", "--fps", "2", "--realtime", "true")
        file = services.start("ingest", "--url", video, "--stream", "file", "--fps", "2", "--max-backlog", "4")
        assert live.wait(timeout=120) == 0 and file.wait(timeout=120) == 0, services.logs()
        wait_for(lambda: (h := head(r, "file")) and h.last_frame_seq == 11, 120, "the file encoded", services)
        assert chunk_frames_in_history(r, "file") == list(range(12)), "files wait: nothing dropped"
        wait_for(lambda: r.xinfo_groups(keys.frames("live"))[0]["pending"] == 0, 60, "live frames handled", services)
        dropped = [f for _, f in r.xrange(keys.events("live")) if f[b"type"] == b"dropped"]
        assert dropped and dropped[0][b"reason"] == b"late"
        assert chunk_frames_in_history(r, "live") == [], "every live frame was late: none encoded"
    finally:
        services.stop_all()


def test_services_ride_out_a_redis_restart(redis_server, tmp_path):
    """Redis restarts empty (no persistence) while a live source streams: ingest, encoder and qa keep
    running, reconnect, rebuild their groups and leases, and answer about the video after it."""
    url = redis_server.url
    r = redis.Redis.from_url(url)
    video = write_sample_video(str(tmp_path / "long.mp4"), seconds=20, fps=10, width=160, height=120)
    services = Services(url, tmp_path, SVQA_STREAMS=CAM, SVQA_LEASE_MS="3000", SVQA_CLAIM_IDLE_MS="2000")
    try:
        live = ("--url", video, "--stream", CAM, "--fps", "2", "--realtime", "true")
        procs = [services.start("encoder"), services.start("qa"), services.start("ingest", *live)]
        wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq >= 5, 60, "frames before the restart", services)
        redis_server.restart()  # comes back empty
        r = redis.Redis.from_url(url)
        wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq >= 15, 60, "frames after the restart", services)
        final = Client(r).ask(CAM, "What now?", max_tokens=4, timeout_s=60)
        assert final.error is None and final.t_end > 7.0
        assert all(p.poll() is None for p in procs), services.logs()
    finally:
        services.stop_all()
