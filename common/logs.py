"""Structured logging: one JSON object per line on stderr (or a console renderer for humans).

Usage::

    configure_logging("INFO")
    log = structlog.get_logger().bind(stream="cam1", qid=q.id, version=m.version)
    log.info("answered", total_s=0.42)

Configure before binding: a bound logger keeps the configuration it was bound under.
Records of the standard ``logging`` module (redis-py, transformers...) and uncaught exceptions
of any thread go through the same renderer, so the output stays one format.

Secrets: ``redact_url`` is the one way a URL leaves the process (logs, events, meta, status);
as a safety net every string of every log line has URL credentials masked (``redact_text``).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import MutableMapping
from typing import Any, TextIO
from urllib.parse import parse_qsl, urlencode

import structlog

MASK = "***"
_SCHEME = r"\b[a-zA-Z][a-zA-Z0-9+.-]*:"
# scheme:[/...]userinfo@ : the userinfo is everything up to the LAST '@'. A password may hold '/',
# '?', '#' or '@' unescaped (FFmpeg takes "rtsp://u:p@ss@host/": the last @ ends it; elsewhere the
# URL is broken, and its error quotes it): masking a path that holds an '@' as well is the price of
# never showing such a password. People type one slash or none ("rtsp:/u:p@host", FFmpeg takes it;
# "ingest:pw@redis:6379" for a Redis URL) and passwords with spaces ("admin:correct horse@host"):
# after a slash the userinfo may hold spaces, up to the last '@' before the next URL or line end;
# with no slash it may not, or every "word: ... user@host" of free text would be masked.
_URL_USERINFO = re.compile(
    rf"(?P<scheme>{_SCHEME})(?:(?P<slashes>/+)(?P<spaced>(?:(?!{_SCHEME}/)[^\n])*)|(?P<plain>\S+))@"
)
_URL_START = re.compile(rf"^{_SCHEME}/*")  # a whole URL: its userinfo runs to its last '@'
_SECRET_PARAMS = re.compile(r"pass|pw|secret|token|key|auth|sig", re.I)
# ?name=value / &name=value inside free text: masked when the name looks secret, as redact_url does
# (cameras such as rtsp://host/stream?user=admin&password=... carry it there, and FFmpeg quotes it).
_QUERY_PARAM = re.compile(r"(?P<lead>[?&](?P<name>[\w.~%+-]+)=)(?P<value>[^&#\s'\"]+?)(?=[&#\s'\"]|:\s|$)")


def redact_url(url: str) -> str:
    """``url`` with its password (or a lone user token) and secret-looking query values masked."""
    start = _URL_START.match(url)
    if start and "@" in url[start.end() :]:
        # Up to the last '@', not the netloc a parser finds: an unescaped '/', '?', '#' or '@' in a
        # password would end the netloc early and leave the rest of the password in path or query.
        userinfo, _, rest = url[start.end() :].rpartition("@")
        url = f"{start[0]}{_mask_userinfo(userinfo)}@{rest}"
    # The query by hand, not by a parser: one rebuilding the URL would add '//' to "rtsp:/host".
    head, has_query, tail = url.partition("?")
    if not has_query:
        return url
    query, has_fragment, fragment = tail.partition("#")
    pairs = parse_qsl(query, keep_blank_values=True)
    query = urlencode([(k, MASK if _SECRET_PARAMS.search(k) else v) for k, v in pairs], safe="*")
    return f"{head}?{query}{has_fragment}{fragment}"


def redact_text(text: str) -> str:
    """Mask the credentials of every URL inside free text (error messages, tracebacks)."""
    text = _URL_USERINFO.sub(_masked_userinfo, text)
    return _QUERY_PARAM.sub(lambda m: m["lead"] + MASK if _SECRET_PARAMS.search(m["name"]) else m[0], text)


def _masked_userinfo(m: re.Match[str]) -> str:
    return m["scheme"] + (m["slashes"] or "") + _mask_userinfo(m["spaced"] or m["plain"] or "") + "@"


def _mask_userinfo(userinfo: str) -> str:
    user, has_password, _ = userinfo.partition(":")
    return f"{user}:{MASK}" if has_password else MASK


def _redact(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value) if "@" in value or "=" in value else value
    if isinstance(value, dict):
        return {k: _redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_redact(v) for v in value)
    return value


def redact_processor(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: the safety net behind redact_url, over every value of every line."""
    return {k: _redact(v) for k, v in event_dict.items()}


_SHARED = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]
# Structured tracebacks without local variables: locals can be huge (tensors) or secret (URLs).
_JSON_EXC = structlog.processors.ExceptionRenderer(structlog.tracebacks.ExceptionDictTransformer(show_locals=False))


def level_number(level: str) -> int:
    """The logging level for a name such as DEBUG or warning; ValueError names the choices."""
    num = logging.getLevelNamesMapping().get(level.upper())
    if num is None:
        raise ValueError(f"unknown log level {level!r} (one of DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    return num


class _CurrentStderr:
    """Whatever `sys.stderr` is at each write: a logger configured once must not hold on to a
    stream that was replaced (and closed) since, as pytest's capture does between tests."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure_logging(level: str = "INFO", json: bool = True, stream: TextIO | None = None) -> None:
    """Configure structlog, stdlib logging and the uncaught-exception hooks of every thread."""
    num = level_number(level)
    out = stream or _CurrentStderr()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=out.isatty())
    exc = _JSON_EXC if json else structlog.processors.format_exc_info
    structlog.configure(
        processors=[*_SHARED, structlog.processors.StackInfoRenderer(), exc, redact_processor, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(num),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,  # so a later configure_logging (tests, CLI flags) applies
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*_SHARED, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, exc, redact_processor, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(num)
    logging.captureWarnings(True)  # warnings.warn (transformers, torch) as log lines, not plain text
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_thread_uncaught


def _log_uncaught(tp: type[BaseException], value: BaseException, tb: Any) -> None:
    if issubclass(tp, KeyboardInterrupt):
        return sys.__excepthook__(tp, value, tb)
    structlog.get_logger().critical("uncaught exception", exc_info=(tp, value, tb))


def _log_thread_uncaught(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    thread = args.thread.name if args.thread else None
    structlog.get_logger().error(
        "uncaught exception in thread", thread=thread, exc_info=(args.exc_type, args.exc_value, args.exc_traceback)
    )
