"""`streamvqa api`: serve the HTTP API and the web page (uvicorn).

It serves at once, Redis or not: `/health/live` answers while Redis is away, and requests get 503
until it is back. Redis unreachable for `redis_grace_s` (at start too) ends it with exit 3 and one
line, as the other services do, so an orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import redis.asyncio as aredis
import structlog
import uvicorn
from fastapi import FastAPI

from api.answers import Busy
from api.app import create_app
from api.config import ApiConfig
from common import boot, redisio
from common.logs import redact_url
from common.version import VERSION

log = structlog.get_logger()

PROBE_S = 1.0  # Redis is pinged this often (and a start-up probe waits this long for it)


def warn_if_exposed(cfg: ApiConfig) -> None:
    if cfg.exposed_without_token:
        message = (
            f"THE API LISTENS ON {cfg.host}:{cfg.port} WITHOUT AUTHENTICATION: anyone who reaches this port can "
            "ask every camera and read its transcript. Set SVQA_API_TOKEN (or --token), or listen on 127.0.0.1."
        )
        print(f"\n{'!' * 100}\n{message}\n{'!' * 100}\n", file=sys.stderr, flush=True)
        log.warning("no authentication on a non-loopback address", host=cfg.host, port=cfg.port)


def main(argv: list[str]) -> int:
    prog = "streamvqa api"
    cfg = boot.configure(ApiConfig, argv, prog)  # exit 2 on bad settings
    boot.serve_metrics(cfg, prog)  # exit 2 when metrics_port is taken
    problem = redisio.ping_problem(cfg.redis_url, PROBE_S)
    if problem is not None:
        log.warning(
            "redis unreachable at start: serving /health/live, other requests get 503 until it answers",
            redis=redact_url(cfg.redis_url),
            grace_s=cfg.redis_grace_s,
            error=problem,
        )
    check_listen(cfg, prog)  # exit 2 when host:port cannot be listened on
    warn_if_exposed(cfg)
    # the `starting` line every service writes (README "Logs"): version and the settings changed
    log.info(
        "starting",
        service=prog,
        version=VERSION,
        host=cfg.host,
        port=cfg.port,
        auth=cfg.token is not None,
        **boot.startup_fields(cfg),
    )
    return serve(create_app(cfg), cfg)


def check_listen(cfg: ApiConfig, prog: str) -> None:
    """Exit 2 with one line when the API's address cannot be listened on (a port in use, an
    address not this host's), as for a `metrics_port` in use. Left to uvicorn it logged
    "Application startup complete", then the error, and exited 3, the code of Redis unusable."""
    try:
        family, *_, where = socket.getaddrinfo(cfg.host, cfg.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        socket.create_server(where[:2], family=family).close()  # SO_REUSEADDR, as uvicorn's own
    except OSError as e:
        boot.fail(boot.EXIT_CONFIG, "api address unusable", service=prog, host=cfg.host, port=cfg.port, error=str(e))


def serve(app: FastAPI, cfg: ApiConfig) -> int:
    """Run uvicorn until stopped (0), or until Redis has been away for redis_grace_s (3)."""
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None, timeout_graceful_shutdown=5)
    return asyncio.run(_serve(uvicorn.Server(config), app.state.r, cfg.redis_grace_s))


async def _serve(server: uvicorn.Server, r: aredis.Redis, grace_s: float) -> int:
    watch = asyncio.create_task(_outlast(server, r, grace_s))
    await server.serve()
    gone = watch.done() and watch.result()
    watch.cancel()
    return boot.EXIT_REDIS if gone else 0


async def _outlast(server: uvicorn.Server, r: aredis.Redis, grace_s: float) -> bool:
    """Ping Redis every PROBE_S; once it has not answered for grace_s, stop the server: True."""
    down_since: float | None = None
    while True:
        try:
            await r.ping()
            down_since = None
        except redisio.PROBE_ERRORS as e:  # a cluster client raises RedisClusterException while none answers
            down_since = down_since or time.monotonic()
            if time.monotonic() - down_since >= grace_s:
                log.error(
                    "redis unreachable past redis_grace_s", exit_code=boot.EXIT_REDIS, grace_s=grace_s, error=str(e)
                )
                server.should_exit = True
                return True
        except Busy:  # every pooled connection in use: Redis answers them
            down_since = None
        await asyncio.sleep(min(PROBE_S, grace_s / 4))
