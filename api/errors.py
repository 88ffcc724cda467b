"""Errors as JSON, one shape everywhere (OpenAI's, so its clients read ours too):
``{"error": {"message", "type", "param", "code"}}`` with a status code that says what went wrong."""

from __future__ import annotations

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from common.redisio import OUTAGE_ERRORS
from common.wire.schemas import SchemaError

log = structlog.get_logger()

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    503: "unavailable",
    504: "timeout",
}


class ApiError(HTTPException):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(status, message, headers)
        self.param = param


def body(status: int, message: str, param: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body(status, message, param), status_code=status, headers=headers)


def schema_error(e: SchemaError) -> ApiError:
    return ApiError(400, str(e), param=e.field)


def unavailable(e: Exception) -> dict:
    """The body for a Redis that cannot serve (down, timing out, a cluster without a slot's node):
    503, the same words as /health/ready; the exception's own text may name hosts, so only its kind."""
    log.warning("redis unreachable", error=f"{type(e).__name__}: {e}")
    return body(503, f"redis unreachable: {type(e).__name__}")


def install(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        return response(e.status_code, str(e.detail), getattr(e, "param", None), e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":  # loc is ("body", offset): an offset is no field name
            reason = first.get("ctx", {}).get("error", first["msg"])
            return response(422, f"the body is not valid JSON: {reason} (at character {first['loc'][-1]})")
        if tuple(first["loc"]) == ("body",) and first.get("type") == "missing":  # "Field required", of no field
            return response(422, "the body is missing: send a JSON object")
        if tuple(first["loc"]) == ("body",):  # not an object: often `curl -d` without the JSON content type
            return response(422, "the body must be a JSON object, sent as Content-Type: application/json")
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return response(422, f"{param}: {first['msg']}" if param else first["msg"], param)

    async def outage(_: Request, e: Exception) -> JSONResponse:  # not a 500 with a traceback: the API is fine
        return JSONResponse(unavailable(e), status_code=503)

    for kind in OUTAGE_ERRORS:
        app.add_exception_handler(kind, outage)
