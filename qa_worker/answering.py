"""One question, start to finish: validate, snapshot, stream deltas, write exactly one final answer.

Errors are answers: anything wrong with a question becomes a final entry with `error`, so the
asker is never left waiting and the worker never stops. The final entry is written before the
question is acked; a redelivered question whose final answer exists is only acked.

`handle` is the per-entry function; `handle_entries` runs it inside the processing boundary
(`redisio.process`): any exception, or a question that `max_deliveries` workers died answering
alone (one that kills its worker: `redisio.Attempts`), becomes an error reply (or a dead letter
when the entry has no usable id). Every attempt's number, carried by its deltas, is higher than
the one before.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import redis
import structlog

from common import metrics, redisio
from common.decoding import FrameDecoder
from common.engine.answer import HeadSource, Waiting, ask, choose
from common.engine.grid import StreamSpec
from common.engine.kvcache import Version
from common.engine.params import GenerationParams, QuestionError
from common.engine.runtime import Runtime
from common.wire import keys
from common.wire.schemas import (
    FinalAnswer,
    Question,
    SchemaError,
    encode_delta,
    encode_final,
    encode_queued,
    parse_question,
    question_id_of,
)
from common.wire.search_request import is_search
from qa_worker.admission import Admission, Ticket
from qa_worker.history import History, HistoryError, LoggedChunk, Seen, span_of
from qa_worker.searching import Searcher, SearchError

log = structlog.get_logger()

# The final entry and the reply's expiry, unless the reply already ends with a final entry: then
# that entry's fields (KEYS[1]: the answer key; ARGV: ttl, then field, value, ...).
_WRITE_FINAL = """
local last = redis.call('xrevrange', KEYS[1], '+', '-', 'COUNT', 1)[1]
if last then
  local f = last[2]
  for i = 1, #f, 2 do
    if f[i] == 'type' and f[i + 1] == 'final' then return f end
  end
end
redis.call('xadd', KEYS[1], '*', unpack(ARGV, 2))
redis.call('expire', KEYS[1], ARGV[1])
return false
"""

VersionLookup = Callable[[str, int | None], Version | None]  # (stream, at) -> version


class Answerer:
    def __init__(
        self,
        rt: Runtime,
        r: redis.Redis,
        lookup: VersionLookup,
        serves: Callable[[str], bool],
        *,
        consumer: str = "qa",
        reply_ttl_s: int = 3600,
        max_reply_ttl_s: int = 86_400,
        answers_maxlen: int = 10_000,
        max_deliveries: int = redisio.MAX_DELIVERIES,
        framelog_dir: str | None = None,
        history_max_tokens: int = 8192,
        admission: Admission | None = None,
        history_max_concurrent: int = 2,
        max_queue_wait_s: float = 30.0,
        live_tokens: int | None = None,
        decoder: FrameDecoder | None = None,
    ):
        """`live_tokens`, `decoder`: what `History` takes (history.py): the KV pool tokens the live
        streams are guaranteed, the processes that decode logged frames."""
        self.rt, self.r, self.lookup, self.serves = rt, r, lookup, serves
        self.admission = admission or Admission()
        self.history = History(
            rt,
            r,
            framelog_dir,
            history_max_tokens,
            max_concurrent=history_max_concurrent,
            max_wait_s=max_queue_wait_s,
            live_tokens=live_tokens,
            decoder=decoder,
        )
        self.searcher = Searcher(rt, framelog_dir)
        self.consumer, self.max_deliveries = consumer, max_deliveries
        self.reply_ttl_s, self.max_reply_ttl_s, self.answers_maxlen = reply_ttl_s, max_reply_ttl_s, answers_maxlen
        self.attempts = redisio.Attempts(r, consumer, reply_ttl_s)

    def handle_entries(self, entries: list[redisio.Entry], alone: bool = False) -> None:
        """Answer question entries, each inside the processing boundary; never raises for
        what an entry holds (only for Redis being unreachable). ``alone``: no other question is
        under way meanwhile (``redisio.Attempts``)."""
        redisio.process(
            self.r,
            keys.QA_GROUP,
            self.consumer,
            entries,
            self.handle,
            self.reject,
            max_deliveries=self.max_deliveries,
            attempts=self.attempts,
            alone=alone,
        )

    def handle(self, queue: str, entry_id: str, fields: dict, attempt: int = 1) -> None:
        """Answer one entry of ``queue`` (`svqa:questions` or a stream's own) and ack it there
        (``attempt``: its number, carried by the deltas)."""
        qid = question_id_of(fields, entry_id)
        if qid is None:
            redisio.dead_letter(self.r, queue, entry_id, fields, "no usable question id", group=keys.QA_GROUP)
            return
        bound = log.bind(qid=qid)
        existing = self._final_of(qid)
        if existing is not None:
            bound.info("redelivered question already answered")
            self._audit(qid, existing, self.max_reply_ttl_s)  # in case the crash came before it
        else:
            asked = asked_of(queue, entry_id, fields)
            waited = queue_wait_s(asked)
            t0 = time.perf_counter()
            with metrics.QUESTIONS_IN_FLIGHT.track_inprogress():
                final, ttl = self._answer(qid, fields, attempt, bound, asked_at=time.time() - waited)
            elapsed = waited + time.perf_counter() - t0
            waited += final.queue_s or 0.0  # what it then waited here: for a history turn, for the GPU
            metrics.QUEUE_WAIT_SECONDS.observe(waited)
            timing = {"queue_s": round(waited, 3), "elapsed_s": round(elapsed, 3)}
            self._finish(dataclasses.replace(final, asked=asked, **timing), ttl)
            metrics.QUESTIONS.labels("error" if final.error else "ok").inc()
            metrics.ANSWER_SECONDS.observe(time.perf_counter() - t0)
            if final.first_token_s is not None:
                metrics.FIRST_TOKEN_SECONDS.observe(final.first_token_s)
        self.r.xack(queue, keys.QA_GROUP, entry_id)

    def reject(self, queue: str, entry_id: str, fields: dict, reason: str) -> None:
        """The boundary's verdict on an entry that failed: an error reply if it has an id, else a
        dead letter; acked either way."""
        qid = question_id_of(fields, entry_id)
        if qid is None:
            redisio.dead_letter(self.r, queue, entry_id, fields, reason, group=keys.QA_GROUP)
            return
        existing = self._final_of(qid)
        if existing is not None:
            self._audit(qid, existing, self.max_reply_ttl_s)
        else:
            error = f"question not answered: {reason}"
            self._finish(FinalAnswer(qid, None, error=error, asked=asked_of(queue, entry_id, fields)), self.reply_ttl_s)
            metrics.QUESTIONS.labels("error").inc()
        self.r.xack(queue, keys.QA_GROUP, entry_id)

    def _answer(self, qid: str, fields: dict, attempt: int, bound, asked_at: float) -> tuple[FinalAnswer, int]:
        """The final answer and how long its reply stream lives (``asked_at``: when the question
        was asked, what `since` and `until` count back from). A search (`search` instead of
        `question`) is answered here too: its final carries its `hits` (search.py)."""
        if is_search(fields):
            final, req = self.searcher.answer(qid, fields, asked_at)
            return final, min((req.reply_ttl if req else None) or self.reply_ttl_s, self.max_reply_ttl_s)
        try:
            q = parse_question(fields)
        except SchemaError as e:
            bound.warning("bad question", error=str(e))
            return FinalAnswer(id=qid, stream=None, error=f"bad question: {e}"), self.reply_ttl_s
        ttl = min(q.reply_ttl or self.reply_ttl_s, self.max_reply_ttl_s)
        return self._answer_valid(q, bound.bind(stream=q.stream), ttl, attempt, asked_at), ttl

    def _answer_valid(self, q: Question, bound, ttl: int, attempt: int, asked_at: float) -> FinalAnswer:
        qid = q.id
        if not self.serves(q.stream):
            return FinalAnswer(id=qid, stream=q.stream, error=f"unknown stream {q.stream!r}", param="stream")
        if q.about_past:
            return self._answer_span(q, bound, ttl, attempt, asked_at)
        version = self.lookup(q.stream, q.at)
        if version is None and q.at is not None:
            error = f"stream {q.stream!r}: version {q.at} is not available (README: what `at` reaches)"
            return FinalAnswer(id=qid, stream=q.stream, error=error, param="at")
        if version is None:
            return FinalAnswer(id=qid, stream=q.stream, error=f"stream {q.stream!r}: no frames yet")
        if not version.chunks:
            return FinalAnswer(id=qid, stream=q.stream, error=f"stream {q.stream!r}: no frames yet")
        # A live question is answered from the head when it starts on the GPU, and holds none while
        # it waits (answer.py `Generation`); one with `at`, or a choice, from the version found now.
        pinned = version if q.at is not None or q.choices else None
        source: Version | HeadSource = pinned or self._live_head(q.stream)
        version = None  # not held here while the question waits for the GPU
        self.r.delete(keys.answer(qid))  # deltas of an attempt that died before its final entry
        at = pinned.id if pinned is not None else None
        try:
            final = self._run(q, source, ttl, attempt, _seen_live)
        except QuestionError as e:
            return FinalAnswer(id=qid, stream=q.stream, error=str(e), version=at)
        except (RuntimeError, ValueError) as e:  # e.g. out of GPU memory: this question fails, the worker goes on
            bound.exception("answering failed")
            return FinalAnswer(id=qid, stream=q.stream, error=f"internal error: {e}"[:500], version=at)
        bound.info("answered", version=final.version, first_token_s=final.first_token_s, tokens=final.tokens)
        return final

    def _live_head(self, stream: str) -> HeadSource:
        """The stream's head, looked up when the question starts (it had frames when taken; a head
        gone since, its stream handed off, fails the question with the reason)."""

        def head() -> Version:
            version = self.lookup(stream, None)
            if version is None or not version.chunks:
                raise QuestionError(f"stream {stream!r}: no frames yet")
            return version

        return head

    def _answer_span(self, q: Question, bound, ttl: int, attempt: int, asked_at: float) -> FinalAnswer:
        """A question about a past span: the span's chunks chosen from the frames log (evenly, or
        with scope history those that rank best for it), answered over."""
        try:
            spec, chunks = self._retrieved(q, asked_at) if q.scope == "history" else self.history.choose(q, asked_at)
        except (HistoryError, SearchError) as e:
            return FinalAnswer(id=q.id, stream=q.stream, error=str(e), param=e.param)
        return self.answer_over(q, chunks, ttl, attempt, spec=spec, bound=bound)

    def _retrieved(self, q: Question, asked_at: float) -> tuple[StreamSpec, list[LoggedChunk]]:
        """Scope history: as many of the stream's indexed chunks (in the span, if one is given) as
        `history_max_tokens` holds, the best ranked for the question (search.py), oldest first.
        Chunks of whole temporal patches only: no padding falls between chunks."""
        spec = self.history.spec(q.stream)
        t0, t1 = span_of(q, asked_at) if q.since is not None else (-math.inf, asked_at)
        hits = self.searcher.chunks(q.question, [q.stream], t0, t1, self.history.fit(spec))
        tp = self.rt.loaded.temporal_patch_size
        chunks = [
            LoggedChunk((h.first_seq, h.last_seq), (h.start, h.end), h.frames) for h in hits if h.frames % tp == 0
        ]
        if not chunks:
            raise HistoryError(f"stream {q.stream!r}: its search index holds no chunk of that span", param="scope")
        return spec, sorted(chunks, key=lambda c: c.capture_range)

    def answer_over(
        self,
        q: Question,
        chunks: Sequence[LoggedChunk],
        ttl: int,
        attempt: int = 1,
        *,
        spec: StreamSpec | None = None,
        bound=log,
    ) -> FinalAnswer:
        """Answer ``q`` exactly over these logged chunks of its stream, in this order (a past span's,
        a search's best): their frames read back from the frames log, encoded again into a
        temporary cache beside live work, answered there as from a live version, and let go of.
        The final's `ranges` are the chunks' capture-time ranges; errors are finals. Deltas go to
        the question's reply stream like any answer's (``attempt``: their attempt number), after
        its place while it waits for its turn at a temporary cache (`History.gate`). Its `queue_s`
        is that wait and then its wait for the GPU (encoding its cache is neither: it is work)."""
        self.r.delete(keys.answer(q.id))  # deltas of an attempt that died before its final entry
        write, gate = self._writer(q.id, ttl), self.history.gate.queue

        def tell(ticket: Ticket) -> None:
            self._tell_place(gate, ticket, write, attempt)

        try:
            with self.history.cache(spec or self.history.spec(q.stream), chunks, tell) as seen:
                final = self._run(q, seen.version, ttl, attempt, lambda _: _seen_past(seen))
        except HistoryError as e:
            return FinalAnswer(id=q.id, stream=q.stream, error=str(e), param=e.param, queue_s=e.queue_s)
        except QuestionError as e:
            return FinalAnswer(id=q.id, stream=q.stream, error=str(e))
        except (RuntimeError, ValueError) as e:  # e.g. no room in the KV pool: this question fails alone
            bound.exception("answering about the past failed")
            return FinalAnswer(id=q.id, stream=q.stream, error=f"internal error: {e}"[:500])
        bound.info(
            "answered about the past",
            ranges=final.ranges,
            cache_tokens=final.cache_tokens,
            tokens=final.tokens,
            decoded_s=round(seen.decoded_s, 4),  # from its turn: its records read, its first piece decoded
            encoded_s=round(seen.encoded_s, 4),  # and its whole cache encoded
        )
        return dataclasses.replace(final, queue_s=seen.waited_s + (final.queue_s or 0.0))

    def _run(
        self, q: Question, version: Version | HeadSource, ttl: int, attempt: int, seen: Callable[[Version], dict]
    ) -> FinalAnswer:
        """Answer from ``version`` (a live question's `HeadSource`: the head when it starts);
        ``seen(used)``: the final's fields that say what it was answered over."""
        t0 = time.perf_counter()
        if q.choices:
            assert isinstance(version, Version)
            common = dict(id=q.id, stream=q.stream, **seen(version))
            result = choose(self.rt, version, q.question, list(q.choices))
            scores = {c: s if math.isfinite(s) else -1e9 for c, s in zip(q.choices, result.scores, strict=True)}
            return FinalAnswer(
                text=result.choice, choice=result.choice, scores=scores, total_s=time.perf_counter() - t0, **common
            )
        params = GenerationParams(max_tokens=q.max_tokens, temperature=q.temperature, top_p=q.top_p)
        write = self._writer(q.id, ttl)

        def delta(text: str) -> None:
            write(encode_delta(text, attempt))

        admission = self.admission
        ticket = admission.take()
        waiting = Waiting(lambda: self._tell_place(admission, ticket, write, attempt), lambda: admission.start(ticket))
        try:
            answer = ask(self.rt, version, q.question, params, on_delta=delta, waiting=waiting)
        finally:
            self.admission.done(ticket)
        assert answer.used is not None
        common = dict(id=q.id, stream=q.stream, **seen(answer.used))
        return FinalAnswer(
            text=answer.text,
            first_token_s=answer.first_token_s,
            total_s=answer.total_s,
            tokens=len(answer.token_ids),
            queue_s=answer.queued_s,  # handle adds the wait before the question was taken
            **common,
        )

    def _writer(self, qid: str, ttl: int) -> Callable[[dict[str, str]], None]:
        """What appends an entry to the question's reply stream (and keeps it for `ttl`)."""
        reply = keys.answer(qid)

        def write(entry: dict[str, str]) -> None:
            self.r.xadd(reply, entry)
            self.r.expire(reply, ttl)

        return write

    def _tell_place(
        self, admission: Admission, ticket: Ticket, write: Callable[[dict[str, str]], None], attempt: int
    ) -> None:
        """A question waiting (for the GPU, or its turn at a history cache: `admission` counts
        those): its place and estimated wait, when they changed."""
        position = admission.position(ticket)
        if position is None or position == ticket.told:
            return
        ticket.told = position
        write(encode_queued(position, admission.wait_s(position), attempt))

    def _final_of(self, qid: str) -> dict | None:
        """The fields of the question's final entry, if it has one."""
        last = self.r.xrevrange(keys.answer(qid), count=1)
        return last[0][1] if last and last[0][1].get(b"type") == b"final" else None

    def _finish(self, final: FinalAnswer, ttl: int) -> None:
        """The final entry, then its audit copy: two steps, as the answer key and `svqa:answers` sit
        in different slots on a cluster. The first writes only if no final is there yet (one final
        per question id, whoever answered); the second copies the final that is there, once."""
        fields = encode_final(final)
        flat = [x for kv in fields.items() for x in kv]
        there = self.r.eval(_WRITE_FINAL, 1, keys.answer(final.id), ttl, *flat)
        self._audit(final.id, dict(zip(there[::2], there[1::2], strict=True)) if there else fields, ttl)
        if final.asked is not None:
            self._keep_claim(final.id, final.asked, ttl)

    def _keep_claim(self, qid: str, asked: str, ttl: int) -> None:
        """The id's claim (routing.py) lives as long as the answer stream it guards, from now: set
        at routing for `reply_ttl_s`, it ran out before a question's own longer `reply_ttl` did, and
        another question with the id was answered into this one's stream. Only a claim there is
        renewed, the one this question holds; nothing under a users.acl older than claims."""
        key = keys.answer_owner(qid)

        def renew() -> None:
            held = self.r.get(key)
            if held is not None and redisio.text(held) == asked:
                self.r.set(key, asked, xx=True, ex=ttl)

        redisio.unless_refused(renew, None, "the claim of question ids")

    def _audit(self, qid: str, fields: dict, ttl: int) -> None:
        """The final on `svqa:answers`, once per question id: a redelivered question whose final
        exists calls this again, as the crash may have come between the two steps."""
        redisio.xadd_once(self.r, keys.ANSWERS, keys.once(keys.ANSWERS, qid), fields, self.answers_maxlen, ttl)


def _seen_live(version: Version) -> dict:
    """What an answer from a live version says it saw: the version and the ranges it holds."""
    t_range = version.capture_range or (None, None)
    return dict(
        version=version.id,
        epoch=version.epoch or None,
        t_start=t_range[0],
        t_end=t_range[1],
        ranges=tuple(version.capture_ranges),
        cache_tokens=version.tokens,
    )


def _seen_past(seen: Seen) -> dict:
    """What an answer about the past says it saw: the chunks' ranges (no live version: none)."""
    return dict(
        t_start=seen.ranges[0][0], t_end=seen.ranges[-1][1], ranges=seen.ranges, cache_tokens=seen.version.tokens
    )


def asked_of(queue: str, entry_id: str, fields: dict) -> str:
    """The question's entry id in `svqa:questions`: its own there, else the one its forwarder wrote
    (routing.py; a client's own `asked` field in the shared queue would move its span, its reported
    wait and whose answer it is)."""
    asked = fields.get(b"asked") if queue != keys.QUESTIONS else None
    return redisio.text(asked or entry_id)


def queue_wait_s(entry_id: str | bytes) -> float:
    """Seconds since the question entered the queue (its stream id's milliseconds), never < 0."""
    ms = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-", 1)[0]
    return max(0.0, time.time() - int(ms) / 1000) if ms.isdigit() else 0.0
