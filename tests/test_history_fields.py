"""`since` and `until` wherever a question is asked: the Redis protocol (redis-cli, as any client
writes it, on a real redis-server), `streamvqa ask --since`, `POST /api/streams/{cam}/ask` and the
OpenAI endpoint's extension fields. Each takes seconds before asking (90, 90s, 15m, 1h, 2h30m,
1d) or an ISO 8601 time with its UTC offset, and refuses anything else with a clear error naming
the field, before anything is queued."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from datetime import UTC, datetime

import httpx
import pytest
import redis

from common.wire import keys
from common.wire.schemas import Question, SchemaError, checked_question, encode_question, parse_question
from common.wire.timeref import TimeRef, parse_time_ref

NOON = datetime(2026, 11, 28, 12, 0, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("3600", TimeRef(ago_s=3600.0)),
        ("90.5", TimeRef(ago_s=90.5)),
        ("90s", TimeRef(ago_s=90.0)),
        ("15m", TimeRef(ago_s=900.0)),
        ("1h", TimeRef(ago_s=3600.0)),
        ("2h30m", TimeRef(ago_s=9000.0)),
        ("1d2h", TimeRef(ago_s=93_600.0)),
        (" 1H ", TimeRef(ago_s=3600.0)),
        ("2026-11-28T12:00:00Z", TimeRef(at=NOON)),
        ("2026-11-28T13:30:00+01:30", TimeRef(at=NOON)),
        ("2026-11-28T12:00:00.250+00:00", TimeRef(at=NOON + 0.25)),
        ("0.00005", TimeRef(ago_s=5e-05)),  # its wire text is not 5e-05, which no form reads
    ],
)
def test_a_span_edge_is_seconds_before_asking_or_a_time(text, ref):
    assert parse_time_ref(text) == ref
    assert parse_time_ref(str(ref)) == ref, "its wire text reads back the same"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("2026-11-28T12:00:00", "no UTC offset"),
        ("2026-11-28", "no UTC offset"),
        ("-5", "expected seconds before now"),
        ("1h30", "expected seconds before now"),
        ("yesterday", "expected seconds before now"),
        ("", "empty"),
        ("9" * 70, "too long"),
        ("4000d", "more than ten years"),
        ("0001-01-01T00:00:00+14:00", "years 1 to 9999"),  # in UTC, year 0: no wire text for it
        ("9999-12-31T23:59:59-14:00", "years 1 to 9999"),
    ],
)
def test_anything_else_is_refused_saying_what_is_taken(text, says):
    with pytest.raises(ValueError, match=says):
        parse_time_ref(text)


def test_a_json_number_is_seconds_as_it_is():
    """The API hands a JSON number over as it is: 5e-05 is 50 microseconds, not text no form reads,
    and 1.2e19 (what the JSON integer 12345678901234567890 becomes) more than ten years."""
    from api import errors, replies

    assert replies.question("cam1", "what?", since=5e-05).since == TimeRef(ago_s=5e-05)
    for value, says in ((1.2345678901234567e19, "more than ten years"), (math.nan, "expected seconds")):
        with pytest.raises(errors.ApiError, match=says) as e:
            replies.question("cam1", "what?", since=value)
        assert e.value.param == "since"


@pytest.mark.parametrize(
    ("since", "until", "taken_s", "field", "says"),
    [
        (TimeRef(ago_s=0.0), None, 0.05, "since", "the span is empty"),  # no until: since is what is wrong
        (TimeRef(at=NOON + 10), None, 20.0, "since", "in the future"),  # in the future when asked, taken later
        (TimeRef(at=NOON + 10), TimeRef(at=NOON + 30), 40.0, "since", "in the future"),  # wholly after the asking
        (TimeRef(ago_s=60.0), TimeRef(ago_s=120.0), 1.0, "until", "the span is empty"),
    ],
)
def test_a_span_is_judged_from_when_it_was_asked_and_blames_the_field_at_fault(since, until, taken_s, field, says):
    from qa_worker.history import HistoryError, span_of

    q = Question(id="q1", stream="cam1", question="what?", since=since, until=until)
    with pytest.raises(HistoryError, match=says) as e:
        span_of(q, asked_at=NOON, now=NOON + taken_s)
    assert e.value.param == field


def test_an_edge_counts_back_from_when_the_question_was_asked():
    assert TimeRef(ago_s=60).resolve(asked_at=1000.0) == 940.0
    assert TimeRef(at=NOON).resolve(asked_at=1000.0) == NOON


def test_since_and_until_travel_in_a_question():
    q = checked_question("cam1", "when did the van arrive?", since=parse_time_ref("2h"), until=parse_time_ref("1h"))
    fields = encode_question(q)
    assert (fields["since"], fields["until"]) == ("7200.0", "3600.0")
    assert parse_question(fields) == q
    assert "since" not in encode_question(checked_question("cam1", "hi")), "without since: the live cache"


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"since": "soon"}, "since", "expected seconds before now"),
        ({"until": "1h"}, "until", "needs since"),
        ({"since": "2h", "at": "3"}, "at", "not both"),
        ({"since": "1h", "until": "2h"}, "until", "later than since"),
        ({"since": "1h", "until": "1h"}, "until", "later than since"),
        ({"since": "2026-11-28T12:00:00Z", "until": "2026-11-28T11:00:00Z"}, "until", "later than since"),
        ({"since": "2026-11-28T12:00:00"}, "since", "no UTC offset"),
    ],
)
def test_a_span_that_cannot_be_is_a_schema_error_naming_its_field(fields, field, says):
    with pytest.raises(SchemaError, match=f"^{field}: .*{says}"):
        parse_question({"id": "q1", "stream": "cam1", "question": "what?", **fields})


def test_redis_cli_asks_about_the_past(redis_url, redis_cli):
    add = [redis_cli, "-u", redis_url, "XADD", keys.QUESTIONS, "*", "id", "q-1", "stream", "cam1"]
    span = ["since", "2026-11-28T02:00:00+01:00", "until", "30m"]
    subprocess.run([*add, "question", "what happened at the gate?", *span], check=True, capture_output=True)
    ((_, fields),) = redis.Redis.from_url(redis_url).xrange(keys.QUESTIONS)
    q = parse_question(fields)
    assert q.since == TimeRef(at=datetime(2026, 11, 28, 1, 0, tzinfo=UTC).timestamp())
    assert q.until == TimeRef(ago_s=1800.0)


def cli_ask(redis_url: str, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`streamvqa ask` with nobody answering: it queues the question and times out (exit 1)."""
    with redis.Redis.from_url(redis_url) as r:
        r.hset(keys.meta("cam1"), "fps", "2")  # the stream exists
    argv = [sys.executable, "-m", "apps.cli", "ask", "--stream", "cam1", "--timeout", "0.3", "--redis-url", redis_url]
    return subprocess.run([*argv, *flags, "what happened?"], capture_output=True, text=True, timeout=60, env=env)


def test_streamvqa_ask_since_and_until(redis_url):
    out = cli_ask(redis_url, "--since", "1h", "--until", "30m")
    assert out.returncode == 1 and "no answer" in out.stderr, out.stderr
    ((_, fields),) = redis.Redis.from_url(redis_url).xrange(keys.QUESTIONS)
    assert (fields[b"since"], fields[b"until"]) == (b"3600.0", b"1800.0")


def test_streamvqa_ask_reads_a_time_without_offset_as_the_machines_own(redis_url):
    out = cli_ask(redis_url, "--since", "2026-11-28T02:00", env={**os.environ, "TZ": "EST+5"})  # UTC-5
    assert out.returncode == 1, out.stderr
    ((_, fields),) = redis.Redis.from_url(redis_url).xrange(keys.QUESTIONS)
    assert fields[b"since"] == b"2026-11-28T07:00:00+00:00"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--since", "yesterday"], "since: expected seconds before now"),
        (["--until", "1h"], "until: needs since"),
        (["--since", "9999-12-31T23:59:59-14:00"], "since: '9999-12-31T23:59:59-14:00' is not a time of the years"),
    ],
)
def test_streamvqa_ask_refuses_a_bad_span_before_queueing_it(redis_url, flags, says):
    out = cli_ask(redis_url, *flags)
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert redis.Redis.from_url(redis_url).xlen(keys.QUESTIONS) == 0


def test_the_http_api_takes_since_and_until_and_refuses_a_bad_span(redis_url):
    """`POST /api/streams/{cam}/ask` and, as extension fields, `/v1/chat/completions` (OpenAI's
    client sends them with extra_body): seconds as a number or the protocol's text. A bad span is
    400 naming the field, with nothing queued; a good one is queued as the worker reads it."""
    from openai import OpenAI

    from api.config import ApiConfig
    from tests.test_api import assert_error, served

    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("cam1"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})
    ask, chat = "/api/streams/cam1/ask", "/v1/chat/completions"
    asked = {"model": "cam1", "messages": [{"role": "user", "content": "what happened?"}]}
    with served(ApiConfig(redis_url=redis_url, answer_timeout_s=0.3)) as base, httpx.Client(base_url=base) as http:
        for body, field in (
            ({"since": "yesterday"}, "since"),
            ({"since": -5}, "since"),
            ({"since": True}, "since"),
            ({"until": "1h"}, "until"),
            ({"since": "1h", "until": 7200}, "until"),
            ({"since": "2026-11-28T02:00:00"}, "since"),
            ({"since": "0001-01-01T00:00:00+14:00"}, "since"),  # was a 500: no UTC year 0 to write
        ):
            assert_error(http.post(ask, json={"question": "what happened?", "stream": False} | body), 400, field)
            assert_error(http.post(chat, json=asked | body), 400, field)
        assert r.xlen(keys.QUESTIONS) == 0
        assert http.post(ask, json={"question": "q", "stream": False, "since": 5400, "until": "30m"}).status_code == 504
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(Exception, match="no final answer"):
            client.chat.completions.create(**asked, extra_body={"since": "2026-11-28T01:00:00Z"})
    (_, native), (_, openai) = r.xrange(keys.QUESTIONS)
    assert (native[b"since"], native[b"until"]) == (b"5400.0", b"1800.0")
    assert openai[b"since"] == b"2026-11-28T01:00:00+00:00" and b"until" not in openai
