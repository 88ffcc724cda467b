"""The whole pipeline on a real 3-master Redis Cluster: ingest of a generated video, `streamvqa worker`
(tiny-random, CPU) with a periodic job and the Redis segment store, questions from redis-cli -c,
`ask`, `status`, `transcript`; the worker is killed -9 and another takes over, and the stream's slot
moves to another master while frames and questions flow. Nothing is lost: every frame is in exactly
one chunk, every question has exactly one final answer and one audit entry."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import redis
import yaml

from apps.samplevideo import write_sample_video
from common import redisio
from common.lease import holder_name
from common.wire import keys
from common.wire.schemas import FinalAnswer, decode_answer, new_question_id
from tests.conftest import RedisClusterServers
from tests.pipeline import Services, audited, chunk_frames_in_history, head, wait_for

# 22 s of live video: a worker's start, its kill and another's takeover fit well inside it on a
# loaded machine (at 14 s, a busy 2-core machine once saw every frame encoded before the move)
CAM, FPS, SECONDS = "cam1", 2, 22
FRAMES = FPS * SECONDS
CLI = [sys.executable, "-m", "apps.cli"]  # this checkout's code, as the services run


def ask_with_redis_cli(cluster: RedisClusterServers, redis_cli: str, question: str, max_tokens: int) -> str:
    """XADD a question the way a shell user does: redis-cli -c follows the cluster's redirections."""
    port, qid = str(cluster.nodes[-1].port), new_question_id()
    args = ["XADD", keys.QUESTIONS, "*", "id", qid, "stream", CAM, "question", question, "max_tokens", str(max_tokens)]
    subprocess.run([redis_cli, "-c", "-p", port, *args], capture_output=True, text=True, check=True)
    return qid


def finals(r: redis.Redis, qid: str) -> list[FinalAnswer]:
    return [a for _, f in r.xrange(keys.answer(qid)) if isinstance(a := decode_answer(f), FinalAnswer)]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_pipeline_on_a_cluster_survives_a_kill9_and_a_slot_moving(redis_cluster, redis_cli, tmp_path):
    url = redis_cluster.url
    r = redisio.connect(url)
    video = write_sample_video(str(tmp_path / "v.mp4"), seconds=SECONDS, fps=10, width=160, height=120)
    cameras = tmp_path / "cameras.yaml"
    job = {"name": "cap", "stream": CAM, "kind": "caption", "every_versions": 1}
    subs = {"name": "subs", "stream": CAM, "kind": "subtitles", "every_versions": 2}
    # Frames come at capture pace (a live camera), so the run lasts long enough to kill a worker and
    # move a slot in it; none is late enough to be dropped (max_lag_s) while the worker is away.
    camera = {"name": CAM, "url": video, "fps": FPS, "realtime": True}
    cameras.write_text(yaml.safe_dump({"cameras": [camera], "jobs": [job, subs]}))
    env = dict(SVQA_CAMERAS_FILE=str(cameras), SVQA_SEGMENT_STORE=url, SVQA_LEASE_MS="2000", SVQA_MAX_LAG_S="60")
    services = Services(url, tmp_path, SVQA_CLAIM_IDLE_MS="2000", **env)
    try:
        first = services.start("worker", "--consumer", "worker-a")
        feeder = services.start("ingest", "--max-backlog", "6")
        wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq >= 7, 120, "two chunks", services)
        # a job run is a 128-token answer after each version: minutes on a loaded 2-core machine
        wait_for(lambda: r.xlen(keys.job_output(CAM, "cap")) >= 1, 300, "a periodic job's output", services)
        qids = [ask_with_redis_cli(redis_cluster, redis_cli, f"What is shown? ({i})", 256) for i in range(4)]
        wait_for(lambda: any(r.xlen(keys.answer(q)) for q in qids), 60, "answering under way", services)
        first.send_signal(signal.SIGKILL)  # no cleanup: lease held, frames and questions pending
        first.wait()
        qids += [ask_with_redis_cli(redis_cluster, redis_cli, f"And now? ({i})", 8) for i in range(3)]
        second = services.start("worker", "--consumer", "worker-b")
        wait_for(
            lambda: holder_name(r.get(keys.lease(CAM)) or b"") == "worker-b", 60, "the stream taken over", services
        )

        # The stream's slot moves to another master while frames and questions keep coming.
        seq_before_move = head(r, CAM).last_frame_seq
        slot = r.keyslot(keys.frames(CAM))
        owner = redis_cluster.owner(slot)
        mover = threading.Thread(target=redis_cluster.move_slot, args=(slot,), kwargs=dict(batch=3, pause_s=0.2))
        mover.start()
        qids += [ask_with_redis_cli(redis_cluster, redis_cli, f"During the move? ({i})", 8) for i in range(3)]
        mover.join(timeout=60)
        assert redis_cluster.owner(slot) is not owner

        assert feeder.wait(timeout=180) == 0, services.logs()
        wait_for(lambda: head(r, CAM).last_frame_seq == FRAMES - 1, 180, "every frame encoded", services)
        assert seq_before_move < FRAMES - 1, "the slot moved while frames were still being encoded"
        assert chunk_frames_in_history(r, CAM) == list(range(FRAMES)), "a frame lost or encoded twice"
        wait_for(lambda: all(finals(r, q) for q in qids), 120, "every question answered", services)
        wait_for(lambda: set(qids) <= set(audited(r)), 60, "every final's audit copy (written after it)", services)
        audit = audited(r)
        for q in qids:
            (final,) = finals(r, q)
            assert final.error is None and audit.count(q) == 1, (final, audit.count(q))

        ask = run_cli("ask", "--redis-url", url, "--stream", CAM, "--max-tokens", "4", "What is there?")
        assert ask.returncode == 0, ask.stderr
        assert json.loads(ask.stderr.strip().splitlines()[-1])["version"] == head(r, CAM).version
        status = run_cli("status", "--redis-url", url, "--json")
        assert status.returncode == 0, status.stderr
        (cam,) = json.loads(status.stdout)["streams"]
        assert cam["stream"] == CAM and cam["head"]["last_frame_seq"] == FRAMES - 1
        assert cam["lease"]["holder"] == "worker-b" and cam["frames"]["length"] > 0
        transcript = run_cli("transcript", "--redis-url", url, "--stream", CAM, "--format", "json")
        assert transcript.returncode == 0, transcript.stderr
        assert len(json.loads(transcript.stdout)) == r.xlen(keys.transcript(CAM))
        assert r.xlen(keys.job_output(CAM, "cap")) >= 2
        assert r.xlen(keys.DEAD_LETTER) == 0 and second.poll() is None, services.logs()
    finally:
        services.stop_all()
