"""`POST /api/streams/{name}/ask`: a question answered as server-sent events or as one JSON object.

Events: `queued` ({"position", "waited_s"}) about once every `block_ms` while the question waits
in its stream's queue (position 1: next to be taken), then, once a worker has taken it, whenever
the worker tells it its place while it waits for the GPU ({"position", "waited_s", "wait_s"}:
position 1 is next to start, `wait_s` the estimated wait, null until the worker has measured how
fast it answers), `delta` ({"text"}) as tokens are decoded,
then one `final` (the worker's final answer: text or choice and scores, version, t_start/t_end,
queue_s, elapsed_s and the compute latencies), or `error` when none came in time. With `since`
(and `until`) the question is about that past span, answered from the frames log; its final's
`ranges` are the capture times of the chunks it was answered over.
`restart` ({"attempt"}) says the worker answering died and another starts over: drop the text so
far; the deltas after it concatenate to the final text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from api import errors, replies
from api.answers import Subscription
from api.guard import require_token
from common.redisio import OUTAGE_ERRORS
from common.wire.schemas import AnswerDelta, FinalAnswer, Question

router = APIRouter(prefix="/api", tags=["ask"], dependencies=[Depends(require_token)])


class AskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(description="what to ask about the stream's video so far")
    max_tokens: Annotated[int | None, replies.NotBool] = Field(None, description="1..2048; the worker's default")
    temperature: Annotated[float | None, replies.NotBool] = Field(None, description="0 = greedy (default)")
    top_p: Annotated[float | None, replies.NotBool] = None
    choices: list[str] | None = Field(None, description="multiple choice: the answer is one of these, with scores")
    at: Annotated[int | Literal["latest"] | None, replies.NotBool] = Field(
        None, description="a cache version id, or latest (default)"
    )
    since: Annotated[float | str | None, replies.NotBool] = Field(None, description=replies.SINCE_HELP)
    until: Annotated[float | str | None, replies.NotBool] = Field(None, description=replies.UNTIL_HELP)
    scope: Literal["live", "history"] | None = Field(
        None,
        description="history: answered over the camera's past chunks that rank best for the question (within "
        "since/until if given), read back from the frames log; default live",
    )
    stream: bool = Field(True, description="server-sent events (default) or one JSON object")


# The question fields a worker's refusal may name, by this request's own names (a "stream" it names is
# the unknown stream, as known_stream names it); one it names no field for is null, not "question":
# the refusal is then about no field, a span the frames log lacks, say.
_ASK_FIELDS = {name: name for name in AskRequest.model_fields}


@router.post(
    "/streams/{name}/ask",
    responses={200: {"content": {"text/event-stream": {}, "application/json": {}}}},
    summary="Ask a question about a stream (SSE: delta events, then final)",
)
async def ask(name: str, body: AskRequest, request: Request):
    r, cfg = request.app.state.r, request.app.state.cfg
    await replies.known_stream(r, name)
    at = None if body.at == "latest" else body.at
    options = body.model_dump(exclude={"question", "stream", "at"})
    q = replies.question(name, body.question, at=at, **options)
    sub = await replies.ask(request, q)
    headers = {"X-Question-Id": q.id}
    if body.stream:
        return StreamingResponse(
            replies.keep_alive(_events(request, q, sub), cfg.keep_alive_s),
            media_type="text/event-stream",
            headers=headers,
        )
    final = await replies.final_of(request, sub)
    if final.error is not None:
        param = replies.refused_param(final, _ASK_FIELDS)
        return errors.response(422, final.error, param=param, headers=headers)
    return JSONResponse(replies.final_json(final, request), headers=headers)


async def _events(request: Request, q: Question, sub: Subscription) -> AsyncIterator[bytes]:
    r, cfg = request.app.state.r, request.app.state.cfg
    asked, started = time.monotonic(), False
    try:
        stream = replies.replies(sub, cfg.answer_timeout_s, cfg.block_ms)
        async for reply, restarted in replies.newest_attempt(stream):
            if reply is None:  # nothing yet: where it waits, while no worker has taken it
                if not started and (position := await replies.queue_position(r, q.stream, q.id)) is not None:
                    yield replies.sse("queued", {"position": position, "waited_s": round(time.monotonic() - asked, 1)})
                continue
            started = True  # a worker has taken it: no longer in its stream's queue
            if restarted:
                yield replies.sse("restart", {"attempt": reply.attempt})
            if isinstance(reply, AnswerDelta) and reply.position is not None:
                waited = round(time.monotonic() - asked, 1)
                yield replies.sse("queued", {"position": reply.position, "waited_s": waited, "wait_s": reply.wait_s})
            elif isinstance(reply, AnswerDelta):
                yield replies.sse("delta", {"text": reply.text})
            elif isinstance(reply, FinalAnswer):
                yield replies.sse("final", replies.final_json(reply, request))
    except TimeoutError as e:
        yield replies.sse("error", errors.body(504, str(e)))
    except OUTAGE_ERRORS as e:  # the response has begun: say so in an event, not a cut connection
        yield replies.sse("error", errors.unavailable(e))
