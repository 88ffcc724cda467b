"""The API's Redis connections: a restart of Redis, many streamed answers at once, and a busy API.

Real redis-server; the worker is played by a thread that writes answer entries the way workers do.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

import httpx
import redis

from api.app import create_app
from api.config import ApiConfig
from common import redisio
from common.wire import keys
from common.wire.schemas import FinalAnswer, encode_delta, encode_final
from qa_worker.routing import forward
from tests.conftest import RedisServer, free_port
from tests.pipeline import Services, wait_for
from tests.test_api import REPO, _parse_sse, assert_error, served

GHOST = {"fps": "2", "height": "56", "width": "56", "live": "0"}
ME = "test-observer"  # this test's own connections, left out of the API's count


def _api(cfg: ApiConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(cfg)), base_url="http://api", timeout=30)


def _answer_all(r: redis.Redis, count: int, seen: list[int]) -> None:
    """Once ``count`` questions are queued, note the API's connections to Redis in ``seen``, then
    answer each with two deltas and a final."""
    wait_for(lambda: r.xlen(keys.QUESTIONS) >= count, 30, f"{count} questions")
    seen.append(sum(1 for c in r.client_list() if c["name"] != ME))
    for _, fields in r.xrange(keys.QUESTIONS):
        qid = fields[b"id"].decode()
        r.xadd(keys.answer(qid), encode_delta("It is "))
        r.xadd(keys.answer(qid), encode_delta(qid[:6]))
        r.xadd(keys.answer(qid), encode_final(FinalAnswer(id=qid, stream="ghost", text=f"It is {qid[:6]}", tokens=2)))


def _observer(url: str) -> redis.Redis:
    r = redis.Redis.from_url(url, client_name=ME)
    r.hset(keys.meta("ghost"), mapping=GHOST)
    return r


def test_the_next_requests_after_a_redis_restart_succeed(redis_server):
    """Redis restarts under a running API: its pooled connections and its answer reader's are
    stale. The next status request and the next streamed answer succeed (were 503 "redis unreachable")."""
    r = _observer(redis_server.url)

    async def run() -> tuple[list[httpx.Response], list]:
        async with _api(ApiConfig(redis_url=redis_server.url, answer_timeout_s=20, block_ms=200)) as client:
            seen: list[int] = []
            worker = threading.Thread(target=_answer_all, args=(r, 1, seen), daemon=True)
            worker.start()
            await client.post("/api/streams/ghost/ask", json={"question": "before"})  # the reader connects
            worker.join(10)
            redis_server.stop()
            redis_server.start()
            _observer(redis_server.url)
            statuses = [await client.get(p) for p in ("/api/streams/ghost", "/api/streams", "/v1/models")]
            worker = threading.Thread(target=_answer_all, args=(_observer(redis_server.url), 1, seen), daemon=True)
            worker.start()
            after = await client.post("/api/streams/ghost/ask", json={"question": "after"})
            worker.join(10)
            return statuses, _parse_sse(after.text)

    statuses, events = asyncio.run(run())
    assert [s.status_code for s in statuses] == [200, 200, 200], [s.text for s in statuses]
    assert events[-1][0] == "final" and events[-1][1]["text"].startswith("It is "), events


def test_many_streamed_answers_share_a_few_redis_connections(redis_server):
    """40 streamed answers at once from an API allowed 4 pooled connections and 2 answer readers:
    every one gets its own deltas and final, while the API holds at most 6 connections to Redis
    (each answer held a pooled connection in XREAD BLOCK: past the pool's size, 503s). A Redis of
    its own: the session's holds whatever clients earlier tests left open, and those would count."""
    url = redis_server.url
    n, cfg = 40, ApiConfig(redis_url=url, redis_max_connections=4, answer_readers=2, answer_timeout_s=30)
    r = _observer(url)
    seen: list[int] = []

    async def run() -> list[tuple[str, list]]:
        async with _api(cfg) as client:

            async def ask(i: int) -> tuple[str, list]:
                response = await client.post("/api/streams/ghost/ask", json={"question": f"q{i}"})
                return response.headers["x-question-id"], _parse_sse(response.text)

            return await asyncio.gather(*(ask(i) for i in range(n)))

    worker = threading.Thread(target=_answer_all, args=(r, n, seen), daemon=True)
    worker.start()
    answers = asyncio.run(run())
    worker.join(10)
    for qid, events in answers:
        assert [k for k, _ in events] == ["delta", "delta", "final"], events
        assert "".join(d["text"] for _, d in events[:2]) == events[-1][1]["text"] == f"It is {qid[:6]}"
    assert seen and seen[0] <= cfg.redis_max_connections + cfg.answer_readers, seen


def test_a_busy_api_says_so_with_retry_after_and_queues_nothing(redis_url):
    """Past max_answers, or with every pooled connection taken for 2 s: 503, code "busy", a
    Retry-After, and the reason in words (was "redis unreachable: MaxConnectionsError")."""
    r = _observer(redis_url)
    cfg = ApiConfig(redis_url=redis_url, max_answers=2, redis_max_connections=1, answer_timeout_s=5, block_ms=200)

    async def run() -> tuple[httpx.Response, httpx.Response]:
        app = create_app(cfg)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            waiting = [asyncio.create_task(client.post("/api/streams/ghost/ask", json={"question": "x"})) for _ in "ab"]
            await asyncio.to_thread(wait_for, lambda: r.xlen(keys.QUESTIONS) == 2, 10, "two questions")
            third = await client.post("/api/streams/ghost/ask", json={"question": "x", "stream": False})
            for task in waiting:
                task.cancel()
            held = await app.state.r.connection_pool.get_connection()  # the only pooled connection
            try:
                pooled = await client.get("/api/streams")
            finally:
                await app.state.r.connection_pool.release(held)
            return third, pooled

    third, pooled = asyncio.run(run())
    for response, why in ((third, "max_answers"), (pooled, "redis_max_connections")):
        error = assert_error(response, 503, code="busy")
        assert response.headers["retry-after"] == "1" and why in error["message"], error
    assert r.xlen(keys.QUESTIONS) == 2, "the refused question was not queued"


def test_the_api_serves_with_redis_down_says_so_and_exits_3_past_its_grace(tmp_path):
    """`streamvqa api --redis-grace-s 6 --metrics-port P` with no Redis yet: one line says so and
    /health/live answers at once (was 30 s of silence, then exit 3); Redis comes and it is ready
    and serves its metrics; Redis goes for good and it exits 3 with one line."""
    port, metrics_port = free_port(), free_port()
    server = RedisServer(tmp_path / "redis")
    (tmp_path / "redis").mkdir()
    services = Services(server.url, tmp_path)
    proc = services.start("api", "--port", str(port), "--metrics-port", str(metrics_port), "--redis-grace-s", "6")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _status(base + "/health/live") == 200, 30, "/health/live", services)
        assert _status(base + "/health/ready") == 503
        assert services.logs().count("redis unreachable at start") == 1, services.logs()
        server.start()
        wait_for(lambda: _status(base + "/health/ready") == 200, 30, "ready once Redis is up", services)
        scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert "svqa_api_answers_in_flight" in scraped and "svqa_api_busy_total" in scraped
        server.stop()
        assert proc.wait(timeout=60) == 3, services.logs()
        assert "redis unreachable past redis_grace_s" in services.logs()
    finally:
        services.stop_all()
        server.stop()


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return None


def test_a_streamed_answer_reports_its_place_in_the_queue_while_it_waits(redis_url):
    """Two questions wait ahead in the stream's queue: the SSE stream says `queued` with position
    3 (the page showed nothing but a cursor for as long as the wait lasted), then, once a worker
    has taken them all, the answer as usual."""
    r = _observer(redis_url)
    queue = keys.questions("ghost")
    redisio.ensure_group(r, queue, keys.QA_GROUP)
    for n in (1, 2):
        forward(r, "ghost", f"ahead-{n}", {b"stream": b"ghost", b"question": b"first?"}, ttl_s=60)

    def route() -> None:  # what the forwarder does with the API's question
        (entry_id, fields), *_ = wait_for(lambda: r.xrange(keys.QUESTIONS), 10, "the question")
        forward(r, "ghost", fields[b"id"].decode(), fields, 60, asked=entry_id.decode())

    threading.Thread(target=route, daemon=True).start()
    events = []
    cfg = ApiConfig(redis_url=redis_url, block_ms=100, answer_timeout_s=30)
    with served(cfg) as base, httpx.stream("POST", base + "/api/streams/ghost/ask", json={"question": "?"}) as response:
        qid, name = response.headers["x-question-id"], ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
                if name == "queued" and len(events) == 1:  # a worker takes all three, answers mine
                    r.xreadgroup(keys.QA_GROUP, "w", {queue: ">"}, count=10)
                    r.xadd(keys.answer(qid), encode_final(FinalAnswer(id=qid, stream="ghost", text="yes")))
    assert events[0][0] == "queued" and events[0][1]["position"] == 3, events
    assert events[-1][0] == "final" and events[-1][1]["text"] == "yes", events


def test_the_sse_benchmark_runs_and_reports_its_figures():
    """scripts/bench_api_sse.py, small: every answer held and completed, the connections counted."""
    argv = [sys.executable, "scripts/bench_api_sse.py", "--answers", "8", "--port", str(free_port())]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert found["held_at_once"] == found["completed"] == 8 and found["refused"] == 0, found
    assert 1 <= found["api_redis_connections"] <= 32 + 2 and found["final_latency"]["max_ms"] >= 0, found
