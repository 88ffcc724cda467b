"""Structured logging: one JSON object per line on stderr (or a console renderer for humans).

Usage::

    configure_logging("INFO")
    log = structlog.get_logger().bind(stream="cam1", qid=q.id, version=m.version)
    log.info("answered", total_s=0.42)

Configure before binding: a bound logger keeps the configuration it was bound under.
Records of the standard ``logging`` module (redis-py, transformers...) go through the same
renderer, so the output stays one format.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

_SHARED = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]
# Structured tracebacks without local variables: locals can be huge (tensors) or secret (URLs).
_JSON_EXC = structlog.processors.ExceptionRenderer(structlog.tracebacks.ExceptionDictTransformer(show_locals=False))


def configure_logging(level: str = "INFO", json: bool = True, stream: TextIO | None = None) -> None:
    """Configure structlog and stdlib logging; ``level`` is a name such as DEBUG or WARNING."""
    num = logging.getLevelNamesMapping().get(level.upper())
    if num is None:
        raise ValueError(f"unknown log level {level!r}")
    out = stream or sys.stderr
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=out.isatty())
    exc = _JSON_EXC if json else structlog.processors.format_exc_info
    structlog.configure(
        processors=[*_SHARED, structlog.processors.StackInfoRenderer(), exc, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(num),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,  # so a later configure_logging (tests, CLI flags) applies
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*_SHARED, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, exc, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(num)
