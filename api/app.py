"""The FastAPI application: routes, errors, limits, the web page and health probes.

Stateless: everything it shows or asks goes through Redis, so any number of copies can run
behind a load balancer, and it needs neither a GPU nor torch.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis.asyncio as aredis
from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from api import ask, chat, clips, errors, guard, replies, search, streams
from api.answers import AnswerHub, Busy
from api.config import ApiConfig
from common import health, metrics, redisio
from common.framelog import FrameLog
from common.lease import holder_name
from common.redisio import SOCKET_MARGIN_S, cluster_nodes
from common.wire import keys

WEB = Path(__file__).resolve().parent / "web"
POOL_WAIT_S = 2.0  # a request waits this long for a free pooled connection, then gets 503 busy


class _Pool(aredis.BlockingConnectionPool):
    """At most ``max_connections``; a request that waits POOL_WAIT_S for one is refused as busy:
    redis-py's own "No connection available" is a ConnectionError, which would read "redis unreachable"."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().get_connection(*args, **kwargs)
        except aredis.ConnectionError as e:
            if not isinstance(e.__cause__, TimeoutError):
                raise
            raise Busy(
                f"busy: all {self.max_connections} Redis connections of this API process are in use "
                "(redis_max_connections)"
            ) from None


def connect(cfg: ApiConfig, url: str | None = None, *, pooled: bool = True) -> aredis.Redis:
    """A client (of ``cfg.redis_url`` unless ``url``) whose socket timeout sits above the longest
    blocking read (XREAD BLOCK); a cluster client for a redis+cluster:// URL (common.redisio.cluster_nodes).
    A command on a connection Redis closed (it restarted) is sent once more on a new one. ``pooled``
    False: one connection (an answer reader's) instead of up to ``cfg.redis_max_connections``."""
    url = url or cfg.redis_url
    options: dict[str, Any] = dict(
        socket_timeout=cfg.block_ms / 1000 + SOCKET_MARGIN_S,
        socket_connect_timeout=5.0,
        health_check_interval=30,
    )
    size = cfg.redis_max_connections if pooled else 1
    cluster = cluster_nodes(url)
    if cluster is None:
        stale = Retry(NoBackoff(), 1, supported_errors=(aredis.ConnectionError,))
        pool = _Pool.from_url(url, max_connections=size, timeout=POOL_WAIT_S, retry=stale, **options)
        return aredis.Redis.from_pool(pool)
    first, nodes = cluster
    startup = [ClusterNode(host, port) for host, port in nodes[1:]]
    return aredis.RedisCluster.from_url(  # type: ignore[return-value]
        first, startup_nodes=startup, max_connections=size, **options
    )


def create_app(cfg: ApiConfig, r: aredis.Redis | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await app.state.answers.stop()
        for client in app.state.owned:
            await client.aclose()

    app = FastAPI(
        lifespan=lifespan,
        title="streamvqa",
        version="0.1.0",
        summary="Ask questions about live video.",
        description="Streams, questions (server-sent events), transcripts, job outputs and alerts; "
        "an OpenAI-compatible chat endpoint where `model` names the stream.",
    )
    app.state.cfg, app.state.r = cfg, r or connect(cfg)
    # frames and frame pictures (latest frame, alert frames): on their own Redis when one is set
    apart = cfg.frames_redis_url not in (None, cfg.redis_url)
    app.state.frames = connect(cfg, cfg.frames_redis_url) if apart else app.state.r
    # closed at shutdown: the clients made here (one passed in is its caller's)
    app.state.owned = ([] if r is not None else [app.state.r]) + ([app.state.frames] if apart else [])
    readers = (lambda: connect(cfg, pooled=False), app.state.r, cfg.answer_readers, cfg.block_ms, cfg.max_answers)
    app.state.answers = AnswerHub(*readers)
    # one reader for every request: it keeps the log files' indexes while they are unchanged
    app.state.framelog = FrameLog(cfg.framelog_dir) if cfg.framelog_dir is not None else None
    app.state.clips_encoding = 0  # clips being encoded now (api/clips.py), at most cfg.max_clips
    metrics.API_ANSWERS.set_function(app.state.answers.held)
    app.add_middleware(guard.BodyLimit, max_bytes=cfg.max_body_bytes)
    errors.install(app)
    for module in (streams, ask, chat, clips, search):
        app.include_router(module.router)
    app.get("/health/live", tags=["health"], summary="The process answers")(live)
    app.get("/health/ready", tags=["health"], summary="Redis reachable (and the stream's encoder lease held)")(ready)
    app.get("/", include_in_schema=False)(page)
    app.get("/favicon.ico", include_in_schema=False)(favicon)  # where browsers look without a <link>
    app.mount("/web", StaticFiles(directory=WEB), name="web")
    return app


async def live() -> dict:
    return dict(health.LIVE)  # the services' shape (common/health.py), as /health/ready's below


async def ready(request: Request, stream: str | None = Query(None, description="also require its lease")):
    """The services' /health/ready shape (`ready`, `checks`, `leases`, `reasons`); a 503 also
    carries the API's error object, whose `code` says which check failed."""
    r = request.app.state.r
    try:
        await r.ping()
        # `?stream=` (a probe built from an unset variable) is a bad name, not "no stream asked"
        holder = await r.get(keys.lease(replies.stream_name(stream))) if stream is not None else None
    except (aredis.ConnectionError, aredis.TimeoutError, *redisio.PROBE_ERRORS) as e:
        return _not_ready({"redis": False}, errors.body(503, f"redis unreachable: {type(e).__name__}"))
    except aredis.ResponseError as e:  # a user the API may not be (NOPERM): no route would work
        return _not_ready({"redis": False}, errors.refused(e))
    if stream is None:
        return JSONResponse(health.ready_body({"redis": True}, [], {})[1])
    if holder is None:
        error = errors.body(503, f"no encoder holds stream {stream!r}", param="stream", code="no_encoder")
        return _not_ready({"redis": True, "encoder": False}, error)
    _, body = health.ready_body({"redis": True, "encoder": True}, [], {})
    return JSONResponse(body | {"stream": stream, "encoder": holder_name(holder)})


def _not_ready(checks: dict[str, bool], error: dict) -> JSONResponse:
    """503: the failing check, its reason (the error's message) under `reasons`, and the error."""
    failing = dict.fromkeys((k for k, ok in checks.items() if not ok), error["error"]["message"])
    return JSONResponse(health.ready_body(checks, [], failing)[1] | error, status_code=503)


async def favicon() -> FileResponse:
    return FileResponse(WEB / "favicon.svg", media_type="image/svg+xml")


async def page() -> FileResponse:
    return FileResponse(WEB / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})
