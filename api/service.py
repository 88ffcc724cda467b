"""`streamvqa api`: serve the HTTP API and the web page (uvicorn)."""

from __future__ import annotations

import sys

import structlog
import uvicorn

from api.app import create_app
from api.config import ApiConfig
from common import boot

log = structlog.get_logger()


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
    boot.connect_tool(cfg.redis_url, prog, timeout_s=30).close()  # exit 3 when Redis is unusable at start
    warn_if_exposed(cfg)
    log.info("api starting", host=cfg.host, port=cfg.port, auth=cfg.token is not None)
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_config=None, timeout_graceful_shutdown=5)
    return 0
