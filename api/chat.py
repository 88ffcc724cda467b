"""OpenAI-compatible endpoints: `POST /v1/chat/completions` (streaming and not), `GET /v1/models`
and `GET /v1/models/{model}`.

`model` names the stream, so any OpenAI client or tool can ask a camera. The question is the
last user message (text parts only: the stream is the video), and the last turn; earlier turns are
not sent, because every question is answered against the video alone. A parameter that would change the answer and
is not supported (tools, response_format, stop, logprobs, penalties, ...) is refused with 400
naming it, never silently ignored; bookkeeping ones (user, metadata, seed, ...) are accepted;
`n` must be 1. Non-OpenAI details of the answer (version, time range, latencies) come in a
`streamvqa` object beside the standard fields.

Extension fields, beside OpenAI's in the request body as vLLM takes its own (OpenAI's Python client:
`extra_body={"since": "1h"}`): `since` and `until` ask about a past span of the stream instead of
its live cache, in the forms `POST /api/streams/{name}/ask` takes, and `scope` "history" answers
over the stream's past chunks that rank best for the question (README "Search");
`streamvqa.ranges` then says which capture times the answer saw.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from api import errors, replies
from api.answers import Subscription
from api.guard import require_token
from api.streams import stream_names
from common.engine.params import MIN_TOP_P
from common.redisio import OUTAGE_ERRORS
from common.wire.schemas import AnswerDelta, FinalAnswer, Question

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_token)])


def _content(value: Any) -> Any:
    """Checked before the union is: its error names the member that failed (`messages.0.content.str`),
    a field no client sent; this one's is `messages.0.content`."""
    parts_ok = isinstance(value, list) and all(isinstance(part, dict) for part in value)
    if value is None or isinstance(value, str) or parts_ok:
        return value
    raise ValueError("must be a string or a list of content parts (objects)")


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Annotated[str | list[dict[str, Any]] | None, BeforeValidator(_content)] = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI's many optional fields: see refuse_unsupported

    model: str = Field(description="the stream name")
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    max_tokens: Annotated[int | None, replies.NotBool] = None
    max_completion_tokens: Annotated[int | None, replies.NotBool] = None
    temperature: Annotated[float | None, replies.NotBool] = None
    top_p: Annotated[float | None, replies.NotBool] = None
    n: Annotated[int | None, replies.NotBool] = None
    since: Annotated[float | str | None, replies.NotBool] = Field(None, description=replies.SINCE_HELP)
    until: Annotated[float | str | None, replies.NotBool] = Field(None, description=replies.UNTIL_HELP)
    scope: Literal["live", "history"] | None = Field(
        None, description="history: answered over the stream's past chunks that rank best for the question"
    )


# Accepted and without effect on the answer: bookkeeping, or a promise kept anyway (greedy answers
# repeat, as seed hopes); stream_options.include_usage is read by the stream itself (`_chunks`).
# OpenAI's client deprecates `user` for safety_identifier and prompt_cache_key: a client that follows
# it sends those, and the prompt_cache_* hints ask only for caching OpenAI's prompt, not this answer.
IGNORED = frozenset(
    {"user", "store", "metadata", "service_tier", "stream_options", "seed", "parallel_tool_calls"}
    | {"safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options"}
)
# Unsupported unless set to what asks for nothing (a client's defaults, sent explicitly).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "stop": (None, []),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "modalities": (None, ["text"]),
}


def refuse_unsupported(extra: dict[str, Any]) -> None:
    """400 naming the first parameter this endpoint cannot honour: an answer that ignored it
    (a JSON schema, a tool call, a stop word) would look right and be wrong."""
    for name, value in extra.items():
        if name in IGNORED or value in NEUTRAL.get(name, ()):
            continue
        message = f"{name} is not supported: a stream answers in plain text, from its video alone"
        raise errors.ApiError(400, message, param=name, code="unsupported_parameter")


INSTRUCTIONS = ("system", "developer")  # may follow the question: not sent, as every earlier turn


def question_text(messages: list[Message]) -> str:
    turns = [m for m in messages if m.role not in INSTRUCTIONS]
    if not any(m.role == "user" for m in turns):
        raise errors.ApiError(400, "no user message", param="messages")
    if turns[-1].role != "user":  # answering the user's message before it would repeat an old answer
        message = f"the last message is the {turns[-1].role}'s: the question must come last, a user message"
        raise errors.ApiError(400, message, param="messages")
    content = turns[-1].content
    if isinstance(content, list):
        if any(part.get("type") != "text" for part in content):
            raise errors.ApiError(400, "only text content is supported: the stream is the video", param="messages")
        content = "\n".join(str(part.get("text", "")) for part in content)
    if not content:
        raise errors.ApiError(400, "the last user message is empty", param="messages")
    return content


@router.get("/models", summary="The streams, as OpenAI models")
async def models(request: Request) -> dict:
    names = await stream_names(request.app.state.r)
    return {"object": "list", "data": [_model(n) for n in names]}


@router.get("/models/{model}", summary="One stream, as an OpenAI model")
async def model(model: str, request: Request) -> dict:
    return _model(await replies.known_stream(request.app.state.r, model, failing=True, as_model=True))


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "streamvqa"}


@router.post("/chat/completions", summary="Ask a stream, OpenAI style (model = stream name)")
async def chat(body: ChatRequest, request: Request):
    r, cfg = request.app.state.r, request.app.state.cfg
    refuse_unsupported(body.model_extra or {})
    if body.n not in (None, 1):
        raise errors.ApiError(400, "n must be 1", param="n")
    await replies.known_stream(r, body.model, as_model=True)
    # the newer name wins when both are sent; 0 is a value (refused below), not "unset"
    tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    top_p = body.top_p  # a negative one goes on to the question's check, which refuses it
    if top_p is not None and top_p >= 0:  # OpenAI's 0 keeps the top token only, as the least top_p here does
        top_p = max(top_p, MIN_TOP_P)
    try:
        q = replies.question(
            body.model,
            question_text(body.messages),
            max_tokens=getattr(body, tokens_field),
            temperature=body.temperature,
            top_p=top_p,
            since=body.since,
            until=body.until,
            scope=body.scope,
        )
    except errors.ApiError as e:
        raise _as_sent(e, {"max_tokens": tokens_field, "question": "messages"}) from None
    sub = await replies.ask(request, q)
    if body.stream:
        usage = _include_usage((body.model_extra or {}).get("stream_options"))
        return StreamingResponse(
            replies.keep_alive(_chunks(request, q, sub, usage), cfg.keep_alive_s), media_type="text/event-stream"
        )
    final = await replies.final_of(request, sub)
    if final.error is not None:
        raise errors.ApiError(422, final.error, param=replies.refused_param(final, _CHAT_FIELDS))
    message = {"role": "assistant", "content": final.text}
    return _envelope(q, "chat.completion") | {
        "choices": [{"index": 0, "message": message, "finish_reason": _finish(q, final)}],
        "usage": _usage(final),
        "streamvqa": replies.final_json(final, request),
    }


def _as_sent(e: errors.ApiError, names: dict[str, str]) -> errors.ApiError:
    """The question's check names its own fields ("question", "max_tokens"): renamed to the request's
    (the last user message is in "messages"), or the client is sent to fix a field it never sent."""
    sent = names.get(e.param or "")
    if sent is None:
        return e
    said = "the last user message" if sent == "messages" else sent
    e.detail = str(e.detail).replace(f"{e.param}:", f"{said}:", 1)
    e.param = sent
    return e


# The question fields a worker's refusal may name, as this endpoint's request calls them (streamed or
# not); "messages" for one the worker named none would send its client to fix the wrong field.
_CHAT_FIELDS = {"since": "since", "until": "until", "scope": "scope", "question": "messages", "stream": "model"}


def _envelope(q: Question, kind: str) -> dict:
    return {"id": f"chatcmpl-{q.id}", "object": kind, "created": int(time.time()), "model": q.stream}


def _finish(q: Question, final: FinalAnswer) -> str:
    return "length" if final.tokens is not None and final.tokens >= q.max_tokens else "stop"


def _usage(final: FinalAnswer) -> dict:
    prompt, completion = final.cache_tokens or 0, final.tokens or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _include_usage(options: Any) -> bool:
    """Whether the stream ends with a usage chunk: as OpenAI, only when `stream_options` asks."""
    return isinstance(options, dict) and options.get("include_usage") is True


def _chunk(q: Question, delta: dict, finish: str | None = None) -> dict:
    return _envelope(q, "chat.completion.chunk") | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def _chunks(request: Request, q: Question, sub: Subscription, usage: bool) -> AsyncIterator[bytes]:
    """The answer as OpenAI's chunks; with `usage`, a last one of no choices carries it, as OpenAI's
    `stream_options.include_usage` gives it (the finish chunk carries it no more: clients that sum
    usage over chunks counted it where none was asked)."""
    cfg = request.app.state.cfg
    yield replies.sse_data(_chunk(q, {"role": "assistant", "content": ""}))
    sent, current = "", ""  # what the client has; the text of the newest attempt
    try:
        stream = replies.replies(sub, cfg.answer_timeout_s, cfg.block_ms)
        async for reply, restarted in replies.newest_attempt(stream):
            if reply is None:
                continue
            if isinstance(reply, AnswerDelta):
                # OpenAI chunks cannot be taken back: after a restart, send only what goes past the text
                # already sent (the same text again under greedy decoding, the usual case)
                current = reply.text if restarted else current + reply.text
                if current.startswith(sent) and len(current) > len(sent):
                    yield replies.sse_data(_chunk(q, {"content": current[len(sent) :]}))
                    sent = current
            elif reply.error is not None:
                yield replies.sse_data(errors.body(422, reply.error, replies.refused_param(reply, _CHAT_FIELDS)))
            else:
                finished = _chunk(q, {}, _finish(q, reply)) | {"streamvqa": replies.final_json(reply, request)}
                yield replies.sse_data(finished)
                if usage:
                    counted = _envelope(q, "chat.completion.chunk") | {"choices": [], "usage": _usage(reply)}
                    yield replies.sse_data(counted)
    except TimeoutError as e:
        yield replies.sse_data(errors.body(504, str(e)))
    except OUTAGE_ERRORS as e:  # the response has begun: say so in a chunk, not a cut connection
        yield replies.sse_data(errors.unavailable(e))
    yield replies.sse_data("[DONE]")
