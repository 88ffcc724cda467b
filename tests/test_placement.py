"""Several `streamvqa worker` processes share live cameras (issue 11), run as a user would.

Four cameras played live from a generated file, questions asked with redis-cli on `svqa:questions`:
two workers split the streams; every question is answered once, without an error, by the worker
that holds its stream. kill -9 of one: the other takes its streams and the questions that wait for
them. Two more workers start: streams move to them (three workers) and answers stay right. No
frame is ever encoded twice.
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter

import redis
import yaml

from apps.samplevideo import write_sample_video
from apps.status import collect
from common.lease import holder_name
from common.wire import keys
from common.wire.schemas import FinalAnswer, decode_answer
from tests.pipeline import Services, chunk_frames_in_history, head, wait_for

CAMS = ("cam1", "cam2", "cam3", "cam4")
PER_STREAM = 10
GRID_PIXELS = 28 * 28 * 16  # a 112x112 model grid: small chunks, a fast CPU test


def holders(r: redis.Redis) -> dict[str, str | None]:
    return {cam: (holder_name(h) if (h := r.get(keys.lease(cam))) else None) for cam in CAMS}


def spread_over(r: redis.Redis, workers: set[str]) -> dict[str, str | None] | None:
    """The holders once every stream is held, by exactly ``workers``, evenly (loads differ by <= 1)."""
    held = holders(r)
    loads = Counter(held.values())
    ok = None not in loads and set(loads) == workers and max(loads.values()) - min(loads.values()) <= 1
    return held if ok else None


def ask_all(redis_cli: str, url: str, tag: str) -> dict[str, str]:
    """PER_STREAM questions per camera, each with its own redis-cli XADD; question id -> camera."""
    asked = {}
    for i in range(PER_STREAM):
        for cam in CAMS:
            qid = f"{tag}-{cam}-{i}"
            cmd = [redis_cli, "-u", url, "XADD", keys.QUESTIONS, "*", "stream", cam, "id", qid]
            subprocess.run([*cmd, "question", f"What is on screen? ({i})", "max_tokens", "2"], check=True, timeout=10)
            asked[qid] = cam
    return asked


def finals(r: redis.Redis, qid: str) -> list[FinalAnswer]:
    return [a for _, f in r.xrange(keys.answer(qid)) if isinstance(a := decode_answer(f), FinalAnswer)]


def assert_answered_once(r: redis.Redis, asked: dict[str, str], services: Services) -> None:
    wait_for(lambda: all(finals(r, q) for q in asked), 60, "every question answered", services)
    for qid, cam in asked.items():
        (final,) = finals(r, qid)
        assert final.error is None and final.stream == cam and final.tokens, (qid, final)
    audit = Counter(f[b"id"].decode() for _, f in r.xrange(keys.ANSWERS))
    assert all(audit[q] == 1 for q in asked), {q: audit[q] for q in asked if audit[q] != 1}


def test_workers_share_streams_route_questions_fail_over_and_rebalance(redis_url, redis_cli, tmp_path):
    r = redis.Redis.from_url(redis_url)
    video = write_sample_video(str(tmp_path / "clip.mp4"), seconds=180, fps=4, width=160, height=120)
    cameras = tmp_path / "cameras.yaml"
    cams = [dict(name=c, url=video, fps=2, realtime=True, min_pixels=GRID_PIXELS, max_pixels=GRID_PIXELS) for c in CAMS]
    cameras.write_text(yaml.safe_dump({"cameras": cams}))
    env = dict(SVQA_STREAMS=",".join(CAMS), SVQA_LEASE_MS="2000", SVQA_CHUNK_FRAMES="2", SVQA_CLAIM_IDLE_MS="3000")
    services = Services(redis_url, tmp_path, **env)
    try:
        services.start("ingest", "--cameras-file", str(cameras))
        a = services.start("worker", "--consumer", "w-a")
        services.start("worker", "--consumer", "w-b")
        wait_for(lambda: spread_over(r, {"w-a", "w-b"}), 90, "streams split over two workers", services)
        wait_for(lambda: all((h := head(r, c)) and h.last_frame_seq >= 1 for c in CAMS), 60, "a chunk each", services)
        assert_answered_once(r, ask_all(redis_cli, redis_url, "two"), services)

        lost = {cam for cam, w in holders(r).items() if w == "w-a"}
        a.kill()  # kill -9: no release, no goodbye
        a.wait()
        asked_at = time.time()
        waiting = ask_all(redis_cli, redis_url, "failover")
        wait_for(lambda: spread_over(r, {"w-b"}), 30, "the dead worker's streams taken over", services)
        assert_answered_once(r, waiting, services)
        assert lost and all(r.xpending(keys.questions(c), keys.QA_GROUP)["pending"] == 0 for c in lost)
        for cam in lost:  # its questions waited in the stream's queue: asked before the new owner came
            (attached,) = [f for _, f in r.xrange(keys.events(cam)) if f[b"type"] == b"encoder_attached"][-1:]
            assert attached[b"consumer"] == b"w-b" and float(attached[b"at"]) > asked_at

        services.start("worker", "--consumer", "w-c")
        services.start("worker", "--consumer", "w-d")
        wait_for(lambda: spread_over(r, {"w-b", "w-c", "w-d"}), 90, "streams moved to the new workers", services)
        assert_answered_once(r, ask_all(redis_cli, redis_url, "three"), services)

        for cam in CAMS:
            seqs = chunk_frames_in_history(r, cam)
            assert len(seqs) == len(set(seqs)), f"{cam}: a frame encoded twice"
        released = [f for c in CAMS for _, f in r.xrange(keys.events(c)) if f[b"type"] == b"encoder_released"]
        assert len(released) >= 2, "the loaded worker handed streams off"
        found = collect(r)  # what `streamvqa status` shows
        by_worker = {w["worker"]: w for w in found["workers"]}
        assert set(by_worker) == {"w-b", "w-c", "w-d"} and sum(w["load"] for w in by_worker.values()) == len(CAMS)
        for s in found["streams"]:
            assert s["stream"] in by_worker[s["lease"]["holder"]]["streams"]
    finally:
        services.stop_all()
