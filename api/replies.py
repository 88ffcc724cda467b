"""The question protocol over redis.asyncio: XADD to `svqa:questions`, read `svqa:answer:{id}`.

The same messages as `qa_worker.client` (the sync client), encoded and validated by the same
schema functions, so what the API sends is exactly what a worker accepts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import redis.asyncio as aredis
from fastapi import Request
from pydantic import BeforeValidator

from api import clips, errors
from api.answers import Subscription
from common import metrics, redisio, stream_status
from common.wire import keys
from common.wire.admission import estimated_wait_s
from common.wire.schemas import (
    AnswerDelta,
    FinalAnswer,
    Question,
    SchemaError,
    check_stream_name,
    checked_question,
    decode_answer,
    encode_question,
)
from common.wire.timeref import TimeRef, parse_time_ref, seconds_ago


def stream_name(name: str, field: str = "stream") -> str:
    """A name that may become part of a key (stream, job, alert id): checked like a stream name."""
    try:
        return check_stream_name(field, name)
    except SchemaError as e:
        raise errors.schema_error(e) from None


async def known_stream(r: aredis.Redis, name: str, *, failing: bool = False, as_model: bool = False) -> str:
    """404 unless ingest or an encoder has ever written the stream; with ``failing``, its events
    alone will do: a camera that never connected is listed (by them) and they say why it fails.
    ``as_model``: the stream named as an OpenAI model, refused as OpenAI refuses an unknown model."""
    field = "model" if as_model else "stream"
    if await r.exists(*stream_status.presence_keys(stream_name(name, field), failing=failing)):
        return name
    if as_model:
        message = f"The model {name!r} does not exist: models are the streams (GET /v1/models)"
        raise errors.ApiError(404, message, param="model", code="model_not_found", kind="invalid_request_error")
    raise errors.ApiError(404, f"unknown stream {name!r}", param="stream", code="stream_not_found")


def _no_bool(value: Any) -> Any:
    """pydantic's lax mode reads true as 1: a client's mistake ("at": true) would ask about version 1."""
    if isinstance(value, bool):
        raise ValueError("must be a number, not true or false")
    return value


NotBool = BeforeValidator(_no_bool)  # for a request's number fields, on the whole field (its error names the field)


def question(stream: str, text: str, **options: Any) -> Question:
    """A validated question: checked by the same parser the worker runs on what it reads. `since`
    and `until` come as a request has them: seconds (a number) or the protocol's text."""
    options = {k: v for k, v in options.items() if v is not None}
    if "choices" in options:
        options["choices"] = tuple(options["choices"])
    try:
        for name in ("since", "until"):
            if name in options:
                options[name] = _time_ref(name, options[name])
        return checked_question(stream, text, **options)
    except SchemaError as e:
        raise errors.schema_error(e) from None


def _time_ref(name: str, value: float | str) -> TimeRef:
    """A JSON number is seconds as it is (its text may be 5e-05, which no form reads); a string
    is read in the protocol's forms."""
    try:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return seconds_ago(value)
        return parse_time_ref(str(value))
    except ValueError as e:
        raise SchemaError(name, str(e)) from None


SINCE_HELP = (
    "ask about a past span, answered from the frames log (not the live cache): seconds before now (3600, "
    '"90s", "15m", "2h30m", "1d") or an ISO 8601 time with its UTC offset'
)
UNTIL_HELP = "the past span's end, in the same forms as since (default: now)"


async def submit(r: aredis.Redis, q: Question) -> None:
    await r.xadd(keys.QUESTIONS, encode_question(q))


async def ask(request: Request, q: Question) -> Subscription:
    """Read the answer stream from before the question is asked (nothing missed); 503 busy, with
    nothing queued, when this process holds all the answers it may; 429 when the question would
    wait longer than `max_queue_wait_s` to start (a question about the past: for its turn at a history
    cache, then for the GPU)."""
    await admit(request.app.state.r, q.stream, request.app.state.cfg.max_queue_wait_s, q.about_past)
    sub = request.app.state.answers.open(q.id, request.app.state.cfg.answer_timeout_s)
    try:
        await submit(request.app.state.r, q)
    except BaseException:
        sub.close()
        raise
    return sub


async def admit(r: aredis.Redis, stream: str, max_wait_s: float, about_past: bool = False) -> None:
    """429, with `Retry-After`, for a question the GPU answering ``stream`` could not start within
    ``max_wait_s``, by the estimate its workers publish (common/wire/admission.py) with the
    questions in the stream's queue no worker has taken yet; nothing is refused without one. A
    question ``about_past`` waits for a turn at a history cache first: that wait counts too."""
    entries = await r.hgetall(keys.admission(stream))
    if not entries:
        return
    wait_s = estimated_wait_s(entries, await _untaken(r, stream), about_past=about_past)
    if wait_s is None or wait_s <= max_wait_s:
        return
    retry_after = max(1, math.ceil(wait_s - max_wait_s))  # by then the queue ahead has moved on that much
    what = "a question about the past (a turn at a history cache, then the GPU)" if about_past else "a question"
    message = f"busy: {what} on {stream!r} would wait about {wait_s:.0f} s to start (max_queue_wait_s {max_wait_s:g})"
    metrics.API_QUEUE_FULL.inc()
    raise errors.ApiError(429, message, headers={"Retry-After": str(retry_after)})


async def _untaken(r: aredis.Redis, stream: str) -> int:
    """Questions in the stream's queue that no worker has taken yet (0 with no queue)."""
    try:
        groups = await r.xinfo_groups(keys.questions(stream))
    except aredis.ResponseError:
        return 0
    lag = next((g.get("lag") for g in groups if redisio.text(g["name"]) == keys.QA_GROUP), None)
    return int(lag or 0)


async def replies(
    sub: Subscription, timeout_s: float, block_ms: int, gone: Callable[[], Awaitable[bool]] | None = None
) -> AsyncIterator[AnswerDelta | FinalAnswer | None]:
    """Deltas as they arrive, then the final answer; TimeoutError if none comes in time. ``gone``
    (a request's ``is_disconnected``) is asked at least every ``block_ms``: True ends the replies.
    None after every ``block_ms`` that brought nothing: a tick, for whoever reports the wait."""
    deadline = time.monotonic() + timeout_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                batch = await asyncio.wait_for(sub.queue.get(), min(left, block_ms / 1000))
            except TimeoutError:
                batch = []
            if isinstance(batch, Exception):  # the read failed (Redis went away)
                raise batch
            if not batch:
                yield None
            for fields in batch:
                reply = decode_answer(fields)
                yield reply
                if isinstance(reply, FinalAnswer):
                    return
            if gone is not None and await gone():
                return
        raise TimeoutError(f"no final answer for question {sub.qid} within {timeout_s:g} s")
    finally:
        sub.close()


async def queue_position(r: aredis.Redis, stream: str, qid: str) -> int | None:
    """1 + the questions ahead of ``qid`` in its stream's queue that no worker has taken yet; None
    when it is not waiting there (not forwarded yet, or taken: being answered)."""
    queue = keys.questions(stream)
    try:
        groups = await r.xinfo_groups(queue)
    except aredis.ResponseError:  # no queue yet
        return None
    taken = next((g["last-delivered-id"] for g in groups if redisio.text(g["name"]) == keys.QA_GROUP), b"0-0")
    waiting = await r.xrange(queue, min=f"({redisio.text(taken)}", count=QUEUE_SCAN)
    ids = [fields.get(b"id") for _, fields in waiting]
    return ids.index(qid.encode()) + 1 if qid.encode() in ids else None


async def newest_attempt(
    replies_: AsyncIterator[AnswerDelta | FinalAnswer | None],
) -> AsyncIterator[tuple[AnswerDelta | FinalAnswer | None, bool]]:
    """(reply, restarted): deltas of a dead worker's attempt that arrive after its successor's are
    dropped; ``restarted`` marks the first delta of a newer attempt, whose text starts over. Ticks
    (None) pass as (None, False)."""
    attempt = 0
    async for reply in replies_:
        if reply is None:
            yield reply, False
        elif isinstance(reply, AnswerDelta):
            if reply.attempt < attempt:
                continue
            restarted, attempt = 0 < attempt < reply.attempt, max(attempt, reply.attempt)
            yield reply, restarted
        else:
            yield reply, False


async def final_of(request: Request, sub: Subscription) -> FinalAnswer:
    """The final answer. A client that hung up ends the wait: nothing else would for a
    non-streamed response, and each waiter holds a subscription for up to ``answer_timeout_s``."""
    cfg = request.app.state.cfg
    try:
        async for reply in replies(sub, cfg.answer_timeout_s, cfg.block_ms, request.is_disconnected):
            if isinstance(reply, FinalAnswer):
                return reply
    except TimeoutError as e:
        raise errors.ApiError(504, str(e)) from None
    raise errors.ApiError(499, "client closed the request")  # sent to no one


def refused_param(final: FinalAnswer, fields: Mapping[str, str]) -> str | None:
    """The request field a refused question's final names, by the endpoint's name for it (``fields``:
    the worker's name to the request's); None where the worker named none, or one the request cannot
    send: the refusal is then about no field of it, and naming one would send its client to fix the
    wrong one."""
    return fields.get(final.param or "")


def final_json(final: FinalAnswer, request: Request) -> dict[str, Any]:
    """The final answer as the API tells it: the worker's fields and, where this API reads a frames
    log, ``evidence`` (api/clips.py): its capture ranges with the URLs of a clip and a snapshot."""
    out = dataclasses.asdict(final)
    out["scores"] = dict(final.scores) if final.scores is not None else None
    if request.app.state.cfg.framelog_dir is not None and final.stream is not None:
        ranges = final.ranges or (
            [(final.t_start, final.t_end)] if final.t_start is not None and final.t_end is not None else []
        )
        out["evidence"] = clips.evidence(final.stream, ranges)
    return out


QUEUE_SCAN = 1000  # a question further back in its queue than this has no position reported
KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: every client skips it


async def keep_alive(events: AsyncIterator[bytes], every_s: float) -> AsyncIterator[bytes]:
    """``events``, and a comment whenever none came for ``every_s``: the connection is never idle
    long enough for a proxy to cut it while the answer is still to come."""
    pending: asyncio.Future[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield KEEP_ALIVE
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield event
    finally:
        if pending is not None:  # the client left: stop the read under way
            pending.cancel()


def sse(event: str, data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"event: {event}\ndata: {text}\n\n".encode()


def sse_data(data: dict[str, Any] | str) -> bytes:
    """An unnamed event (what OpenAI streaming clients read)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()
