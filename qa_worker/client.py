"""Asking from Python or the shell: `streamvqa ask` and `streamvqa transcript`.

The protocol is plain Redis: XADD a question to `svqa:questions`, read `svqa:answer:{id}` until
the entry with type=final. Nothing here is needed to use it (redis-cli works the same).

Answer-stream entries: `type=delta` with `text` and `attempt` (1, 2, …: how often the question
was taken up), then one `type=final`. When a worker dies mid-answer, another answers again from
the start with the next attempt number: a reader keeps only the deltas of the highest attempt it
has seen and drops what it held of earlier ones, so the deltas it keeps concatenate to the
final text. While the question waits for the GPU, deltas with no text carry its `position` and
estimated `wait_s` (common/wire/schemas.py AnswerDelta).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import unicodedata
from collections.abc import Callable, Iterator
from typing import TextIO

import redis

from common import boot, redisio, stream_status
from common.config import RedisSettings, add_tool_flags
from common.engine.params import MAX_NEW_TOKENS
from common.logs import configure_logging, redact_url
from common.wire import keys
from common.wire.schemas import (
    AnswerDelta,
    FinalAnswer,
    SchemaError,
    check_stream_name,
    checked_question,
    decode_answer,
    encode_question,
)
from common.wire.search_request import checked_search, encode_search
from common.wire.timeref import TimeRef, parse_time_ref


class Client:
    def __init__(self, r: redis.Redis):
        self.r = r

    def submit(self, stream: str, question: str, **options) -> str:
        """Queue a question; SchemaError, with nothing sent, for one a worker would refuse."""
        return self._submit(stream, question, **options)[0]

    def _submit(self, stream: str, question: str, **options) -> tuple[str, str]:
        """The question's id and its entry id in `svqa:questions` (what its final's `asked` names)."""
        q = checked_question(stream, question, **options)
        return q.id, redisio.text(self.r.xadd(keys.QUESTIONS, encode_question(q)))

    def known(self, stream: str, *also: str) -> bool:
        """Whether the stream exists (the API's check: its 404), or any of the keys ``also`` does
        (a transcript outlives the stream's head and meta, and is still worth reading)."""
        return bool(self.r.exists(*stream_status.presence_keys(stream), *also))

    def replies(self, qid: str, timeout_s: float = 120.0) -> Iterator[AnswerDelta | FinalAnswer]:
        """Deltas as they arrive, then the final answer; TimeoutError if none comes in time."""
        deadline, last = time.monotonic() + timeout_s, "0"
        while (left := deadline - time.monotonic()) > 0:
            got = self.r.xread({keys.answer(qid): last}, block=int(min(left, 1.0) * 1000)) or []
            for _, entries in got:
                for entry_id, fields in entries:
                    last = entry_id
                    reply = decode_answer(fields)
                    yield reply
                    if isinstance(reply, FinalAnswer):
                        return
        raise TimeoutError(f"no final answer for question {qid} within {timeout_s:g} s")

    def ask(
        self,
        stream: str,
        question: str,
        on_delta: Callable[[str], None] | None = None,
        timeout_s: float = 120.0,
        on_restart: Callable[[int], None] | None = None,
        on_queued: Callable[[int, float | None], None] | None = None,
        **options,
    ) -> FinalAnswer:
        """Ask and wait for the final answer. ``on_delta`` gets text as it is decoded; when the
        answer starts over (its worker died), ``on_restart(attempt)`` says to drop what it got;
        while it waits for the GPU, ``on_queued(position, wait_s)`` its place and estimated wait."""
        qid, asked = self._submit(stream, question, **options)
        attempt = 0
        for reply in self.replies(qid, timeout_s):
            if isinstance(reply, FinalAnswer):
                return own_final(reply, asked, stream)
            if reply.attempt < attempt:
                continue  # a dead attempt's delta, read after its successor's
            if reply.attempt > attempt:
                if attempt and on_restart:
                    on_restart(reply.attempt)
                attempt = reply.attempt
            if reply.position is not None:
                if on_queued:
                    on_queued(reply.position, reply.wait_s)
            elif on_delta:
                on_delta(reply.text)
        raise AssertionError("unreachable")

    def search(self, text: str, timeout_s: float = 120.0, **options) -> FinalAnswer:
        """Search the cameras' past (``stream``, ``since``, ``until``, ``limit``: common/wire/search_request.py)
        and wait for the final, whose ``hits`` are the ranked chunks; SchemaError, with nothing
        sent, for a search a worker would refuse."""
        req = checked_search(text, **options)
        asked = redisio.text(self.r.xadd(keys.QUESTIONS, encode_search(req)))
        for reply in self.replies(req.id, timeout_s):
            if isinstance(reply, FinalAnswer):
                return own_final(reply, asked, req.stream)
        raise AssertionError("unreachable")

    def transcript(self, stream: str) -> list[dict[str, str]]:
        return [redisio.text_fields(f) for _, f in self.r.xrange(keys.transcript(stream))]


def own_final(final: FinalAnswer, asked: str, stream: str | None) -> FinalAnswer:
    """``final`` if it answers the question asked as entry ``asked`` (about ``stream``), else an
    error final: another question used the same id, and this is its answer (the router does not
    answer the second one), which the asker would otherwise take for its own."""
    other_entry = final.asked is not None and final.asked != asked
    other_stream = stream is not None and final.stream is not None and final.stream != stream
    if not (other_entry or other_stream):
        return final
    error = f"question id {final.id} is in use by another question (entry {final.asked}): ask with a new random id"
    return FinalAnswer(final.id, stream, error=error, param="id", asked=asked)


def main(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    what = "Ask about a stream: the answer as it is decoded" if command == "ask" else "A stream's transcript"
    p = argparse.ArgumentParser(prog=f"streamvqa {command}", description=what)
    add_tool_flags(p, RedisSettings, ["redis_url"])
    p.add_argument("--stream", required=True, help="the camera's stream name")
    if command == "ask":
        p.add_argument("question")
        p.add_argument("--max-tokens", type=int, default=128, help=f"1..{MAX_NEW_TOKENS} (default 128)")
        p.add_argument("--choices", nargs="+", default=None, help="multiple choice options")
        p.add_argument(
            "--since",
            help="ask about a past span from the frames log, not the live cache: seconds before now (90, 90s, "
            "15m, 1h, 2h30m, 1d) or an ISO 8601 time (2026-11-28T02:00; without an offset, this machine's time)",
        )
        p.add_argument("--until", help="the span's end, in the same forms (default: now)")
        p.add_argument(
            "--scope",
            choices=["live", "history"],
            default="live",
            help="history: answered over the camera's past chunks that rank best for the question (within "
            "--since/--until if given), from the frames log (default: live, or the span's evenly spaced chunks)",
        )
        p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the final answer")
    else:
        p.add_argument("--format", choices=["vtt", "srt", "json"], default="vtt")
    ns = p.parse_args(rest)
    configure_logging("WARNING")
    prog = f"streamvqa {command}"
    try:
        check_stream_name("stream", ns.stream)
        if command == "ask":  # refused here, before a round trip, as a worker would refuse it
            checked_question(ns.stream, ns.question, **_options(ns))
            checked_timeout(ns.timeout)
    except SchemaError as e:
        boot.fail(boot.EXIT_CONFIG, "bad configuration", service=prog, error=str(e))
    client = Client(boot.connect_tool(ns.redis_url, prog))
    try:
        also = () if command == "ask" else (keys.transcript(ns.stream),)
        if not client.known(ns.stream, *also):  # at once, not after a worker's error reply
            where = {"stream": ns.stream, "redis": redact_url(ns.redis_url)}
            boot.fail(boot.EXIT_CONFIG, "unknown stream", service=prog, **where)
        return _ask(client, ns) if command == "ask" else _transcript(client, ns)
    except SchemaError as e:
        boot.fail(boot.EXIT_CONFIG, "bad question", service=prog, error=str(e))
    except redis.RedisError as e:
        boot.fail(boot.EXIT_REDIS, "redis failed", service=prog, error=str(e))
    except TimeoutError as e:
        boot.fail(1, "no answer", service=prog, error=str(e))


def _options(ns: argparse.Namespace) -> dict:
    span = {name: _time_ref(name, getattr(ns, name)) for name in ("since", "until")}
    choices = tuple(ns.choices) if ns.choices else None
    return {"max_tokens": ns.max_tokens, "choices": choices, "scope": ns.scope, **span}


def checked_timeout(seconds: float) -> float:
    """``--timeout`` of `ask` and `search`: a wait of no time (0, -1, nan) would queue the question
    and give it up at once, leaving a worker to answer it for nobody."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise SchemaError("timeout", f"must be a number of seconds > 0, not {seconds:g}")
    return seconds


def _time_ref(name: str, text: str | None) -> TimeRef | None:
    """A span edge as typed at a terminal: a time without an offset is this machine's local time."""
    if text is None:
        return None
    try:
        return parse_time_ref(text, naive_is_local=True)
    except ValueError as e:
        raise SchemaError(name, str(e)) from None


def for_terminal(text: str) -> str:
    """Model text as a terminal may show it: a control character (ESC, BEL, ...; line breaks and
    tabs kept) as U+FFFD. Answers are the model's, steered by what a camera sees: a random-weight
    model's beeped and garbled the terminal, and an escape sequence in one could rewrite it."""
    return "".join("\ufffd" if unicodedata.category(ch) == "Cc" and ch not in "\n\t" else ch for ch in text)


def _ask(client: Client, ns: argparse.Namespace) -> int:
    place = Place(sys.stderr)
    shown = for_terminal if sys.stdout.isatty() else str  # a pipe gets the answer exactly

    def delta(text: str) -> None:
        place.clear()
        print(shown(text), end="", flush=True)

    final = client.ask(
        ns.stream,
        ns.question,
        on_delta=delta,
        timeout_s=ns.timeout,
        on_restart=_restarted,
        on_queued=place.show,
        **_options(ns),
    )
    place.clear()
    if final.error:
        print(f"error: {final.error}", file=sys.stderr)
        return 1
    if final.choice is not None:
        print(shown(final.choice))
    else:
        print()
    if (timing := timing_line(final)) is not None:
        print(timing, file=sys.stderr)
    print(json.dumps({k: v for k, v in vars(final).items() if k != "text"}, default=str), file=sys.stderr)
    return 0


class Place:
    """A question's place in the queue on stderr while it waits: on a terminal one line, rewritten
    as the place changes and erased when the answer begins; elsewhere a line each time."""

    def __init__(self, out: TextIO):
        self.out, self.shown = out, False
        self.terminal = out.isatty()

    def show(self, position: int, wait_s: float | None) -> None:
        line = queued_line(position, wait_s)
        if self.terminal:
            self.out.write(f"\r\x1b[K{line}")
            self.shown = True
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def clear(self) -> None:
        if self.shown:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self.shown = False


def queued_line(position: int, wait_s: float | None) -> str:
    """`queued: position 3, ~2.5 s`; without the estimate while the worker has none."""
    if wait_s is None:
        return f"queued: position {position}"
    return f"queued: position {position}, ~{wait_s:.{0 if wait_s >= 10 else 1}f} s"


def timing_line(final: FinalAnswer) -> str | None:
    """Where a question's time went, as a person reads it: the queue, then the answering, then all
    of it (a question that waited 31 s in the queue once showed only its 0.59 s of compute)."""
    if final.total_s is None:
        return None
    parts = [f"answered in {final.total_s:.2f} s"]
    if final.first_token_s is not None:
        parts[0] += f" (first token {final.first_token_s:.2f} s)"
    if final.queue_s is not None:
        parts.insert(0, f"waited {final.queue_s:.2f} s in the queue")
    if final.elapsed_s is not None:
        parts.append(f"{final.elapsed_s:.2f} s in all")
    return ", ".join(parts)


def _restarted(attempt: int) -> None:
    """The worker died mid-answer: end the partial line, so stdout's last line is the whole answer."""
    print(flush=True)
    print(f"(answer restarted from the beginning: attempt {attempt})", file=sys.stderr, flush=True)


def _transcript(client: Client, ns: argparse.Namespace) -> int:
    from common.wire.transcript import by_start, cues_of, entry_json, render_transcript

    entries = client.transcript(ns.stream)
    if ns.format == "json":
        print(json.dumps([entry_json(e) for e in by_start(entries)], indent=1))
        return 0
    print(render_transcript(cues_of(entries), ns.format), end="")
    return 0
