"""Errors as JSON, one shape everywhere (OpenAI's, so its clients read ours too):
``{"error": {"message", "type", "param", "code"}}`` with a status code that says what went wrong
and ``code`` a string (OpenAI's where it has one: ``model_not_found``, ``invalid_api_key``).

One rule for requests: whatever is wrong with what the client sent (not JSON, no JSON Content-Type,
a field unknown, missing or of the wrong kind, a value out of range) is 400, naming the field in
``param`` where there is one. 422 is kept for a question the worker refused."""

from __future__ import annotations

import redis
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import MaxConnectionsError
from starlette.exceptions import HTTPException

from api.answers import Busy
from common import metrics
from common.redisio import PROBE_ERRORS, REFUSALS
from common.wire.schemas import SchemaError

log = structlog.get_logger()

_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    422: "question_refused",
    429: "queue_full",
    499: "client_closed",
    503: "redis_unreachable",
    504: "timeout",
}
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "unavailable",
    504: "timeout",
}


class ApiError(HTTPException):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict | None = None,
        code: str | None = None,
        kind: str | None = None,
    ):
        super().__init__(status, message, headers)
        self.param, self.code, self.kind = param, code, kind


def body(status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None) -> dict:
    kind = kind or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    code = code or _CODES.get(status, "server_error" if status >= 500 else "invalid_request")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def response(
    status: int,
    message: str,
    param: str | None = None,
    headers: dict | None = None,
    code: str | None = None,
    kind: str | None = None,
) -> JSONResponse:
    return JSONResponse(body(status, message, param, code, kind), status_code=status, headers=headers)


def busy(e: Busy | MaxConnectionsError) -> JSONResponse:
    """503 with Retry-After: the API is well, Redis too; this process holds all it may right now."""
    retry_after = getattr(e, "retry_after_s", 1)
    message = str(e) if isinstance(e, Busy) else "busy: all Redis connections of this API process are in use"
    log.warning("busy", reason=message)
    metrics.API_BUSY.inc()
    content = body(503, message, code="busy", kind="busy")
    return JSONResponse(content, status_code=503, headers={"Retry-After": str(retry_after)})


def schema_error(e: SchemaError) -> ApiError:
    return ApiError(400, str(e), param=e.field)


def unavailable(e: Exception) -> dict:
    """The body for a Redis that cannot serve (down, timing out, a cluster without a slot's node):
    503, the same words as /health/ready; the exception's own text may name hosts, so only its kind."""
    if isinstance(e, REFUSALS):  # there, but full or read-only: not "unreachable"
        return refused(e)
    log.warning("redis unreachable", error=f"{type(e).__name__}: {e}")
    return body(503, f"redis unreachable: {type(e).__name__}", code="redis_unreachable")


def refused(e: redis.ResponseError) -> dict:
    """The body for a command Redis refused (a user without a permission the API needs, a stream
    at its last possible id): 503, not a 500 of plain text; its text (the command, the key) logged."""
    log.error("redis refused a command", error=f"{type(e).__name__}: {e}")
    return body(503, f"redis refused a command: {type(e).__name__} (the API's log says which)", code="redis_refused")


def install(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        extra = {"code": getattr(e, "code", None), "kind": getattr(e, "kind", None)}
        return response(e.status_code, str(e.detail), getattr(e, "param", None), e.headers, **extra)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":  # loc is ("body", offset): an offset is no field name
            reason = first.get("ctx", {}).get("error", first["msg"])
            return response(400, f"the body is not valid JSON: {reason} (at character {first['loc'][-1]})")
        if tuple(first["loc"]) == ("body",) and first.get("type") == "missing":  # "Field required", of no field
            return response(400, "the body is missing: send a JSON object")
        if tuple(first["loc"]) == ("body",):  # not an object: often `curl -d` without the JSON content type
            return response(400, "the body must be a JSON object, sent as Content-Type: application/json")
        # the field's own name, as OpenAI gives it: "count", not "query.count"
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        code = "unknown_parameter" if first.get("type") == "extra_forbidden" else None
        return response(400, f"{param}: {first['msg']}" if param else first["msg"], param, code=code)

    app.add_exception_handler(Busy, lambda _, e: busy(e))  # type: ignore[arg-type]
    app.add_exception_handler(MaxConnectionsError, lambda _, e: busy(e))  # type: ignore[arg-type]

    async def outage(_: Request, e: Exception) -> JSONResponse:  # not a 500 with a traceback: the API is fine
        return JSONResponse(unavailable(e), status_code=503)

    for kind in PROBE_ERRORS:  # a cluster client that cannot connect raises RedisClusterException
        app.add_exception_handler(kind, outage)
    app.add_exception_handler(redis.ResponseError, lambda _, e: JSONResponse(refused(e), status_code=503))  # type: ignore[arg-type]
