"""Searching the cameras' past end to end, on a real redis-server, real frames logs and indexes
(USearch) and a tiny random-weight model: frames encoded by the encoder, indexed by the recorder,
searched through the question queue by a worker. The ranking oracle: the chunks' scores equal those
computed independently from the model (transformers' own forward: pre-RoPE queries of the question
and keys of each chunk, tests/retrieval_oracle.py), and so does their order; a search's results
are the moments (qa_worker/moments.py) those scores make, worked out here from them afresh. Moments
are also held to planted vectors (a search of chosen scores). A span with nothing indexed is an
empty list; bad parameters are refused at once (API 400, CLI exit 2)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis

from api.app import create_app
from api.config import ApiConfig
from common import redisio
from common.engine.features import feature_layers
from common.engine.model import load_model
from common.engine.runtime import Runtime
from common.wire import keys
from common.wire.schemas import SearchHit
from qa_worker.answering import Answerer
from qa_worker.client import Client
from qa_worker.searching import Searcher, SearchError
from tests.engine_helpers import make_frames
from tests.pipeline import wait_for
from tests.retrieval_oracle import chunk_means, question_means, score
from tests.test_persistence import encoded, run_until, stop
from tests.test_search_index import CHUNK, FPS, GRID, encoder, recorder, step_until, unacked_features

CAMS = ("gate", "yard")
FRAMES = 16
T0 = time.time() - 600  # the chunks were captured 10 minutes before the suite was collected


def since_before_the_chunks() -> str:
    """A `since` (seconds before now) 5 minutes before the chunks were captured: T0 is set when the
    suite is collected, which in a whole run is many minutes before these tests."""
    return f"{int(time.time() - T0) + 300}s"


QUERY = "Is there a red van?"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


@pytest.fixture(scope="module")
def world(rt, tmp_path_factory) -> Iterator[dict]:
    """Two cameras' 16 frames each encoded and indexed beside their frames logs; a Redis of the
    module's own (the session's is flushed between tests)."""
    from tests.conftest import RedisServer

    tmp = tmp_path_factory.mktemp("search")
    server = RedisServer(tmp)
    server.start()
    r = redis.Redis.from_url(server.url)
    frames = {cam: make_frames(FRAMES, GRID, seed=i + 11) for i, cam in enumerate(CAMS)}
    for cam in CAMS:
        _encode(rt, r, server.url, tmp / cam, cam, frames[cam])
    rec = recorder(server.url, tmp / "log", streams=CAMS)
    step_until(rec, lambda: all(unacked_features(r, cam) == 0 for cam in CAMS), "both cameras indexed")
    for w in rec.writers.values():
        w.close()
    yield {"r": r, "url": server.url, "log": tmp / "log", "frames": frames}
    server.stop()


def _encode(rt: Runtime, r: redis.Redis, url: str, tmp: Path, cam: str, frames: list[np.ndarray]) -> None:
    from common.wire.schemas import FrameMsg, encode_frame

    svc = encoder(rt, r, url, tmp, cam)
    for s in range(FRAMES):
        r.xadd(keys.frames(cam), encode_frame(FrameMsg.from_rgb(s, T0 + s / FPS, s / FPS, frames[s])))
    run_until(svc, lambda: encoded(r, cam, FRAMES - 1), f"{cam}'s frames")
    stop(svc, r)


@contextlib.contextmanager
def answering(rt: Runtime, world: dict, **options) -> Iterator[Answerer]:
    """A worker answering what reaches `svqa:questions` (searches need no stream owner), in a
    thread; ``options``: the Answerer's (history_max_tokens)."""
    r = world["r"]
    answerer = Answerer(rt, r, lambda *_: None, lambda _: True, consumer="w", framelog_dir=str(world["log"]), **options)
    reader = redisio.GroupReader(r, [keys.QUESTIONS], keys.QA_GROUP, "w", block_ms=100)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            answerer.handle_entries(reader.read())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield answerer
    finally:
        done.set()
        thread.join(10)
        answerer.searcher.close()


@pytest.fixture
def worker(rt, world) -> Iterator[Answerer]:
    with answering(rt, world) as answerer:
        yield answerer


def oracle(rt: Runtime, world: dict, query: str) -> list[tuple[float, str, int]]:
    """(score, camera, first frame seq) of every chunk, computed from transformers' forward alone."""
    layers = feature_layers(rt.loaded.text_config.num_hidden_layers)
    question = question_means(rt, query, layers)
    out = []
    for cam in CAMS:
        means = chunk_means(rt, world["frames"][cam], GRID, FPS, CHUNK, layers)
        out += [(score(question, m), cam, i * CHUNK) for i, m in enumerate(means)]
    return sorted(out, reverse=True)


def moments_oracle(chunks: list[tuple[float, str, int]], limit: int) -> list[tuple[float, str, int, int, int]]:
    """(score, camera, best chunk's first seq, first seq, last seq) of each moment the ranked
    ``chunks`` (oracle's) make, best first, found afresh: the world's chunks are CHUNK frames each,
    back to back, so adjacent is the next chunk of the camera. Taken best first, each prefix's runs
    counted from scratch; the taking stops before the chunk that would make limit + 1 runs, else
    after the last that started a run (adjacent to none taken), but never before the limit best."""

    def runs(taken: list[tuple[float, str, int]]) -> list[list[tuple[float, str, int]]]:
        out: list[list[tuple[float, str, int]]] = []
        for c in sorted(taken, key=lambda c: (c[1], c[2])):
            if out and out[-1][-1][1] == c[1] and out[-1][-1][2] + CHUNK == c[2]:
                out[-1].append(c)
            else:
                out.append([c])
        return out

    def started(i: int) -> bool:
        _, cam, seq = chunks[i]
        return not {(cam, seq - CHUNK), (cam, seq + CHUNK)} & {(c, s) for _, c, s in chunks[:i]}

    stop = next((i for i in range(len(chunks)) if len(runs(chunks[: i + 1])) > limit), None)
    if stop is None:
        stop = max([i + 1 for i in range(len(chunks)) if started(i)] + [min(limit, len(chunks))])
    taken = chunks[:stop]
    found = [(max(run)[0], run[0][1], max(run)[2], run[0][2], run[-1][2] + CHUNK - 1) for run in runs(taken)]
    return sorted(found, key=lambda m: -m[0])


def assert_moments(hits, expected: list[tuple[float, str, int, int, int]]) -> None:
    """``hits`` are the oracle's moments: in its order, each its camera, range, best chunk and score."""
    got = [(h.stream, h.best_first_seq, h.first_seq, h.last_seq) for h in hits]
    assert got == [(cam, best, first, last) for _, cam, best, first, last in expected]
    np.testing.assert_allclose([h.score for h in hits], [m[0] for m in expected], atol=2e-3)
    for h in hits:
        assert (h.start, h.end) == pytest.approx((T0 + h.first_seq / FPS, T0 + h.last_seq / FPS))
        best_last = h.best_first_seq + CHUNK - 1
        assert h.best_last_seq == best_last
        assert (h.best_start, h.best_end) == pytest.approx((T0 + h.best_first_seq / FPS, T0 + best_last / FPS))
        assert h.chunks == (h.last_seq + 1 - h.first_seq) // CHUNK and h.frames == h.chunks * CHUNK


def of(cam: str, chunks: list[tuple[float, str, int]]) -> list[tuple[float, str, int]]:
    return [c for c in chunks if c[1] == cam]


@pytest.mark.parametrize("query", [QUERY, "Who walked through the gate?"])
def test_scores_and_ranking_equal_the_models_own_computed_independently(rt, world, worker, query):
    expected = oracle(rt, world, query)
    chunks = worker.searcher.chunks(query, None, -math.inf, math.inf, 8)  # one by one, as scope history's
    got = [(h.score, h.stream, h.first_seq) for h in chunks]
    assert [(cam, seq) for _, cam, seq in got] == [(cam, seq) for _, cam, seq in expected], "the same order"
    np.testing.assert_allclose([s for s, _, _ in got], [s for s, _, _ in expected], atol=2e-3)
    assert len({round(s, 3) for s, _, _ in expected}) > 4, "the chunks' scores differ: the order means something"
    first = next(h for h in chunks if h.stream == "gate" and h.first_seq == 4)
    assert (first.start, first.end, first.last_seq, first.frames) == (T0 + 2.0, T0 + 3.5, 7, 4)
    assert (first.chunks, first.best_start, first.best_end) == (1, first.start, first.end)
    final = Client(world["r"]).search(query, limit=8, timeout_s=60)
    assert final.error is None, final.error
    assert_moments(final.hits, moments_oracle(expected, 8))


def test_one_camera_a_span_and_the_limit(rt, world, worker):
    client = Client(world["r"])
    final = client.search(QUERY, stream="yard", limit=2, timeout_s=60)
    assert_moments(final.hits, moments_oracle(of("yard", oracle(rt, world, QUERY)), 2))
    from common.wire.timeref import TimeRef

    nothing = client.search(QUERY, since=TimeRef(ago_s=300), timeout_s=60)  # the chunks are 10 min old
    assert nothing.error is None and nothing.hits == ()
    span = client.search(QUERY, since=TimeRef(at=T0 + 4.1), until=TimeRef(at=T0 + 5.9), timeout_s=60)
    assert {(h.stream, h.first_seq, h.chunks) for h in span.hits} == {(cam, 8, 1) for cam in CAMS}, (
        "chunks meeting the span"
    )


def test_a_search_since_after_the_asking_is_refused_as_a_questions_span_is(world, worker):
    """A `since` in the future searched nothing and said "no chunk of that span is indexed" (an
    empty 200 from the API), while a question about such a span is refused saying why: a search is
    refused the same way now, by the worker, naming since (the API's 422 of a refused search)."""
    from common.wire.timeref import TimeRef

    ahead = time.time() + 3600
    final = Client(world["r"]).search(QUERY, since=TimeRef(at=ahead), timeout_s=60)
    assert final.param == "since" and "it is in the future, ask about the past" in (final.error or "")
    cfg = ApiConfig(redis_url=world["url"], framelog_dir=str(world["log"]), block_ms=100)

    async def run() -> httpx.Response:
        app = create_app(cfg)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api", timeout=60) as c,
        ):
            return await c.get(
                "/api/search", params={"q": "van", "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ahead))}
            )

    refused = asyncio.run(run())
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["param"] == "since" and "in the future" in refused.json()["error"]["message"]
    out = cli(world["url"], "van", "--since", time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ahead)))
    assert out.returncode == 1 and "in the future" in out.stderr and "no chunk" not in out.stderr, out.stderr


def test_the_api_gives_ranked_ranges_with_thumbnails_and_400s_for_bad_parameters(rt, world, worker):
    cfg = ApiConfig(redis_url=world["url"], framelog_dir=str(world["log"]), block_ms=100)
    world["r"].hset(keys.meta("gate"), "fps", "2")  # a stream the API knows

    async def run() -> list[httpx.Response]:
        app = create_app(cfg)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api", timeout=60) as c,
        ):
            paths = [
                f"/api/search?q={QUERY}&limit=3",
                f"/api/search?q={QUERY}&stream=gate&since={since_before_the_chunks()}",
                f"/api/search?q={QUERY}&since=5m",
                "/api/search?q=van&limit=0",
                "/api/search?q=van&since=yesterday",
                "/api/search?q=%20",
                "/api/search?q=van&until=1h",
                "/api/search?q=van&stream=nope",
                "/api/search?q=van&stream=../x",
                "/api/search?limit=3",
            ]
            out = [await c.get(p) for p in paths]
            best = out[0].json()["results"][0]
            out.append(await c.get(best["thumbnail"]))
            return out

    best3, gate, empty, limit0, bad_since, blank, lone_until, unknown, bad_name, no_q, thumb = asyncio.run(run())
    assert best3.status_code == 200, best3.text
    results = best3.json()["results"]
    expected = oracle(rt, world, QUERY)
    fields = {"stream", "start", "end", "score", "first_seq", "last_seq", "frames", "chunks"}
    fields |= {"best_start", "best_end", "best_first_seq", "best_last_seq"}
    assert_moments([SearchHit(**{k: x[k] for k in fields}) for x in results], moments_oracle(expected, 3))
    for x in results:
        assert set(x) == fields | {"thumbnail", "clip"}
        best_middle = (x["best_start"] + x["best_end"]) / 2  # the best chunk's, not the range's
        assert x["thumbnail"] == f"/api/streams/{x['stream']}/snapshot?at={best_middle:.3f}"
        assert x["clip"] == f"/api/streams/{x['stream']}/clip?from={x['start']:.3f}&to={x['end']:.3f}"
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/jpeg"
    assert gate.status_code == 200 and {x["stream"] for x in gate.json()["results"]} == {"gate"}
    assert len(gate.json()["results"]) == len(moments_oracle(of("gate", expected), 10))
    assert empty.status_code == 200 and empty.json()["results"] == []
    for response, param in ((limit0, "limit"), (bad_since, "since"), (blank, "q"), (lone_until, "until")):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    assert unknown.status_code == 404
    assert bad_name.status_code == 400 and bad_name.json()["error"]["param"] == "stream"
    assert no_q.status_code == 400


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "apps.cli", "search", "--redis-url", url, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_the_cli_prints_ranked_ranges_and_exits_2_on_bad_parameters(rt, world, worker):
    world["r"].hset(keys.meta("gate"), "fps", "2")
    out = cli(world["url"], QUERY, "--all", "--limit", "3", "--json")
    assert out.returncode == 0, out.stderr
    hits = [SearchHit(**json.loads(line)) for line in out.stdout.splitlines()]
    assert_moments(hits, moments_oracle(oracle(rt, world, QUERY), 3))
    table = cli(world["url"], QUERY, "--stream", "gate", "--since", since_before_the_chunks(), "--limit", "2")
    expected = moments_oracle(of("gate", oracle(rt, world, QUERY)), 2)
    assert table.returncode == 0 and len(table.stdout.splitlines()) == len(expected)
    assert (
        table.stdout.split()[1] == "gate"
        and f"chunks {expected[0][4] // CHUNK - expected[0][3] // CHUNK + 1}" in table.stdout.splitlines()[0]
    )
    empty = cli(world["url"], QUERY, "--since", "5m")
    assert empty.returncode == 0 and empty.stdout == "" and "no chunk" in empty.stderr
    for bad in (["x", "--limit", "0"], ["x", "--since", "soon"], ["x", "--until", "1h"], ["x", "--stream", "nope"]):
        refused = cli(world["url"], *bad)
        assert refused.returncode == 2, (bad, refused.stderr)
        assert len(refused.stderr.strip().splitlines()) == 1
    both = cli(world["url"], "x", "--stream", "gate", "--all")
    assert both.returncode == 2


def test_scope_history_answers_exactly_over_the_best_ranked_chunks(rt, world, request):
    """With scope history, a question is answered over as many of its camera's chunks as
    history_max_tokens holds (2 here), those that rank best for it, oldest first: the answer equals
    one-shot offline inference on exactly those chunks' frames, and its ranges are theirs."""
    from common.engine.offline import offline_answer
    from common.engine.spans import capture_ranges
    from common.wire.schemas import Question, encode_question
    from common.wire.timeref import TimeRef

    r = world["r"]
    budget = len(rt.prefix_ids()) + 2 * 8  # 2 chunks of 2 temporal patches of 4 tokens
    answerer = Answerer(
        rt, r, lambda *_: None, lambda _: True, framelog_dir=str(world["log"]), history_max_tokens=budget
    )
    request.addfinalizer(answerer.searcher.close)
    client = Client(r)

    def asked(**options) -> object:
        q = Question(id=f"q{time.monotonic_ns()}", stream="gate", question=QUERY, max_tokens=6, **options)
        entry_id = r.xadd(keys.QUESTIONS, encode_question(q))
        answerer.handle(
            keys.QUESTIONS, entry_id.decode(), {k.encode(): v.encode() for k, v in encode_question(q).items()}
        )
        return next(reply for reply in client.replies(q.id, 10) if hasattr(reply, "ranges"))

    final = asked(scope="history")
    assert final.error is None, final.error
    best = sorted(seq for _, cam, seq in [x for x in oracle(rt, world, QUERY) if x[1] == "gate"][:2])
    frames = world["frames"]["gate"]
    offline = offline_answer(rt, [frames[s] for b in best for s in range(b, b + CHUNK)], GRID, FPS, QUERY, max_tokens=6)
    assert final.text == offline.text and final.tokens == len(offline.token_ids)
    chunks = [((b, b + CHUNK - 1), (T0 + b / FPS, T0 + (b + CHUNK - 1) / FPS)) for b in best]
    assert final.ranges == tuple(capture_ranges(chunks))
    nothing = asked(scope="history", since=TimeRef(ago_s=300))  # the chunks are 10 minutes old
    assert nothing.error is not None and nothing.param == "scope"


def test_scope_is_checked_on_the_wire():
    from common.wire.schemas import SchemaError, checked_question

    assert checked_question("gate", "what?", scope="history").scope == "history"
    assert checked_question("gate", "what?").scope == "live"
    with pytest.raises(SchemaError) as bad:
        checked_question("gate", "what?", scope="past")
    assert bad.value.field == "scope"
    with pytest.raises(SchemaError) as both:
        checked_question("gate", "what?", scope="history", at=3)
    assert both.value.field == "at"


def test_the_api_takes_scope_history_and_refuses_another_scope(world):
    cfg = ApiConfig(redis_url=world["url"], framelog_dir=str(world["log"]), block_ms=100, answer_timeout_s=1)

    async def run() -> list[httpx.Response]:
        app = create_app(cfg)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api", timeout=60) as c,
        ):
            body = {"question": "what?", "stream": False}
            bad = await c.post("/api/streams/gate/ask", json=body | {"scope": "past"})
            queued = await c.post("/api/streams/gate/ask", json=body | {"scope": "history"})
            chat = {"model": "gate", "messages": [{"role": "user", "content": "what?"}]}
            bad_chat = await c.post("/v1/chat/completions", json=chat | {"scope": "past"})
            queued_chat = await c.post("/v1/chat/completions", json=chat | {"scope": "history"})
            assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "scope", bad_chat.text
            assert queued_chat.status_code == 504, queued_chat.text
            return [bad, queued]

    bad, queued = asyncio.run(run())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "scope", bad.text
    assert queued.status_code == 504, "accepted and queued (no worker answers here)"
    fields = world["r"].xrevrange(keys.QUESTIONS, count=1)[0][1]
    assert fields[b"scope"] == b"history"


@contextlib.contextmanager
def planted_searcher(tmp_path: Path, scores: dict[str, list[float]]) -> Iterator[Searcher]:
    """A worker's searcher over cameras whose chunks (CHUNK frames each, back to back from seq 0,
    tests/test_search_index.py's `planted`) score exactly ``scores`` against the question (to
    float16's precision): each vector is the score's part along the question and the rest at right
    angles to it. The real index (USearch, saved and opened as the recorder's), searched in the
    searcher's index process, ended on the way out."""
    from types import SimpleNamespace

    from common.chunkindex import ChunkIndex
    from tests.test_search_index import LAYERS, planted

    rng = np.random.default_rng(7)
    question = rng.standard_normal(64)
    question /= np.linalg.norm(question)
    for cam, cam_scores in scores.items():
        index = ChunkIndex("tiny-random", LAYERS, 64)
        for i, a in enumerate(cam_scores):
            other = rng.standard_normal(64)
            other -= (other @ question) * question
            other /= np.linalg.norm(other)
            index.add(planted(CHUNK * i, (a * question + math.sqrt(1 - a * a) * other).astype(np.float16)))
        (tmp_path / cam).mkdir()
        index.save(tmp_path / cam)
    searcher = Searcher(SimpleNamespace(loaded=SimpleNamespace(name="tiny-random")), str(tmp_path))  # type: ignore[arg-type]
    searcher._question = lambda text, layers: question.astype(np.float32)  # type: ignore[method-assign]
    try:
        yield searcher
    finally:
        searcher.close()


def planted_moment(cam: str, scores: list[float], first: int, last: int) -> tuple:
    """What the moment of chunks ``first``..``last`` (indexes of ``scores``) must be: (camera, start,
    end, first seq, last seq, frames, chunks, best start, best end, best seqs), and its score."""
    from tests.test_search_index import T0 as T

    best = max(range(first, last + 1), key=lambda i: scores[i])
    span = (CHUNK - 1) / FPS
    place = (cam, T + first * CHUNK / FPS, T + last * CHUNK / FPS + span, first * CHUNK, last * CHUNK + CHUNK - 1)
    place += ((last - first + 1) * CHUNK, last - first + 1, T + best * CHUNK / FPS, T + best * CHUNK / FPS + span)
    return (*place, best * CHUNK, best * CHUNK + CHUNK - 1), scores[best]


def assert_planted(hits: list[SearchHit], expected: list[tuple]) -> None:
    fields = ("stream", "start", "end", "first_seq", "last_seq", "frames", "chunks", "best_start", "best_end")
    got = [tuple(getattr(h, k) for k in (*fields, "best_first_seq", "best_last_seq")) for h in hits]
    assert got == [place for place, _ in expected]
    np.testing.assert_allclose([h.score for h in hits], [score for _, score in expected], atol=2e-3)


# chunks 2-4 match (the best is 3), 9 alone; 5 is a weak neighbour of 4; 7 a weaker moment of its own
ONE_CAMERA = [0.0, 0.1, 0.8, 0.95, 0.85, 0.3, 0.0, 0.5, 0.0, 0.7, 0.1, 0.0]


def test_adjacent_matching_chunks_are_one_result_with_its_best_chunks_score_and_place(tmp_path):
    with planted_searcher(tmp_path, {"cam": ONE_CAMERA}) as searcher:
        event, alone, weaker = (planted_moment("cam", ONE_CAMERA, *r) for r in ((2, 4), (9, 9), (7, 7)))
        found = searcher.search("a red van", ["cam"], -math.inf, math.inf, 2)
        assert_planted(found, [event, alone])  # 3 consecutive chunks and a distant one: 2 results
        assert event[0][2] < found[1].start, "the weak neighbour (chunk 5) is not merged in: the event ends at 4"
        assert_planted(searcher.search("a red van", ["cam"], -math.inf, math.inf, 1), [event])
        assert_planted(searcher.search("a red van", ["cam"], -math.inf, math.inf, 3), [event, alone, weaker])
        chunks = searcher.chunks("a red van", ["cam"], -math.inf, math.inf, 2)  # one by one: the event's two best
        assert [(c.first_seq, c.chunks) for c in chunks] == [(12, 1), (16, 1)]


def test_moments_of_several_cameras_ranked_and_an_event_longer_than_the_chunks_first_asked_for(tmp_path):
    """A 12-chunk event takes all the chunks first asked of its camera (4 a moment wanted): the
    searcher asks for more until the moments are known, and finds the moment after it too."""
    gate = [0.9 - 0.004 * abs(i - 6) for i in range(12)]  # the event: best at 6, less either side
    gate += [0.1, 0.6] + [-0.1 - 0.05 * i for i in range(6)]
    yard = [0.0, 0.75, 0.7, 0.0]
    with planted_searcher(tmp_path, {"gate": gate, "yard": yard}) as searcher:
        event, later = planted_moment("gate", gate, 0, 11), planted_moment("gate", gate, 13, 13)
        yards = planted_moment("yard", yard, 1, 2)
        assert_planted(searcher.search("a red van", ["yard", "gate"], -math.inf, math.inf, 3), [event, yards, later])
        assert_planted(searcher.search("a red van", ["gate", "yard"], -math.inf, math.inf, 2), [event, yards])
        assert_planted(searcher.search("a red van", ["gate"], -math.inf, math.inf, 10), [event, later])


YARD = [0.0, 0.9, 0.2]
# ONE_CAMERA's and YARD's three best moments: the event, yard's best chunk alone, gate's chunk 9
BOTH = [planted_moment("gate", ONE_CAMERA, 2, 4), planted_moment("yard", YARD, 1, 1)]
BOTH += [planted_moment("gate", ONE_CAMERA, 9, 9)]


@pytest.fixture(scope="module")
def two_cameras(tmp_path_factory) -> Iterator[tuple[Searcher, Path]]:
    """One searcher (and its index process) for the module's tests of that process, over planted
    cameras gate (ONE_CAMERA) and yard (YARD); its process ended, none left behind, at the end."""
    root = tmp_path_factory.mktemp("planted")
    with planted_searcher(root, {"gate": ONE_CAMERA, "yard": YARD}) as searcher:
        yield searcher, root
        assert searcher.indexes is not None
        last = searcher.indexes.pid
    assert not Path(f"/proc/{last}").exists(), "the index process outlived its searcher"


def searched_both(searcher: Searcher) -> list[SearchHit]:
    return searcher.search("a red van", ["gate", "yard"], -math.inf, math.inf, 3)


def test_the_indexes_are_opened_and_searched_in_a_process_of_their_own_without_the_model(two_cameras):
    """The worker's process maps neither index: a child of it does, and ranks them (the planted
    moments, as ranked in the worker before); that child has not loaded torch, which this
    process has."""
    searcher, root = two_cameras
    assert_planted(searched_both(searcher), BOTH)
    assert searcher.indexes is not None
    pid = searcher.indexes.pid
    assert pid != os.getpid() and f"PPid:\t{os.getpid()}\n" in Path(f"/proc/{pid}/status").read_text()
    theirs, ours = Path(f"/proc/{pid}/maps").read_text(), Path("/proc/self/maps").read_text()
    for cam in ("gate", "yard"):
        graph = str(root / cam / "chunks.usearch")
        assert graph in theirs and graph not in ours, "the index is memory-mapped there, not here"
    assert "libtorch" in ours and "libtorch" not in theirs


def test_an_index_process_that_dies_fails_the_search_it_held_and_the_next_search_starts_another(two_cameras):
    """Killed between two searches, or while it holds one (stopped, then killed): the search that
    finds it gone gets the error as its final, nothing is raised in the worker, and the next search
    answers from a fresh process, the old one reaped."""
    from common.wire.search_request import checked_search, encode_search

    searcher, _ = two_cameras
    assert searcher.indexes is not None
    first = searcher.indexes.pid
    os.kill(first, signal.SIGKILL)
    with pytest.raises(SearchError, match=r"^the search process ended; try again$"):
        searched_both(searcher)
    assert_planted(searched_both(searcher), BOTH)
    second = searcher.indexes.pid
    assert second != first
    deadline = time.monotonic() + 10
    while Path(f"/proc/{first}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{first}").exists(), "the killed process was reaped"

    fields = encode_search(checked_search("a red van", stream="gate", limit=3))
    os.kill(second, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as asking:
        asked = asking.submit(searcher.answer, "q-killed", fields, time.time())
        time.sleep(0.2)  # handed to the stopped process by now (killed before, it fails all the same)
        os.kill(second, signal.SIGKILL)
        final, req = asked.result(timeout=60)
    assert req is not None and final.error == "the search process ended; try again" and not final.hits
    assert_planted(searched_both(searcher), BOTH)
    assert searcher.indexes.pid not in (first, second)


def test_adjacent_is_no_whole_chunk_between():
    from qa_worker.moments import adjacent

    def chunk(start: float, end: float) -> SearchHit:
        return SearchHit.chunk("cam", start, end, 0.5, 0, 3, 4)

    assert adjacent(chunk(0, 1.5), chunk(2, 3.5)), "the next chunk: one frame interval on"
    assert adjacent(chunk(0, 1.5), chunk(2.5, 4)), "a frame dropped between them"
    assert adjacent(chunk(0, 1.5), chunk(1, 2.5)), "overlapping"
    assert not adjacent(chunk(0, 1.5), chunk(4, 5.5)), "a chunk between them"


def test_a_moment_round_trips_on_the_wire_and_a_hit_without_its_fields_is_one_chunk():
    from common.wire.schemas import FinalAnswer, SchemaError, decode_final, encode_final

    moment = SearchHit("gate", 1.0, 9.5, 0.95, 2, 19, 12, 3, 6.0, 7.5, 12, 15)
    final = FinalAnswer(id="q1", stream=None, text="", hits=(moment, SearchHit.chunk("yard", 3.0, 4.5, 0.5, 6, 9, 4)))
    assert decode_final(encode_final(final)) == final
    wire = encode_final(FinalAnswer(id="q1", stream=None, text=""))
    old = {"stream": "gate", "start": 6.0, "end": 7.5, "score": 0.5, "first_seq": 12, "last_seq": 15, "frames": 4}
    (hit,) = decode_final(wire | {"hits": json.dumps([old])}).hits
    assert hit == SearchHit("gate", 6.0, 7.5, 0.5, 12, 15, 4, 1, 6.0, 7.5, 12, 15)
    for bad in ({"chunks": 0}, {"best_start": "x"}, {"best": 1}):
        with pytest.raises(SchemaError):
            decode_final(wire | {"hits": json.dumps([old | bad])})


@contextlib.contextmanager
def qa_service(rt: Runtime, world: dict, consumer: str, framelog_dir: str | None) -> Iterator:
    """A `streamvqa qa` process on the world's Redis, stepped by the test (no stream of its own)."""
    from qa_worker.config import QAConfig
    from qa_worker.service import QAService

    class NoVersions:
        exclusive = False
        get, serves, answering, run = (lambda *_: None), (lambda _: True), (lambda *_: []), (lambda _: None)

    cfg = QAConfig(
        redis_url=world["url"],
        streams=CAMS,
        consumer=consumer,
        block_ms=50,
        framelog_dir=framelog_dir,
        decode_processes=1,
    )
    svc = QAService(cfg, rt, world["r"], NoVersions())
    try:
        yield svc
    finally:
        svc.questions_pool.shutdown(wait=True)
        svc.answerer.searcher.close()
        if svc.own_decoder and svc.decoder is not None:
            svc.decoder.close()


def ask_search(r: redis.Redis, text: str, **options) -> str:
    from common.wire.search_request import checked_search, encode_search

    req = checked_search(text, **options)
    r.xadd(keys.QUESTIONS, encode_search(req))
    return req.id


def final_of(r: redis.Redis, qid: str):
    from common.wire.schemas import decode_final

    finals = [f for _, f in r.xrange(keys.answer(qid)) if f.get(b"type") == b"final"]
    assert len(finals) == 1, finals
    return decode_final(finals[0])


def test_a_clients_own_asked_field_moves_neither_its_span_nor_its_wait(rt, world, monkeypatch):
    """`asked` is the forwarder's (routing.py: the entry id where it was asked, on the queue it
    forwards to); one a client writes into `svqa:questions` itself is not believed: `since 1h`
    counts back from the entry there, not from 1970, and its reported wait is its own."""
    r = world["r"]
    searched: dict[str, float] = {}

    def search(text, streams, since, until, limit):
        searched.update(since=since, until=until)
        return []

    with answering(rt, world) as answerer:
        monkeypatch.setattr(answerer.searcher, "search", search)
        r.xadd(keys.QUESTIONS, {"id": "q-forged-asked", "search": QUERY, "since": "1h", "asked": "1000-0"})
        wait_for(lambda: r.exists(keys.answer("q-forged-asked")) and searched, 30, "the search answered")
    final = final_of(r, "q-forged-asked")
    assert abs(searched["since"] - (time.time() - 3600)) < 60, searched
    assert final.queue_s < 60 and final.elapsed_s < 60, final


def test_a_process_without_the_frames_log_forwards_a_search_to_one_with_it(rt, world):
    """The process without the log reads the search from `svqa:questions`, sees a live reader of
    `svqa:searches` (the one with the log, which read it a moment ago) and forwards it there; the
    one with the log answers it: the hits its own searcher gives."""
    r = world["r"]
    r.delete(keys.SEARCHES)
    with qa_service(rt, world, "holder", str(world["log"])) as holder, qa_service(rt, world, "lacker", None) as lacker:
        holder.step()  # reads (nothing): its consumer of `svqa:searches` is touched
        qid = ask_search(r, QUERY, limit=3)
        lacker.step()
        (forwarded,) = r.xrange(keys.SEARCHES)
        assert forwarded[1][b"id"] == qid.encode() and forwarded[1][b"search"] == QUERY.encode()
        assert not r.xpending_range(keys.QUESTIONS, keys.QA_GROUP, "-", "+", 10, consumername="lacker"), "acked"
        assert not r.exists(keys.answer(qid)), "the process without the log did not answer it"
        holder.step()
        holder.questions_pool.shutdown(wait=True)  # the search answered
        final = final_of(r, qid)
        assert final.error is None, final.error
        direct = holder.answerer.searcher.search(QUERY, None, -math.inf, math.inf, 3)
        assert final.hits and final.hits == tuple(direct)
        assert not r.xpending_range(keys.SEARCHES, keys.QA_GROUP, "-", "+", 10), "acked where it was answered"


@pytest.mark.parametrize("reader", ["none", "idle"])
def test_with_no_live_process_with_the_log_a_search_gets_its_error_at_once(rt, world, monkeypatch, reader):
    """No reader of `svqa:searches` ever (no queue, no group), or only ones idle too long: the
    process without the log replies with the error itself, forwarding nothing."""
    from qa_worker import routing

    r = world["r"]
    r.delete(keys.SEARCHES)
    if reader == "idle":
        redisio.ensure_group(r, keys.SEARCHES, keys.QA_GROUP)
        r.xreadgroup(keys.QA_GROUP, "gone", {keys.SEARCHES: ">"})
        monkeypatch.setattr(routing, "SEARCHER_IDLE_MS", 0)  # every consumer idle too long
    with qa_service(rt, world, "lacker", None) as lacker:
        qid = ask_search(r, QUERY)
        lacker.step()
        final = final_of(r, qid)
    assert final.error is not None and "no frames log (framelog_dir)" in final.error
    assert not r.xrange(keys.SEARCHES), "nothing forwarded"
    assert not r.xpending_range(keys.QUESTIONS, keys.QA_GROUP, "-", "+", 10, consumername="lacker")


def test_a_search_forwarded_twice_is_queued_once(world):
    """A forwarder that died between the forward and the ack: the one that claims the entry
    forwards it again, and the marker of its id stops the copy."""
    from qa_worker.routing import forward_search

    r = world["r"]
    r.delete(keys.SEARCHES)
    fields = {b"id": b"s-once", b"search": QUERY.encode()}
    assert forward_search(r, "s-once", fields, 60, "1-0")
    assert not forward_search(r, "s-once", fields, 60, "1-0")
    ((_, entry),) = r.xrange(keys.SEARCHES)
    assert entry == {b"id": b"s-once", b"search": QUERY.encode(), b"asked": b"1-0"}


def test_a_search_asked_again_reuses_its_question_vector_and_finds_the_same(rt, world, worker, monkeypatch):
    """A question's vector is a forward on the GPU loop; the same text asked again (a page
    reloaded, a saved search) takes the kept one: the same hits, no second forward."""
    from qa_worker import searching

    made: list[str] = []
    real = searching.question_vector
    monkeypatch.setattr(searching, "question_vector", lambda rt_, q, layers: made.append(q) or real(rt_, q, layers))
    text = "Is a bicycle leaning on the wall?"
    first = worker.searcher.search(text, None, -math.inf, math.inf, 5)
    again = worker.searcher.search(text, None, -math.inf, math.inf, 5)
    assert made == [text] and first == again and first
