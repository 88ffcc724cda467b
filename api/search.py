"""`GET /api/search?q=&stream=&since=&until=&limit=`: the cameras' past ranked by the model's own
retrieval features (README "Search"), answered by a worker through the question queue.

Each result is a moment: a camera's run of adjacent matching chunks (qa_worker/moments.py), its
capture-time range (unix seconds), frame seqs, how many chunks, and its score, its best chunk's
(the cosine of question and chunk, in [-1, 1], best first) with that chunk's range and seqs
(`best_*`); with the URLs of a snapshot (its thumbnail: the frame nearest the best chunk's middle)
and of the range's clip (a moment longer than a clip may be: its MAX_CLIP_S around the best
chunk), both served from the frames log (api/clips.py). A span with nothing
indexed gives an empty list; a bad parameter 400 naming it; a span the worker refuses from when the
search was asked (a `since` in the future, as a question's is) 422 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from api import errors, replies
from api.clips import clip_around, snapshot_path
from api.guard import require_token
from common.wire import keys
from common.wire.schemas import SchemaError, SearchHit
from common.wire.search_request import DEFAULT_LIMIT, MAX_LIMIT, SearchRequest, checked_search, encode_search
from common.wire.timeref import FORMS

router = APIRouter(prefix="/api", tags=["search"], dependencies=[Depends(require_token)])

PARAMS = {"search": "q"}  # the protocol's field -> this endpoint's parameter


@router.get("/search", summary="Search the cameras' past: time ranges ranked by the model, with thumbnails")
async def search(
    request: Request,
    q: Annotated[str, Query(description="what to look for: a question or a description")],
    stream: Annotated[str | None, Query(description="one camera; default: every camera")] = None,
    since: Annotated[str | None, Query(description="only chunks captured since: " + FORMS)] = None,
    until: Annotated[str | None, Query(description="only chunks captured until, same forms (default: now)")] = None,
    limit: Annotated[int, Query(description=f"results, 1..{MAX_LIMIT}")] = DEFAULT_LIMIT,
) -> dict[str, Any]:
    r, cfg = request.app.state.r, request.app.state.cfg
    if stream is not None:
        await replies.known_stream(r, stream)
    req = _request(q, stream=stream, since=since, until=until, limit=limit)
    sub = request.app.state.answers.open(req.id, cfg.answer_timeout_s)
    try:
        await r.xadd(keys.QUESTIONS, encode_search(req))
    except BaseException:
        sub.close()
        raise
    final = await replies.final_of(request, sub)
    if final.error is not None:
        raise errors.ApiError(422, final.error, param=PARAMS.get(final.param or "", final.param or "q"))
    results = [_result(hit) for hit in final.hits or ()]
    return {"q": q, "stream": stream, "results": results, "total_s": final.total_s, "elapsed_s": final.elapsed_s}


def _request(text: str, **options: Any) -> SearchRequest:
    """Checked by the parser the worker runs; 400 naming the parameter."""
    try:
        for name in ("since", "until"):
            if options[name] is not None:
                options[name] = replies._time_ref(name, options[name])
        return checked_search(text, **options)
    except SchemaError as e:
        param = PARAMS.get(e.field, e.field)
        raise errors.ApiError(400, f"{param}: {e.problem}", param=param) from None


def _result(hit: SearchHit) -> dict[str, Any]:
    best = (hit.best_start + hit.best_end) / 2
    clip = clip_around(hit.stream, hit.start, hit.end, best)
    return {**vars(hit), "thumbnail": snapshot_path(hit.stream, best), "clip": clip}
