"""A search on the wire: an entry of `svqa:questions` with `search` instead of `question`.

Fields: `id` (required, as a question's: it names the reply stream `svqa:answer:{id}`), `search`
(the text), optional `stream` (one camera; absent: every camera), `since` and `until` (a span, in
a question's forms: timeref.py), `limit` (ranges wanted, 1..100, default 10) and `reply_ttl`.
A QA process with the frames log answers it (no stream owner needed: the indexes are on disk); one
without forwards it to `svqa:searches`, which those with the log read (qa_worker/routing.py). Its
answer is one final entry whose `hits` are the ranked moments (`SearchHit`: a camera's adjacent
matching chunks, qa_worker/moments.py), best first; `text` is empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.wire.schemas import (
    MAX_QUESTION_CHARS,
    MAX_REPLY_TTL_S,
    QUESTION_ID_RE,
    SchemaError,
    _check_span,
    _get_field,
    _parse_int,
    _parse_time_ref,
    _require,
    _str,
    _text_fields,
    check_stream_name,
    new_question_id,
)
from common.wire.timeref import TimeRef

FIELD = "search"
DEFAULT_LIMIT = 10
MAX_LIMIT = 100
# asked: written by the forwarder to `svqa:searches` (qa_worker/routing.py), the search's entry id in
# `svqa:questions` (when it was asked)
_SEARCH_FIELDS = {"id", "search", "stream", "since", "until", "limit", "reply_ttl", "asked"}


@dataclass(frozen=True)
class SearchRequest:
    id: str
    text: str
    stream: str | None = None  # None: every camera
    since: TimeRef | None = None  # None: all the log holds
    until: TimeRef | None = None  # None: up to when it was asked
    limit: int = DEFAULT_LIMIT
    reply_ttl: int | None = None


def is_search(fields: Mapping[Any, Any]) -> bool:
    """Whether a `svqa:questions` entry is a search (it has `search`), not a question."""
    try:
        return _get_field(fields, FIELD) is not None
    except SchemaError:
        return False


def parse_search(fields: Mapping[Any, Any]) -> SearchRequest:
    """Validate a search entry; SchemaError naming the field."""
    f = _text_fields(fields, MAX_QUESTION_CHARS * 4, _SEARCH_FIELDS)
    kw: dict[str, Any] = {"id": _str("id", _require(f, "id"), 128, QUESTION_ID_RE)}
    kw["text"] = _str(FIELD, _require(f, FIELD), MAX_QUESTION_CHARS)
    if not kw["text"].strip():
        raise SchemaError(FIELD, "empty")
    if "stream" in f:
        kw["stream"] = check_stream_name("stream", f["stream"])
    for name in ("since", "until"):
        if name in f:
            kw[name] = _parse_time_ref(name, f[name])
    _check_span(kw.get("since"), kw.get("until"), None)
    if "limit" in f:
        kw["limit"] = _parse_int("limit", f["limit"], 1, MAX_LIMIT)
    if "reply_ttl" in f:
        kw["reply_ttl"] = _parse_int("reply_ttl", f["reply_ttl"], 1, MAX_REPLY_TTL_S)
    return SearchRequest(**kw)


def encode_search(req: SearchRequest) -> dict[str, str]:
    """Fields for XADD to ``keys.QUESTIONS``."""
    out = {"id": req.id, FIELD: req.text, "limit": str(req.limit)}
    if req.stream is not None:
        out["stream"] = req.stream
    out |= {name: str(ref) for name, ref in (("since", req.since), ("until", req.until)) if ref is not None}
    if req.reply_ttl is not None:
        out["reply_ttl"] = str(req.reply_ttl)
    return out


def checked_search(text: str, **options: Any) -> SearchRequest:
    """A new search (a random id) as a worker will read it: SchemaError for what it would refuse."""
    req = SearchRequest(id=options.pop("id", None) or new_question_id(), text=text, **options)
    return parse_search(encode_search(req))
