"""Issue 37.2 with real processes: a qa worker killed (-9) again and again while questions flow
refuses no valid question and answers each exactly once, and a question that kills every worker
that answers it is still refused after `max_deliveries` of them."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import redis

from common.engine.model import load_model
from common.engine.runtime import Runtime
from common.segment_store import DirectoryStore
from common.wire import keys
from common.wire.schemas import FinalAnswer, decode_answer
from qa_worker.client import Client
from tests.crashing import POISON
from tests.pipeline import Services, audited, wait_for
from tests.test_robust import CAM, drain, encoder, frame

# max_deliveries: one worker that dies answering a question alone is enough to refuse it. Before
# the fix one crash charged every question the worker had taken, so all of them were refused.
LIMIT = 1


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


def finals(r: redis.Redis, qid: str) -> list[FinalAnswer]:
    return [a for _, f in r.xrange(keys.answer(qid)) if isinstance(a := decode_answer(f), FinalAnswer)]


def pending_on(r: redis.Redis, consumer: str) -> int:
    return len(r.xpending_range(keys.questions(CAM), keys.QA_GROUP, "-", "+", 100, consumername=consumer))


def test_kill9s_with_questions_flowing_refuse_only_the_question_that_kills(rt, redis_url, tmp_path: Path):
    r = redis.Redis.from_url(redis_url)
    svc = encoder(rt, r, redis_url, store=DirectoryStore(tmp_path / "segments"))  # where the qa processes read
    for seq in range(4):
        r.xadd(keys.frames(CAM), frame(seq))
    drain(svc, r)
    services = Services(redis_url, tmp_path, SVQA_STREAMS=CAM, SVQA_MAX_IN_FLIGHT="4", SVQA_MAX_DELIVERIES=str(LIMIT))
    client, asked = Client(r), []

    def ask(n: int) -> None:
        asked.extend(client.submit(CAM, f"question {len(asked)}?", max_tokens=4) for _ in range(n))

    def refused() -> dict[str, str]:
        return {qid: a[0].error for qid in asked if (a := finals(r, qid)) and a[0].error}

    def start() -> object:  # the same consumer each time, as a restarted container: a new life
        return services.start("qa", "--consumer", "qa-1", module="tests.crashing")

    poison = client.submit(CAM, f"{POISON}!", max_tokens=4)
    ask(6)  # taken in the poison's batch, behind it
    try:
        for _ in range(2):  # it kills the worker that begins it beside others, then alone
            worker = start()
            wait_for(lambda w=worker: w.poll() is not None or finals(r, poison), 120, "the poison's end", services)
            assert worker.poll() == -signal.SIGKILL, f"refused too early, with {refused()}"
            ask(2)
        worker = start()  # refuses the poison, answers the rest, and is killed while it answers more
        ask(2)  # answered once the poison and the questions a death left as suspects are done
        wait_for(lambda: finals(r, asked[-1]), 120, "this life's first answers", services)
        ask(8)
        wait_for(lambda: pending_on(r, "qa-1"), 60, "questions taken", services, poll_s=0.002)
        worker.send_signal(signal.SIGKILL)
        assert worker.wait(timeout=30) == -signal.SIGKILL
        ask(2)
        start()
        for qid in asked:
            wait_for(lambda q=qid: finals(r, q), 120, f"an answer to {qid}", services)
        assert not refused(), f"{len(refused())} of {len(asked)} valid questions refused: {refused()}"
        assert all(len(finals(r, qid)) == 1 for qid in asked), "exactly one final each"
        wait_for(lambda: {*asked, poison} <= set(audited(r)), 60, "every audit copy", services)
        assert sorted(audited(r)) == sorted([*asked, poison]), "one audit copy each"
        (verdict,) = finals(r, poison)
        assert verdict.error == "question not answered: under way alone in 1 worker(s) that died (limit 1)"
    finally:
        services.stop_all()
