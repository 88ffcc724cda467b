"""The FastAPI application: routes, errors, limits, the web page and health probes.

Stateless: everything it shows or asks goes through Redis, so any number of copies can run
behind a load balancer, and it needs neither a GPU nor torch.
"""

from __future__ import annotations

from pathlib import Path

import redis.asyncio as aredis
from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from redis.asyncio.cluster import ClusterNode

from api import ask, chat, errors, guard, replies, streams
from api.config import ApiConfig
from common.redisio import SOCKET_MARGIN_S, cluster_nodes
from common.wire import keys

WEB = Path(__file__).resolve().parent / "web"


def connect(cfg: ApiConfig, url: str | None = None) -> aredis.Redis:
    """A client (of ``cfg.redis_url`` unless ``url``) whose socket timeout sits above the longest
    blocking read (XREAD BLOCK); a cluster client for a redis+cluster:// URL (common.redisio.cluster_nodes)."""
    url = url or cfg.redis_url
    options = dict(socket_timeout=cfg.block_ms / 1000 + SOCKET_MARGIN_S, socket_connect_timeout=5.0)
    cluster = cluster_nodes(url)
    if cluster is None:
        return aredis.Redis.from_url(url, health_check_interval=30, **options)
    first, nodes = cluster
    startup = [ClusterNode(host, port) for host, port in nodes[1:]]
    return aredis.RedisCluster.from_url(first, startup_nodes=startup, health_check_interval=30, **options)  # type: ignore[return-value]


def create_app(cfg: ApiConfig, r: aredis.Redis | None = None) -> FastAPI:
    app = FastAPI(
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
    app.add_middleware(guard.BodyLimit, max_bytes=cfg.max_body_bytes)
    errors.install(app)
    for module in (streams, ask, chat):
        app.include_router(module.router)
    app.get("/health/live", tags=["health"], summary="The process answers")(live)
    app.get("/health/ready", tags=["health"], summary="Redis reachable (and the stream's encoder lease held)")(ready)
    app.get("/", include_in_schema=False)(page)
    app.mount("/web", StaticFiles(directory=WEB), name="web")
    return app


async def live() -> dict:
    return {"status": "ok"}


async def ready(request: Request, stream: str | None = Query(None, description="also require its lease")):
    r = request.app.state.r
    try:
        await r.ping()
        # `?stream=` (a probe built from an unset variable) is a bad name, not "no stream asked"
        holder = await r.get(keys.lease(replies.stream_name(stream))) if stream is not None else None
    except (aredis.ConnectionError, aredis.TimeoutError, OSError) as e:
        return errors.response(503, f"redis unreachable: {type(e).__name__}")
    if stream is not None and holder is None:
        return errors.response(503, f"no encoder holds stream {stream!r}", param="stream")
    body = {"status": "ready", "redis": True}
    return JSONResponse(body | ({"stream": stream, "encoder": holder.decode()} if stream else {}))


async def page() -> FileResponse:
    return FileResponse(WEB / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})
