"""Service start-up shared by every `streamvqa <service>`: config, logs, metrics, Redis, model.

Each failure exits non-zero with one clear log line, so an orchestrator sees why a service
is not running: 2 bad configuration, 3 Redis unusable, 4 model unusable.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import TypeVar

import redis
import structlog

from common import metrics, redisio
from common.config import ConfigError, load_config
from common.logs import configure_logging

T = TypeVar("T")
log = structlog.get_logger()


def start(cls: type[T], argv: list[str], prog: str) -> tuple[T, redis.Redis]:
    """Config (flags, SVQA_*, YAML), logging, metrics endpoint, a live Redis connection."""
    try:
        cfg = load_config(cls, argv[1:], prog=prog)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(cfg.log_level)
    metrics.serve(getattr(cfg, "metrics_port", None))
    try:
        r = redisio.wait_for_redis(cfg.redis_url, timeout_s=30, block_ms=getattr(cfg, "block_ms", 5000))
    except TimeoutError as e:
        log.error("redis unusable at start", error=str(e))
        raise SystemExit(3) from None
    return cfg, r


def load_runtime(model: str, device: str | None):
    from common.engine.model import load_model
    from common.engine.runtime import Runtime  # torch/transformers only where a model is needed

    try:
        return Runtime(load_model(model, device=device))
    except (OSError, ValueError) as e:
        log.error("model unusable at start", model=model, error=str(e))
        raise SystemExit(4) from None


def stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop
