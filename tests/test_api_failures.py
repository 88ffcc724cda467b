"""The HTTP API when something beneath it fails or a value is out of range: a JSON error with a
status and a code that say what happened, never a 500 of plain text (found by probing, each a
500 or a silent acceptance before)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import types
from pathlib import Path

import httpx
import pytest
import redis

from api.app import connect, create_app
from api.config import ApiConfig
from api.service import _outlast
from common.version import VERSION
from common.wire import keys
from tests.conftest import free_port
from tests.pipeline import Services, wait_for

CHAT = {"model": "cam1", "messages": [{"role": "user", "content": "what happened?"}]}


def requests(cfg: ApiConfig, *calls: tuple[str, str, dict]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        app = create_app(cfg)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://api") as c:
            return [await c.request(method, path, **kw) for method, path, kw in calls]

    return asyncio.run(go())


def error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status and resp.headers["content-type"].startswith("application/json"), (
        resp.status_code,
        resp.text,
    )
    return resp.json()["error"]


def camera(redis_url: str) -> redis.Redis:
    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("cam1"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})
    return r


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"top_p": -1}, "top_p"), ({"max_completion_tokens": 0}, "max_completion_tokens")],
)
def test_an_openai_parameter_out_of_range_is_a_400_naming_it_as_sent(redis_url, extra, param):
    """top_p -1 was raised to the least top_p, max_completion_tokens 0 read as unset (128), both queued."""
    r = camera(redis_url)
    cfg = ApiConfig(redis_url=redis_url, answer_timeout_s=0.3)
    (resp,) = requests(cfg, ("POST", "/v1/chat/completions", {"json": CHAT | extra}))
    assert error(resp, 400)["param"] == param
    assert r.xlen(keys.QUESTIONS) == 0


def test_a_command_redis_refuses_is_a_503_saying_so(redis_url):
    """A stream at its last possible id (or a user without a permission the API needs): every XADD
    is refused; a 500 of plain text before."""
    r = camera(redis_url)
    r.xadd(keys.QUESTIONS, {"stream": "cam1", "question": "x"}, id="18446744073709551615-18446744073709551615")
    cfg = ApiConfig(redis_url=redis_url, answer_timeout_s=0.3)
    asked = ("POST", "/api/streams/cam1/ask", {"json": {"question": "x", "stream": False}})
    chat, search = ("POST", "/v1/chat/completions", {"json": CHAT}), ("GET", "/api/search", {"params": {"q": "van"}})
    for resp in requests(cfg, asked, chat, search):
        assert error(resp, 503)["code"] == "redis_refused"


def test_a_full_redis_is_a_503_saying_it_refused_not_that_it_is_unreachable(redis_url):
    """OOM (maxmemory, noeviction) is an outage to the services (waited out), but Redis is there:
    the API says it refused, as for any refusal."""
    r = camera(redis_url)
    r.config_set("maxmemory", "1")
    try:
        cfg = ApiConfig(redis_url=redis_url, answer_timeout_s=0.3)
        (resp,) = requests(cfg, ("POST", "/api/streams/cam1/ask", {"json": {"question": "x", "stream": False}}))
        assert error(resp, 503)["code"] == "redis_refused"
    finally:
        r.config_set("maxmemory", "0")


def test_a_user_the_api_may_not_be_is_not_ready(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.acl_setuser("pingonly", enabled=True, passwords=["+pw"], keys=["*"], commands=["+ping"])
    try:
        cfg = ApiConfig(redis_url=redis_url.replace("redis://", "redis://pingonly:pw@"))
        (ready,) = requests(cfg, ("GET", "/health/ready?stream=cam1", {}))
    finally:
        r.acl_deluser("pingonly")
    assert error(ready, 503)["code"] == "redis_refused"


def test_ready_for_a_stream_no_encoder_holds_says_that_not_redis_unreachable(redis_url):
    (ready,) = requests(ApiConfig(redis_url=redis_url), ("GET", "/health/ready?stream=cam1", {}))
    assert error(ready, 503)["code"] == "no_encoder"


def test_a_cluster_that_is_away_is_a_503_and_past_the_grace_the_api_ends():
    """A cluster client that cannot connect raises RedisClusterException, which neither the error
    handlers nor the grace watcher knew: a 500 on every route, and an API that never exited 3."""
    cfg = ApiConfig(redis_url=f"redis+cluster://127.0.0.1:{free_port()}/0", redis_grace_s=0.5)
    for resp in requests(cfg, *(("GET", path, {}) for path in ("/health/ready", "/api/streams", "/v1/models"))):
        error(resp, 503)
    server = types.SimpleNamespace(should_exit=False)

    async def outlast() -> bool:
        return await asyncio.wait_for(_outlast(server, connect(cfg), cfg.redis_grace_s), 10)

    assert asyncio.run(outlast()) is True and server.should_exit


def test_a_frames_log_that_cannot_be_read_is_a_503_saying_so(redis_url, tmp_path: Path):
    not_a_dir = tmp_path / "frames"
    not_a_dir.write_text("a file where the frames log's directory should be")
    cfg = ApiConfig(redis_url=redis_url, framelog_dir=str(not_a_dir))
    for resp in requests(cfg, ("GET", "/api/streams/cam1/snapshot", {}), ("GET", "/api/streams/cam1/clip?from=0", {})):
        assert error(resp, 503)["code"] == "frames_log_unreadable"


def test_outputs_of_a_job_that_never_wrote_are_a_404_not_an_empty_200(redis_url):
    """A job name the stream has no outputs of (a typo, another stream's job) was 200 with no
    outputs, which reads as "nothing yet"; a job that wrote answers 200 with them."""
    r = camera(redis_url)
    r.xadd(keys.job_output("cam1", "captions"), {"job": "captions", "version": "3", "text": "a van"})
    cfg = ApiConfig(redis_url=redis_url)
    known, unknown = requests(
        cfg, ("GET", "/api/streams/cam1/jobs/captions", {}), ("GET", "/api/streams/cam1/jobs/nope", {})
    )
    assert known.status_code == 200 and [o["text"] for o in known.json()["outputs"]] == ["a van"]
    missing = error(unknown, 404)
    assert (missing["param"], missing["code"]) == ("job", "job_not_found") and "'nope'" in missing["message"]


def test_the_apis_health_answers_in_the_services_shape(redis_url):
    """/health/live and /health/ready of the API read as every service's (common/health.py):
    `live`; `ready`, `checks`, `leases`, and `reasons` when not ready. The API answered
    {"status": "ok"} and {"status": "ready", "redis": true}, and a bare error when not ready."""
    from common import health

    r = camera(redis_url)
    _, service = health.Readiness(redis_url=redis_url).check()
    cfg = ApiConfig(redis_url=redis_url)
    live, ready, unheld = requests(
        cfg, ("GET", "/health/live", {}), ("GET", "/health/ready", {}), ("GET", "/health/ready?stream=cam1", {})
    )
    assert live.status_code == 200 and live.json() == health.LIVE
    assert ready.status_code == 200 and ready.json() == service == {
        "ready": True,
        "checks": {"redis": True},
        "leases": [],
    }
    assert error(unheld, 503)["code"] == "no_encoder", "the error object stays, for the clients that read it"
    body = unheld.json()
    assert (body["ready"], body["checks"], body["leases"]) == (False, {"redis": True, "encoder": False}, [])
    assert body["reasons"] == {"encoder": "no encoder holds stream 'cam1'"}
    r.set(keys.lease("cam1"), "enc-1")
    (held,) = requests(cfg, ("GET", "/health/ready?stream=cam1", {}))
    assert held.status_code == 200 and held.json() == {
        "ready": True,
        "checks": {"redis": True, "encoder": True},
        "leases": [],
        "stream": "cam1",
        "encoder": "enc-1",
    }


def test_the_api_starts_with_the_starting_line_every_service_writes(redis_url, tmp_path: Path):
    """Its first line was `api starting` (host, port, auth): no version and no settings, unlike
    every other service's `starting` line (README "Logs"). The token is `***` there, never itself."""
    token = "t0ken-never-logged-1234"
    services = Services(redis_url, tmp_path)
    port = free_port()
    services.start("api", "--port", str(port), "--framelog-dir", str(tmp_path), SVQA_API_TOKEN=token)
    try:
        wait_for(lambda: '"starting"' in services.logs(), 30, "the starting line", services)
    finally:
        services.stop_all()
    line = next(json.loads(s) for s in services.logs().splitlines() if '"starting"' in s)
    assert line["service"] == "streamvqa api" and line["version"] == VERSION, line
    assert line["port"] == port and line["auth"] is True, line
    assert line["settings"]["framelog_dir"] == str(tmp_path) and line["settings"]["token"] == "***", line
    assert token not in services.logs()


def test_a_port_in_use_is_exit_2_and_one_line(redis_url):
    """uvicorn logged "Application startup complete", then the bind error, and exited 3: the code
    of Redis unusable (README "Start-up"), for a port another process held."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "apps.cli", "api", "--port", str(port), "--redis-url", redis_url],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    line = json.loads(lines[0])
    assert line["event"] == "api address unusable" and line["port"] == port and "in use" in line["error"], line
