"""`streamvqa api` and its web page against a live pipeline: generated H.264 -> ingest -> worker
(tiny-random, with subtitle, caption and alert jobs) -> Redis -> the API, all real processes; the
page driven in headless Chromium. One pipeline for the whole module (it is the slow part).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from PIL import Image

from apps.samplevideo import write_sample_video
from common.lease import holder_name
from common.wire import keys
from common.wire.schemas import FinalAnswer, encode_delta, encode_final
from tests.alerting import Broker, Webhook, broker, webhook
from tests.conftest import RedisServer, free_port
from tests.pipeline import Services, head, reading_questions, wait_for
from tests.subtitle_readers import validate_srt, validate_webvtt

CAM = "cam1"
TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FRAMES = 12  # 6 s at 2 fps
JOB_WAIT_S = 300  # for a job's output: a 128-token answer after each version, minutes on a loaded 2-core machine
REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("SVQA_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@dataclass
class Live:
    base: str
    redis_url: str
    r: redis.Redis
    http: httpx.Client
    services: Services
    hook: Webhook
    mq: Broker


def cameras_file(path: Path, video: str, hook: Webhook, mq: Broker) -> Path:
    jobs = [
        {"name": "subs", "stream": CAM, "kind": "subtitles", "every_versions": 1},
        {"name": "captions", "stream": CAM, "kind": "caption", "every_versions": 2},
        # threshold 0: tiny-random's P(yes) is arbitrary, so the alert fires on its first run, once
        {
            "name": "door",
            "stream": CAM,
            "kind": "alert",
            "prompt": "Is there text on the screen?",
            "every_versions": 1,
            "threshold": 0.0,
            "webhook": hook.url,
            "mqtt": mq.url,
        },
    ]
    path.write_text(yaml.safe_dump({"cameras": [{"name": CAM, "url": video, "fps": 2}], "jobs": jobs}))
    return path


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    workdir = tmp_path_factory.mktemp("api")
    server = RedisServer(workdir)
    server.start()
    with webhook(fail_first=2) as hook, broker(workdir) as mq:
        video = write_sample_video(str(workdir / "clip.mp4"), seconds=6, fps=10, width=160, height=120)
        cams = cameras_file(workdir / "cameras.yaml", video, hook, mq)
        services = Services(server.url, workdir, SVQA_CAMERAS_FILE=str(cams))
        port = free_port()
        # keep-alive comments every 50 ms: every client here (the page, openai, httpx) must skip them
        services.start("api", "--port", str(port), SVQA_API_TOKEN=TOKEN, SVQA_API_KEEP_ALIVE_S="0.05")
        services.start("worker", SVQA_BLOCK_MS="100")
        r = redis.Redis.from_url(server.url)
        # Frames only once the worker's loop runs (its jobs look every step): subtitle cues need
        # the job to see more than the last of the clip's three versions.
        wait_for(lambda: reading_questions(r), 120, "the worker reading questions", services)
        ingest = services.start("ingest")
        base = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(base_url=base, headers=AUTH, timeout=60) as http:
                wait_for(lambda: _ready(http), 60, "the API ready", services)
                assert ingest.wait(timeout=120) == 0, services.logs()
                wait_for(lambda: (h := head(r, CAM)) and h.last_frame_seq == FRAMES - 1, 120, "frames", services)
                yield Live(base, server.url, r, http, services, hook, mq)
        finally:
            services.stop_all()
            server.stop()


def _ready(http: httpx.Client) -> bool:
    try:
        return http.get("/health/ready").status_code == 200
    except httpx.TransportError:
        return False


def sse_events(response: httpx.Response) -> list[tuple[str, dict | str]]:
    return _parse_sse(response.iter_lines())


def _reading_answers(r: redis.Redis) -> bool:
    """Whether a client (the API's answer reader) is blocked in XREAD."""
    return any(c["cmd"] == "xread" and "b" in c["flags"] for c in r.client_list())


def _parse_sse(lines: Iterable[str] | str) -> list[tuple[str, dict | str]]:
    events, name, data = [], "message", ""
    for line in lines.splitlines() if isinstance(lines, str) else lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data += line[6:]
        elif not line and data:
            events.append((name, data if data == "[DONE]" else json.loads(data)))
            name, data = "message", ""
    return events


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape, its `code` a string (OpenAI's clients read it as one)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert isinstance(error["code"], str) and error["code"] and error["message"] and error["type"], error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# ----------------------------------------------------------------------------- streams


def test_streams_status_and_events(live):
    found = live.http.get("/api/streams").json()
    (cam,) = found["streams"]
    h = head(live.r, CAM)
    assert cam["stream"] == CAM and cam["grid"] and cam["lease"]["holder"]
    assert cam["head"]["version"] >= h.version - 1 and cam["head"]["tokens"] > 0
    assert cam["head"]["last_frame_seq"] == FRAMES - 1
    assert cam["head"]["time_range"][1] == pytest.approx(5.5)
    assert cam["state"] == "eof" and cam["connected"] is False, "the file ended: its last ingest event is eof"
    assert cam["dropped"] == 0 and cam["head"]["lag_s"] is None  # a file: no wall-clock lag
    assert found["questions"]["consumers"] >= 1
    (worker,) = found["workers"]  # the same placement section as `streamvqa status`
    assert worker["worker"] == cam["lease"]["holder"] and worker["streams"] == [CAM] and worker["load"] == 1
    assert live.http.get(f"/api/streams/{CAM}").json()["head"]["tokens"] > 0
    kinds = [e["type"] for e in live.http.get(f"/api/streams/{CAM}/events").json()["events"]]
    assert "connected" in kinds and kinds[-1] in ("eof", "eos", "encoder_attached")
    assert_error(live.http.get("/api/streams/nope"), 404, "stream")
    assert_error(live.http.get("/api/streams/bad:name"), 400, "stream")


def test_latest_frame_is_a_jpeg_of_the_model_grid(live):
    response = live.http.get(f"/api/streams/{CAM}/frame.jpg")
    assert response.status_code == 200 and response.headers["content-type"] == "image/jpeg"
    assert response.headers["cache-control"] == "no-store"
    assert int(response.headers["x-frame-seq"]) == FRAMES - 1, "a file's last frame is kept at its end"
    image = Image.open(io.BytesIO(response.content))
    meta = live.r.hgetall(keys.meta(CAM))
    assert image.size == (int(meta[b"width"]), int(meta[b"height"]))
    assert 0 < live.r.ttl(keys.latest_frame(CAM)) <= 3600
    assert_error(live.http.get("/api/streams/nope/frame.jpg"), 404)


# ----------------------------------------------------------------------------- ask


def test_ask_streams_deltas_that_concatenate_to_the_final_answer(live):
    body = {"question": "What is written on the screen?", "max_tokens": 12}
    with live.http.stream("POST", f"/api/streams/{CAM}/ask", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    waiting = [e for e in events if e[0] == "queued"]  # while it waited in the stream's queue: first
    assert events[: len(waiting)] == waiting and all(d["position"] >= 1 for _, d in waiting)
    *deltas, (kind, final) = events[len(waiting) :]
    assert kind == "final" and final["error"] is None, final
    assert deltas and all(k == "delta" for k, _ in deltas)
    assert "".join(d["text"] for _, d in deltas) == final["text"]
    assert 1 <= final["tokens"] <= 12 and final["t_end"] == pytest.approx(5.5) and final["first_token_s"] > 0
    assert final["queue_s"] >= 0 and final["elapsed_s"] >= final["queue_s"] + final["total_s"] - 0.002, final
    # the same question, non-streaming, `at` the version it saw: greedy decoding gives the same text
    again = live.http.post(f"/api/streams/{CAM}/ask", json=body | {"stream": False, "at": final["version"]}).json()
    assert again["text"] == final["text"] and again["version"] == final["version"]


def test_multiple_choice(live):
    body = {"question": "Is the ball red?", "choices": ["yes", "no"], "stream": False}
    final = live.http.post(f"/api/streams/{CAM}/ask", json=body).json()
    assert final["choice"] in ("yes", "no") and set(final["scores"]) == {"yes", "no"}
    assert final["choice"] == max(final["scores"], key=final["scores"].get)


def test_bad_questions_get_4xx_json(live):
    url = f"/api/streams/{CAM}/ask"
    assert_error(live.http.post(url, json={}), 400, "question")
    assert_error(live.http.post(url, json={"question": "x", "max_tokens": 0}), 400, "max_tokens")
    assert_error(live.http.post(url, json={"question": "x", "choices": ["only one"]}), 400, "choices")
    assert_error(live.http.post(url, json={"question": "x", "bogus": 1}), 400, "bogus", "unknown_parameter")
    assert_error(live.http.post(url, json={"question": "x", "at": True}), 400, "at")  # not version 1
    assert_error(live.http.post(url, json={"question": "x", "max_tokens": True}), 400, "max_tokens")
    assert_error(live.http.post(url, json={"question": "   "}), 400, "question")
    assert_error(live.http.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(live.http.post("/api/streams/nope/ask", json={"question": "x"}), 404, "stream")
    # a version the worker does not hold: the worker's error comes back as 422
    assert_error(live.http.post(url, json={"question": "x", "at": 10**9, "stream": False}), 422, "at")
    assert_error(live.http.post(url, json={"question": "x" * 70_000}), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it streams in
        yield b'{"question": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}'

    assert_error(live.http.post(url, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert_error(live.http.get("/no/such/route"), 404)
    assert_error(live.http.get(url), 405)


def test_token_required_when_configured(live):
    for path in ("/api/streams", "/v1/models", f"/api/streams/{CAM}/frame.jpg"):
        error = assert_error(httpx.get(live.base + path), 401)
        assert error["type"] == "authentication_error"
    wrong = httpx.get(live.base + "/api/streams", headers={"Authorization": "Bearer wrong-token-0000000000"})
    assert_error(wrong, 401)
    assert wrong.headers["www-authenticate"] == "Bearer"
    assert httpx.get(live.base + "/health/live").status_code == 200  # probes need no token
    assert httpx.get(live.base + "/").status_code == 200  # nor the page itself (it asks for the token)


# ----------------------------------------------------------------------------- OpenAI


def test_openai_client_lists_streams_and_asks(live):
    from openai import OpenAI

    client = OpenAI(base_url=live.base + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [CAM]
    question = [{"role": "system", "content": "ignored"}, {"role": "user", "content": "What do you see?"}]
    done = client.chat.completions.create(model=CAM, messages=question, max_tokens=10)
    assert done.model == CAM and done.choices[0].finish_reason == "length"
    assert done.choices[0].message.role == "assistant" and done.usage.completion_tokens == 10
    text = done.choices[0].message.content
    assert text
    chunks = list(client.chat.completions.create(model=CAM, messages=question, max_tokens=10, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text  # greedy: same text
    assert chunks[-1].choices[0].finish_reason == "length" and not any(c.usage for c in chunks)
    counted = list(
        client.chat.completions.create(
            model=CAM, messages=question, max_tokens=10, stream=True, stream_options={"include_usage": True}
        )
    )  # as OpenAI: usage only when asked, in a last chunk of no choices
    assert counted[-1].choices == [] and counted[-1].usage.completion_tokens == 10
    assert counted[-2].choices[0].finish_reason == "length" and not any(c.usage for c in counted[:-1])
    with pytest.raises(Exception) as unknown:
        client.chat.completions.create(model="nope", messages=question)
    assert getattr(unknown.value, "status_code", None) == 404


def test_openai_bad_requests(live):
    url = "/v1/chat/completions"
    assert_error(live.http.post(url, json={"model": CAM, "messages": []}), 400, "messages")
    assert_error(live.http.post(url, json={"model": CAM, "messages": [{"role": "system", "content": "x"}]}), 400)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    assert_error(live.http.post(url, json={"model": CAM, "messages": image}), 400, "messages")
    asked = {"model": CAM, "messages": [{"role": "user", "content": "x"}]}
    assert_error(live.http.post(url, json=asked | {"n": 2}), 400)
    assert_error(live.http.post(url, json=asked | {"n": True}), 400, "n")


def test_openai_client_retrieves_models_and_reads_openai_errors(redis_url):
    """The real openai client: models.retrieve works (was 404); an unknown model is OpenAI's
    not-found (param "model", code "model_not_found"); empty messages and every parameter the API
    cannot honour are 400 naming the field (tools and response_format were silently ignored).
    None of them queues a question."""
    from openai import BadRequestError, NotFoundError, OpenAI

    from api.config import ApiConfig

    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("ghost"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})
    asked = [{"role": "user", "content": "Is the door open?"}]
    tool = {"type": "function", "function": {"name": "open_door", "parameters": {"type": "object"}}}
    refused = {"tools": [tool], "response_format": {"type": "json_object"}, "stop": ["."], "logprobs": True}
    with served(ApiConfig(redis_url=redis_url)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert client.models.retrieve("ghost").id == "ghost"
        for call in (
            lambda: client.models.retrieve("nope"),
            lambda: client.chat.completions.create(model="nope", messages=asked),
        ):
            with pytest.raises(NotFoundError) as missing:
                call()
            assert (missing.value.code, missing.value.param) == ("model_not_found", "model"), missing.value.body
        with pytest.raises(BadRequestError) as empty:
            client.chat.completions.create(model="ghost", messages=[])
        assert empty.value.param == "messages" and isinstance(empty.value.code, str)
        for name, value in refused.items():
            with pytest.raises(BadRequestError) as unsupported:
                client.chat.completions.create(model="ghost", messages=asked, **{name: value})
            assert (unsupported.value.param, unsupported.value.code) == (name, "unsupported_parameter")
    assert r.xlen(keys.QUESTIONS) == 0


def test_openai_refusals_of_the_question_name_the_fields_the_client_sent(redis_url):
    """A last user message of blanks or over the question's length, and max_completion_tokens 0:
    400 naming "messages" and "max_completion_tokens", in param and message (they named "question"
    and "max_tokens", fields a chat request has not). None of them queues a question."""
    from openai import BadRequestError, OpenAI

    from api.config import ApiConfig

    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("ghost"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})
    asked = [{"role": "user", "content": "Is the door open?"}]
    refused = [
        ({"messages": [{"role": "user", "content": "   "}]}, "messages", "the last user message: "),
        ({"messages": [{"role": "user", "content": "x" * 4001}]}, "messages", "the last user message: "),
        ({"messages": asked, "max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens: "),
    ]
    with served(ApiConfig(redis_url=redis_url)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        for request, param, said in refused:
            with pytest.raises(BadRequestError) as bad:
                client.chat.completions.create(model="ghost", **request)
            assert bad.value.param == param and bad.value.body["message"].startswith(said), bad.value.body
    assert r.xlen(keys.QUESTIONS) == 0


def _answering_worker(redis_url: str, questions: int) -> threading.Thread:
    """A worker for stream "ghost" that answers the first ``questions`` questions "The door is open."."""
    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("ghost"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})

    def worker() -> None:
        for n in range(questions):
            qid = wait_for(lambda n=n: (q := r.xrange(keys.QUESTIONS)) and len(q) > n and q[n][1][b"id"], 20, "q")
            final = FinalAnswer(id=qid.decode(), stream="ghost", text="The door is open.", tokens=5)
            r.xadd(keys.answer(qid.decode()), encode_final(final))

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    return thread


def test_openai_client_sends_what_replaces_user_and_is_answered(redis_url):
    """OpenAI's client deprecates `user` for safety_identifier and prompt_cache_key; with them, and
    the prompt cache's retention and options, a question is answered as with `user` (all four were
    refused with 400: bookkeeping and caching hints, nothing the answer could honour or break)."""
    from openai import OpenAI

    from api.config import ApiConfig

    sent = {
        "safety_identifier": "a1b2c3",
        "prompt_cache_key": "door",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"ttl": "1h"},
    }
    asked = [{"role": "user", "content": "Is the door open?"}]
    thread = _answering_worker(redis_url, len(sent))
    with served(ApiConfig(redis_url=redis_url, answer_timeout_s=20)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        for name, value in sent.items():
            done = client.chat.completions.create(model="ghost", messages=asked, **{name: value})
            assert done.choices[0].message.content == "The door is open.", name
    thread.join(10)


def test_openai_conversation_must_end_with_the_question(redis_url):
    """A conversation ending with the assistant's turn (continue it) or a tool's result (go on from
    it) is 400 naming messages, nothing queued: it was answered as the user message before them,
    again. Instructions after the question are not sent, as before: still answered."""
    from openai import BadRequestError, OpenAI

    from api.config import ApiConfig

    asked = {"role": "user", "content": "Is the door open?"}
    call = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    ended_by_other = [
        [asked, {"role": "assistant", "content": "The door is"}],
        [
            asked,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "open"},
        ],
    ]
    thread = _answering_worker(redis_url, 1)
    with served(ApiConfig(redis_url=redis_url, answer_timeout_s=20)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        for messages in ended_by_other:
            with pytest.raises(BadRequestError) as bad:
                client.chat.completions.create(model="ghost", messages=messages)
            assert bad.value.param == "messages" and messages[-1]["role"] in bad.value.body["message"]
        assert redis.Redis.from_url(redis_url).xlen(keys.QUESTIONS) == 0
        instructed = [asked, {"role": "developer", "content": "Answer in one word."}]
        done = client.chat.completions.create(model="ghost", messages=instructed)
        assert done.choices[0].message.content == "The door is open."
    thread.join(10)


def test_openai_content_of_the_wrong_kind_names_the_content(redis_url):
    """A message's content that is neither text nor a list of parts: 400 naming
    `messages.{i}.content`, the field sent (it named `messages.{i}.content.str`, a union's member)."""
    from openai import BadRequestError, OpenAI

    from api.config import ApiConfig

    redis.Redis.from_url(redis_url).hset(keys.meta("ghost"), mapping={"fps": "2", "height": "56", "width": "56"})
    with served(ApiConfig(redis_url=redis_url)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        for content in (5, {"text": "Is the door open?"}, ["Is the door open?"]):
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
            with pytest.raises(BadRequestError) as bad:
                client.chat.completions.create(model="ghost", messages=messages)
            assert bad.value.param == "messages.1.content", bad.value.body


def test_openai_top_p_zero_keeps_the_top_token(live):
    """OpenAI's range for top_p includes 0 (the top token only): asked so, the answer is the greedy one."""
    question = {"model": CAM, "messages": [{"role": "user", "content": "What do you see?"}], "max_tokens": 6}
    sampled = live.http.post("/v1/chat/completions", json=question | {"temperature": 1.0, "top_p": 0}, timeout=60)
    greedy = live.http.post("/v1/chat/completions", json=question, timeout=60)
    assert sampled.status_code == greedy.status_code == 200, sampled.text
    assert sampled.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]


# ----------------------------------------------------------------------------- jobs, transcript, alerts


def test_transcript_in_json_vtt_and_srt(live):
    wait_for(lambda: live.r.xlen(keys.transcript(CAM)), JOB_WAIT_S, "a subtitle cue", live.services)
    cues = live.http.get(f"/api/streams/{CAM}/transcript").json()["cues"]
    assert cues and all(c["job"] == "subs" and float(c["end"]) > float(c["start"]) for c in cues)
    vtt = live.http.get(f"/api/streams/{CAM}/transcript", params={"format": "vtt"})
    assert vtt.headers["content-type"].startswith("text/vtt")
    validate_webvtt(vtt.text)
    srt = live.http.get(f"/api/streams/{CAM}/transcript", params={"format": "srt"})
    validate_srt(srt.text)
    assert srt.text.count("-->") == vtt.text.count("-->") == len(cues)
    assert_error(live.http.get(f"/api/streams/{CAM}/transcript", params={"format": "doc"}), 400, "format")


def test_caption_job_outputs(live):
    wait_for(lambda: live.r.xlen(keys.job_output(CAM, "captions")), JOB_WAIT_S, "a caption", live.services)
    assert live.http.get(f"/api/streams/{CAM}/jobs").json()["jobs"] == ["captions"]
    outputs = live.http.get(f"/api/streams/{CAM}/jobs/captions", params={"count": 5}).json()["outputs"]
    assert outputs and all(o["job"] == "captions" and "text" in o and int(o["version"]) >= 0 for o in outputs)
    assert_error(live.http.get(f"/api/streams/{CAM}/jobs/nope"), 404, "job", "job_not_found")


def test_alert_fires_once_and_is_delivered_to_webhook_and_mqtt(live):
    wait_for(lambda: live.hook.accepted and live.mq.messages, JOB_WAIT_S, "alert delivered", live.services)
    (alert,) = live.http.get(f"/api/streams/{CAM}/alerts").json()["alerts"]
    assert live.http.get("/api/alerts").json()["alerts"] == [alert]
    assert alert["job"] == "door" and alert["question"] == "Is there text on the screen?"
    assert 0.0 <= float(alert["score"]) <= 1.0 and float(alert["t_end"]) > float(alert["t_start"])
    # the receiver failed twice: three tries of the same alert, then exactly one accepted
    assert [body["id"] for _, body in live.hook.requests] == [alert["id"]] * 3
    assert {headers["Idempotency-Key"] for headers, _ in live.hook.requests} == {alert["id"]}
    assert [a["id"] for a in live.hook.accepted] == [m["id"] for m in live.mq.messages] == [alert["id"]]
    # one JSON shape for the API, the webhook and MQTT: numbers as numbers, the frame a URL; the API
    # adds whether someone acknowledged it
    told = {k: v for k, v in alert.items() if k != "acked"}
    assert live.hook.accepted == live.mq.messages == [told] and alert["acked"] is None
    assert isinstance(alert["score"], float) and isinstance(alert["version"], int) and alert["at_iso"]
    frame = live.http.get(alert["frame"])
    assert frame.status_code == 200 and frame.content[:2] == b"\xff\xd8"
    assert "s3cr3t" not in live.services.logs(), "webhook URLs can carry secrets: never logged"


# ----------------------------------------------------------------------------- health, OpenAPI, process


def test_health_and_openapi(live):
    assert httpx.get(live.base + "/health/live").json() == {"live": True}
    assert httpx.get(live.base + "/health/ready").json()["checks"] == {"redis": True}
    ready = httpx.get(live.base + "/health/ready", params={"stream": CAM}).json()
    assert ready["encoder"] == holder_name(live.r.get(keys.lease(CAM)))
    assert_error(httpx.get(live.base + "/health/ready", params={"stream": "nope"}), 503, "stream")
    assert_error(httpx.get(live.base + "/health/ready", params={"stream": ""}), 400, "stream")  # an unset variable
    spec = httpx.get(live.base + "/openapi.json").json()
    assert {"/api/streams/{name}/ask", "/v1/chat/completions", "/v1/models", "/health/ready"} <= set(spec["paths"])
    assert httpx.get(live.base + "/docs").status_code == 200


def test_not_ready_without_redis_but_alive():
    from api.app import create_app
    from api.config import ApiConfig

    async def probe() -> tuple[httpx.Response, httpx.Response]:
        app = create_app(ApiConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            return await client.get("/health/live"), await client.get("/health/ready")

    live_probe, ready_probe = asyncio.run(probe())
    assert live_probe.status_code == 200
    assert "redis unreachable" in assert_error(ready_probe, 503)["message"]
    assert (ready_probe.json()["ready"], ready_probe.json()["checks"]) == (False, {"redis": False})


def test_a_camera_that_never_connected_has_status_and_events(redis_url, tmp_path):
    """Ingest on a camera URL that refuses (with credentials in it): the stream is listed, and its
    own status and events (why it fails) are served, not 404; the password appears in none of them."""
    from api.app import create_app
    from api.config import ApiConfig

    services = Services(redis_url, tmp_path)
    url, args = "rtsp://admin:s3cr3t-pw@127.0.0.1:1/live", ("--max-reconnects", "0", "--open-timeout-s", "2")
    assert services.start("ingest", "--url", url, "--stream", "door", *args).wait(timeout=60) == 1, services.logs()

    async def get(*paths: str) -> list[httpx.Response]:
        app = create_app(ApiConfig(redis_url=redis_url))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            return [await client.get(p) for p in paths]

    listed, one, events = asyncio.run(get("/api/streams", "/api/streams/door", "/api/streams/door/events"))
    assert [s["stream"] for s in listed.json()["streams"]] == ["door"]
    assert one.status_code == 200 and one.json()["state"] == "gave_up" and one.json()["connected"] is False
    assert events.status_code == 200 and "error" in [e["type"] for e in events.json()["events"]]
    assert "s3cr3t" not in listed.text + one.text + events.text + services.logs()


def test_a_transcript_count_past_what_redis_takes_is_a_400(redis_url):
    from api.app import create_app
    from api.config import ApiConfig

    with redis.Redis.from_url(redis_url) as r:
        r.hset(keys.meta("ghost"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})
        r.xadd(keys.transcript("ghost"), {"start": "0", "end": "1", "text": "EXIT", "job": "subs"})

    async def get(count: int) -> httpx.Response:
        app = create_app(ApiConfig(redis_url=redis_url))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            return await client.get("/api/streams/ghost/transcript", params={"count": count, "format": "srt"})

    assert "EXIT" in asyncio.run(get(2**63 - 1)).text  # Redis's own limit: all of it
    assert_error(asyncio.run(get(2**63)), 400, "count")  # one more was a 500 from XREVRANGE


def test_a_body_that_is_no_json_object_is_named_so_not_blamed_on_a_field():
    """Validation is done before Redis is asked: a broken body's error says what is wrong with it,
    with no `param` (was param "1", the character offset, and "Field required" of no field)."""
    from api.app import create_app
    from api.config import ApiConfig

    async def post(content: bytes, content_type: str) -> list[httpx.Response]:
        app = create_app(ApiConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
        headers = {"content-type": content_type}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            return [
                await client.post(p, content=content, headers=headers)
                for p in ("/api/streams/c/ask", "/v1/chat/completions")
            ]

    for content, content_type, says in (
        (
            b"{not json",
            "application/json",
            "not valid JSON: Expecting property name enclosed in double quotes (at character 1)",
        ),
        (b"", "application/json", "the body is missing"),
        (b'{"question": "x"}', "application/x-www-form-urlencoded", "Content-Type: application/json"),  # curl -d
    ):
        for response in asyncio.run(post(content, content_type)):
            error = assert_error(response, 400)
            assert error["param"] is None and says in error["message"], error


def test_redis_outage_gives_503_json_and_ends_a_streamed_answer_with_an_error(redis_server):
    """Redis goes away under a running API: every route answers 503 JSON (not a 500 and a
    traceback), and an answer being streamed ends with an error event instead of a cut connection."""
    from api.app import create_app
    from api.config import ApiConfig

    with redis.Redis.from_url(redis_server.url) as r:
        r.hset(keys.meta("ghost"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})

    def stop_while_both_answers_are_awaited() -> None:  # not after a fixed time: they may not be asked by then
        with redis.Redis.from_url(redis_server.url) as r:
            wait_for(lambda: r.xlen(keys.QUESTIONS) == 2 and _reading_answers(r), 15, "both answers awaited")
        redis_server.stop()

    async def run() -> tuple[httpx.Response, httpx.Response, list[httpx.Response]]:
        app = create_app(ApiConfig(redis_url=redis_server.url, answer_timeout_s=20))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            ask = {"question": "x", "stream": False}
            chat_body = {"model": "ghost", "messages": [{"role": "user", "content": "x"}]}
            threading.Thread(target=stop_while_both_answers_are_awaited, daemon=True).start()
            native, chat = await asyncio.gather(
                client.post("/api/streams/ghost/ask", json={"question": "Is the door open?"}),
                client.post("/v1/chat/completions", json=chat_body | {"stream": True}),
            )
            down = [
                *[await client.get(p) for p in ("/api/streams", "/api/streams/ghost", "/api/streams/ghost/events")],
                *[await client.get(p) for p in ("/api/streams/ghost/frame.jpg", "/api/alerts", "/v1/models")],
                await client.post("/api/streams/ghost/ask", json=ask),
                await client.post("/v1/chat/completions", json=chat_body),
            ]
        return native, chat, down

    native, chat, down = asyncio.run(run())
    unavailable = {
        "message": "redis unreachable: ConnectionError",
        "type": "unavailable",
        "param": None,
        "code": "redis_unreachable",
    }
    assert _parse_sse(native.text)[-1] == ("error", {"error": unavailable}), native.text
    assert [d for _, d in _parse_sse(chat.text)][-2:] == [{"error": unavailable}, "[DONE]"], chat.text
    for response in down:
        assert assert_error(response, 503)["type"] == "unavailable"


def test_a_client_that_hangs_up_on_a_non_streamed_answer_stops_the_wait(redis_url):
    """Non-streamed answers (native and OpenAI) that nobody answers: the client gives up after 0.5 s,
    and the API stops reading Redis for them within a read, not after answer_timeout_s (60 s here)."""
    from api.config import ApiConfig

    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("ghost"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})

    def reads() -> int:  # the API's blocking reads of answer streams so far
        return int(r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0))

    def stopped_reading() -> bool:
        before = reads()
        time.sleep(1)  # five reads of 200 ms each if the API were still waiting
        return reads() == before

    with served(ApiConfig(redis_url=redis_url, answer_timeout_s=60, block_ms=200)) as base:
        native = {"question": "x", "stream": False}
        chat = {"model": "ghost", "messages": [{"role": "user", "content": "x"}]}
        for path, body in (("/api/streams/ghost/ask", native), ("/v1/chat/completions", chat)):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(base + path, json=body, timeout=httpx.Timeout(10, read=0.5))
            # The read under way when the client left, and the check after it, take as long as a
            # loaded machine makes them: waited for, well within the 60 s an API still waiting
            # for the answer would go on reading.
            wait_for(stopped_reading, 20, f"{path}: the API to stop reading the answer stream after the client left")


@contextlib.contextmanager
def served(cfg) -> Iterator[str]:
    """The API on real uvicorn in a thread (a client that hangs up, bytes as they are sent): its base URL."""
    import uvicorn

    from api.app import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(cfg), host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "uvicorn")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_streamed_answer_keeps_the_connection_alive_while_it_waits(redis_url):
    """Nothing answers for 1.5 s: the native and the OpenAI streams send SSE comments meanwhile (a
    proxy would cut an idle connection), then the timeout's error, which clients read as before."""
    from api.config import ApiConfig

    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("ghost"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})
    cfg = ApiConfig(redis_url=redis_url, answer_timeout_s=1.5, block_ms=200, keep_alive_s=0.1)
    native = {"question": "x"}
    chat = {"model": "ghost", "messages": [{"role": "user", "content": "x"}], "stream": True}
    with served(cfg) as base:
        for path, body in (("/api/streams/ghost/ask", native), ("/v1/chat/completions", chat)):
            with httpx.stream("POST", base + path, json=body, timeout=10) as response:
                lines = [line for line in response.iter_lines() if line]
            comments = [line for line in lines if line.startswith(":")]
            # 1.5 s at most 0.1 s apart: ~15, and 4 leave room for an event loop held up by a loaded machine
            assert len(comments) >= 4, lines
            assert '"code": "timeout"' in "".join(lines[lines.index(comments[-1]) :]), lines  # then the timeout


def test_a_restarted_answer_starts_over_in_sse_and_continues_in_openai_chunks(redis_url):
    """A worker that died mid-answer: its successor answers again from the start (attempt 2), and a
    late delta of attempt 1 arrives after that. Entries written by hand, the way workers write them."""
    from api.app import create_app
    from api.config import ApiConfig

    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("ghost"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})

    def worker() -> None:
        for n in range(2):  # one question per request below
            qid = wait_for(lambda n=n: (q := r.xrange(keys.QUESTIONS)) and len(q) > n and q[n][1][b"id"], 10, "q")
            key = keys.answer(qid.decode())
            for text, attempt in (("The do", 1), ("The ", 2), ("or", 1), ("door is ", 2), ("open.", 2)):
                r.xadd(key, encode_delta(text, attempt))
            r.xadd(key, encode_final(FinalAnswer(id=qid.decode(), stream="ghost", text="The door is open.", tokens=5)))

    async def ask() -> tuple[list, list]:
        app = create_app(ApiConfig(redis_url=redis_url, answer_timeout_s=20))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            native = await client.post("/api/streams/ghost/ask", json={"question": "Is the door open?"})
            body = {"model": "ghost", "messages": [{"role": "user", "content": "Is the door open?"}], "stream": True}
            chat = await client.post("/v1/chat/completions", json=body)
        return _parse_sse(native.text), _parse_sse(chat.text)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    native, chat = asyncio.run(ask())
    thread.join(10)
    assert [k for k, _ in native] == ["delta", "restart", "delta", "delta", "delta", "final"]  # the late "or" dropped
    after_restart = native[native.index(("restart", {"attempt": 2})) + 1 : -1]
    assert "".join(d["text"] for _, d in after_restart) == native[-1][1]["text"] == "The door is open."
    content = "".join(c["choices"][0]["delta"].get("content") or "" for _, c in chat[:-1] if c.get("choices"))
    assert content == "The door is open." and chat[-1] == ("message", "[DONE]")


def test_api_never_imports_torch(live):
    """The API process as `streamvqa api` starts it (through the CLI), up to serving: no torch."""
    code = (
        "import sys, api.service; api.service.serve = lambda app, cfg: print(type(app).__name__) or 0; "
        "from apps.cli import main; main(['api', '--redis-url', sys.argv[1]]); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'; print('ok')"
    )
    argv = [sys.executable, "-c", code, live.redis_url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and out.stdout.split() == ["FastAPI", "ok"], out.stderr


def test_loud_warning_without_token_beyond_localhost(live, tmp_path):
    services = Services(live.redis_url, tmp_path)
    proc = services.start("api", "--host", "0.0.0.0", "--port", str(free_port()))
    try:
        wait_for(lambda: "WITHOUT AUTHENTICATION" in services.logs(), 30, "the warning", services)
    finally:
        services.stop_all()
    assert proc.returncode is not None
    assert TOKEN not in (services.logs() + live.services.logs()), "the token is never logged"


# ----------------------------------------------------------------------------- the page, in Chromium


def test_web_page_in_chromium(live, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"chromium not found at {CHROMIUM}")
    wait_for(lambda: live.r.xlen(keys.transcript(CAM)), JOB_WAIT_S, "a subtitle cue", live.services)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 600})
            page.set_default_timeout(60_000)
            page.goto(live.base + "/")
            page.wait_for_selector("#error:not([hidden])")  # no token yet: the page says so
            page.fill("#token", TOKEN)
            page.press("#token", "Enter")
            card = page.locator(f'article.camera[data-stream="{CAM}"]')
            card.wait_for()
            page.wait_for_function("document.querySelector('article.camera .frame img').naturalWidth > 0")
            page.wait_for_function("document.querySelectorAll('article.camera .transcript li:not(.muted)').length > 0")
            assert page.locator("#alerts li b").first.inner_text() == f"{CAM} · door"
            assert card.locator(".badge").inner_text() == "file ended"
            assert card.locator(".status").inner_text().count("\n") >= 5
            page.evaluate(_RECORD_DELTAS)
            card.locator("input[name=question]").fill("What is written on the screen?")
            card.locator("button[type=submit]").click()
            page.wait_for_function("document.querySelector('article.camera').dataset.answered === '1'")
            answer = card.locator(".answer").inner_text()
            seen = page.evaluate("window.answerStates")
            assert answer and len(seen) > 2 and seen[-1] == answer, "the answer grew as it streamed"
            assert all(answer.startswith(s) for s in seen if s)
            assert "version" in card.locator(".answer-meta").inner_text()
            time.sleep(1.2)  # one more frame refresh, so the picture is settled for the screenshot
            shot = REPO / "docs" / "web-ui.png" if os.environ.get("SVQA_UPDATE_SCREENSHOT") else tmp_path / "web-ui.png"
            page.screenshot(path=str(shot))  # SVQA_UPDATE_SCREENSHOT=1 refreshes the README's picture
            assert shot.stat().st_size > 10_000
        finally:
            browser.close()


def test_the_page_reads_past_keep_alive_comments(redis_url):
    """Nobody answers for 1.5 s, so the page's stream carries keep-alive comments: it must show the
    timeout the API reports, not fail on a comment it took for an event."""
    playwright = pytest.importorskip("playwright.sync_api")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"chromium not found at {CHROMIUM}")
    from api.config import ApiConfig

    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("ghost"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})
    cfg = ApiConfig(redis_url=redis_url, answer_timeout_s=1.5, block_ms=200, keep_alive_s=0.1)
    with served(cfg) as base, playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            page.goto(base + "/")
            card = page.locator('article.camera[data-stream="ghost"]')
            card.locator("input[name=question]").fill("Anyone there?")
            card.locator("button[type=submit]").click()
            page.wait_for_selector("article.camera .answer.failed")
            assert "no final answer" in card.locator(".answer").inner_text()
        finally:
            browser.close()


# Records every text the answer box shows while the answer streams in.
_RECORD_DELTAS = """
window.answerStates = [];
const box = document.querySelector('article.camera .answer');
new MutationObserver(() => window.answerStates.push(box.textContent))
  .observe(box, {childList: true, characterData: true, subtree: true});
"""


def test_the_page_on_a_phone_asks_multiple_choice_shows_the_queue_and_acknowledges_an_alert(redis_url):
    """At 390 px wide nothing overflows sideways; the favicon is served; a multiple-choice ask
    sends its choices and shows the scores; while the question waits the page says its place in
    the queue, then the wait and the total beside the compute time; an alert opens on its frame
    and is acknowledged for everyone. The worker and forwarder are played here, by hand."""
    playwright = pytest.importorskip("playwright.sync_api")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"chromium not found at {CHROMIUM}")
    from api.config import ApiConfig
    from common import redisio
    from common.wire.alert_record import Alert, frame_path
    from qa_worker.routing import forward

    r = redis.Redis.from_url(redis_url)
    r.hset(keys.meta("ghost"), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})
    picture = io.BytesIO()
    Image.new("RGB", (64, 48), "orange").save(picture, "JPEG")
    alert = Alert(Alert.new_id(), "ghost", "door", "Is the door open?", 0.9, 0.5, 3, 1.0, 2.0, time.time(), None)
    r.xadd(keys.alerts("ghost"), alert.fields() | {"frame": frame_path("ghost", alert.id)})
    r.hset(keys.alert_frame("ghost", alert.id), mapping={"jpeg": picture.getvalue(), "seq": "7", "ts": "2.0"})
    queue = keys.questions("ghost")
    redisio.ensure_group(r, queue, keys.QA_GROUP)
    forward(r, "ghost", "ahead", {b"stream": b"ghost", b"question": b"first?"}, ttl_s=60)
    asked: list[dict] = []

    def forwarder() -> None:
        (entry_id, fields), *_ = wait_for(lambda: r.xrange(keys.QUESTIONS), 30, "the page's question")
        asked.append({k.decode(): v.decode() for k, v in fields.items()})
        forward(r, "ghost", fields[b"id"].decode(), fields, 60, asked=entry_id.decode())

    cfg = ApiConfig(redis_url=redis_url, block_ms=100, answer_timeout_s=60)
    with served(cfg) as base, playwright.sync_playwright() as p:
        assert httpx.get(base + "/favicon.ico").status_code == httpx.get(base + "/web/favicon.svg").status_code == 200
        assert_error(httpx.post(base + "/api/streams/ghost/alerts/nope/ack"), 404, "alert_id")
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 390, "height": 844})
            page.set_default_timeout(30_000)
            page.goto(base + "/")
            card = page.locator('article.camera[data-stream="ghost"]')
            card.wait_for()
            assert page.evaluate("document.documentElement.scrollWidth") <= 390, "sideways overflow at 390 px"
            assert page.evaluate("fetch(document.querySelector('link[rel=icon]').href).then(r => r.status)") == 200

            threading.Thread(target=forwarder, daemon=True).start()
            card.locator("input[name=question]").fill("Is the door open?")
            card.locator("input[name=choices]").fill("yes, no")
            card.locator("button[type=submit]").click()
            page.wait_for_function("document.querySelector('article.camera .answer-meta').textContent.includes('2nd')")
            assert json.loads(asked[0]["choices"]) == ["yes", "no"]
            r.xreadgroup(keys.QA_GROUP, "w", {queue: ">"}, count=10)  # a worker takes both, answers the page's
            qid = asked[0]["id"]
            final = FinalAnswer(id=qid, stream="ghost", text="yes", choice="yes", scores={"yes": -0.1, "no": -2.4})
            timing = {"version": 3, "t_start": 1.0, "t_end": 2.0, "total_s": 0.5, "queue_s": 4.0, "elapsed_s": 4.5}
            r.xadd(keys.answer(qid), encode_final(FinalAnswer(**vars(final) | timing)))
            page.wait_for_function("document.querySelector('article.camera').dataset.answered === '1'")
            meta = card.locator(".answer-meta").inner_text()
            assert "waited 4.0 s in the queue" in meta and "4.50 s in all" in meta, meta
            assert card.locator(".scores .chosen").inner_text() == "yes"
            assert page.evaluate("document.documentElement.scrollWidth") <= 390, "sideways overflow once answered"

            page.locator(f'#alerts li[data-alert="{alert.id}"]').click()
            page.wait_for_function("document.querySelector('#evidence-dialog img').naturalWidth === 64")
            page.locator("#evidence-dialog button.ack").click()
            page.wait_for_selector(f'#alerts li.acked[data-alert="{alert.id}"]')
        finally:
            browser.close()
    assert r.hget(keys.alert_acks("ghost"), alert.id) is not None, "acknowledged for everyone, not in the page only"
