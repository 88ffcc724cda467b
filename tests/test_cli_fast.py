"""Commands that run no model never import torch, so they start at once (`streamvqa ask` used to
spend 7 s importing it for a 0.5 s answer)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import redis

from apps import cli, status
from common.config import DEFAULT_REDIS_URL
from common.version import VERSION
from common.wire import keys

# Runs a command in-process, then reports which heavy modules it pulled in.
PROBE = """
import json, sys
from apps import cli
try:
    rc = cli.main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print(json.dumps({"rc": rc, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""
WIDE = {**os.environ, "COLUMNS": "200"}  # argparse wraps help at the terminal's width


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["status", "--json"],
        ["transcript", "--stream", "cam1", "--format", "json"],
        ["ask", "--stream", "cam1", "--timeout", "0.5", "hello"],  # nobody answers: times out, exit 1
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_tools_do_not_import_torch(argv, redis_url):
    with redis.Redis.from_url(redis_url) as r:  # the stream exists (ingest described it): no one answers
        r.hset(keys.meta("cam1"), "fps", "2")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv, "--redis-url", redis_url], capture_output=True, text=True, timeout=60
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    # What the command imported is the oracle: its wall time (under a second on an idle machine)
    # is the loaded machine's as much as the command's, a benchmark's business, not a test's.
    assert report["heavy"] == [], out.stderr
    assert report["rc"] in (0, 1), out.stderr


def test_version():
    out = subprocess.run(
        [sys.executable, "-m", "apps.cli", "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == f"streamvqa {VERSION}"
    assert VERSION != "0+unknown"  # the package is installed (make test installs it)


@pytest.mark.parametrize("password", ["Pw#s3cret", "Pw/s3cret", "Pw?s3cret", "Pw@s3cret"])
@pytest.mark.parametrize("command", [["status"], ["ask", "--stream", "cam1", "--timeout", "0.5", "hi"]])
def test_a_password_with_url_delimiters_is_never_shown(command, password, redis_url):
    """An unescaped '#', '/', '?' or '@' in a password ends the URL's userinfo early for a URL
    parser: the redaction missed the rest of it, and the config check quoted the parser's error
    ("Port could not be cast to integer value as 'Pw'")."""
    url = redis_url.replace("redis://", f"redis://:{password}@")
    out = subprocess.run(
        [sys.executable, "-m", "apps.cli", *command, "--redis-url", url], capture_output=True, text=True, timeout=60
    )
    assert out.returncode in (0, 1, 2, 3), out.stderr
    for piece in ("Pw", "s3cret"):
        assert piece not in out.stdout + out.stderr, out.stdout + out.stderr


def test_top_level_help_imports_no_torch_and_describes_every_command():
    out = subprocess.run([sys.executable, "-c", PROBE, "--help"], capture_output=True, text=True, timeout=60, env=WIDE)
    *help_lines, last = out.stdout.strip().splitlines()
    report = json.loads(last)
    assert report == {"rc": 0, "heavy": []}, out.stderr
    text = "\n".join(help_lines)
    for name, (_, line) in cli.SERVICES.items():
        assert re.search(rf"^\s+{name}\s+{re.escape(line)}$", text, re.M), f"{name}: {line!r} not in\n{text}"


def test_ask_help_names_the_redis_variable():
    out = subprocess.run(
        [sys.executable, "-m", "apps.cli", "ask", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    assert "SVQA_REDIS_URL" in out.stdout and "--redis-url URL" in out.stdout


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["ask", "--help"], ["status"], ["transcript", "--stream", "cam1", "--format", "json"]],
    ids=" ".join,
)
def test_a_reader_that_goes_away_ends_the_command_quietly(argv, redis_url):
    """`streamvqa status | head -1`: the reader closed the pipe before the output was written."""
    with redis.Redis.from_url(redis_url) as r:
        r.hset(keys.meta("cam1"), "fps", "2")
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "apps.cli", *argv],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env={**os.environ, "SVQA_REDIS_URL": redis_url},
        )
    finally:
        os.close(write)
    quiet = 0 if "--help" in argv else cli.EXIT_PIPE  # argparse drops its help's write errors itself
    assert out.stderr == "" and out.returncode == quiet, out.stderr


def test_status_names_its_redis_and_gives_live_capture_times_as_local_time_and_age():
    now = time.time()
    head = {"version": 3, "tokens": 100, "last_frame_seq": 9, "ranges": [[now - 65, now - 5]], "age_s": 0.5}
    found = {
        "redis": "redis://:***@h:6379/0",
        "at": now,
        "streams": [
            {
                "stream": "cam1",
                "live": True,
                "head": head | {"lag_s": 5.0},
                **{"lease": None, "frames": {}, "questions": {}, "source": "rtsp://cam", "grid": "448x448"},
            }
        ],
        **{"workers": [], "questions": {}, "dead_letters": 0},
    }
    lines = status.render(found).splitlines()
    assert lines[0] == "redis redis://:***@h:6379/0"
    first, last = (time.strftime("%H:%M:%S", time.localtime(t)) for t in (now - 65, now - 5))
    assert f"video {first}-{last} (newest 5.0s ago)" in lines[1], lines[1]
    assert str(int(now - 5)) not in lines[1]  # no epoch seconds


def test_status_of_a_stream_with_no_cache_yet_gives_no_version_age():
    """A stream with no head (a camera never connected) read `version age -s`."""
    found = {
        "at": time.time(),
        "streams": [
            {
                "stream": "cam1",
                "live": True,
                "head": None,
                "last_event": {"type": "reconnecting"},
                **{"lease": None, "frames": {}, "questions": {}, "source": None, "grid": None},
            }
        ],
        **{"workers": [], "questions": {}, "dead_letters": 0},
    }
    line = status.render(found).splitlines()[0]
    assert "version age -  " in line and "-s" not in line, line


def test_status_first_line_says_which_redis_it_asked(redis_url):
    out = subprocess.run(
        [sys.executable, "-m", "apps.cli", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SVQA_REDIS_URL": redis_url},
        check=True,
    )
    assert out.stdout.splitlines()[0] == f"redis {redis_url}"


def test_status_says_when_it_asked_the_default_redis(monkeypatch):
    """Without SVQA_REDIS_URL or --redis-url, status asks redis://localhost:6379/0, maybe an
    unrelated Redis: its first line says so."""
    monkeypatch.delenv("SVQA_REDIS_URL", raising=False)
    assert status._default_redis(DEFAULT_REDIS_URL) and not status._default_redis("redis://h:6379/0")
    monkeypatch.setenv("SVQA_REDIS_URL", DEFAULT_REDIS_URL)
    assert not status._default_redis(DEFAULT_REDIS_URL)  # chosen, the same URL or not
    found = {"redis": DEFAULT_REDIS_URL, "redis_is_default": True, "at": 0.0, "streams": [], "workers": []}
    first = status.render(found | {"questions": {}, "dead_letters": 0}).splitlines()[0]
    assert first == f"redis {DEFAULT_REDIS_URL} (the default: SVQA_REDIS_URL is not set)"


def test_ask_says_how_long_a_question_waited_in_the_queue_as_well_as_its_compute():
    """A question that waited 31 s in the queue once showed only its 0.59 s of compute."""
    from common.wire.schemas import FinalAnswer
    from qa_worker.client import timing_line

    final = FinalAnswer("q1", "cam1", text="a van", first_token_s=0.08, total_s=0.59, queue_s=31.2, elapsed_s=31.8)
    assert timing_line(final) == (
        "waited 31.20 s in the queue, answered in 0.59 s (first token 0.08 s), 31.80 s in all"
    )
    assert timing_line(FinalAnswer("q2", "cam1", text="x", total_s=0.5)) == "answered in 0.50 s"
    assert timing_line(FinalAnswer("q3", "cam1", error="bad question")) is None


def _wait_for_queued(r: redis.Redis, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Until the command's question or search is queued: it then waits in its read loop."""
    deadline = time.monotonic() + timeout_s
    while not r.xlen(keys.QUESTIONS):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


@pytest.mark.parametrize("argv", [["ask", "--stream", "cam1", "hi"], ["search", "x"]], ids=lambda a: a[0])
def test_ctrl_c_while_waiting_is_one_line_and_exit_130(argv, redis_url):
    """Ctrl-C while `ask` or `search` waited for its answer printed redis-py's KeyboardInterrupt
    traceback, and the process died by the signal."""
    import signal

    with redis.Redis.from_url(redis_url) as r:
        r.hset(keys.meta("cam1"), "fps", "2")  # the stream exists; no worker answers
        proc = subprocess.Popen(
            [sys.executable, "-m", "apps.cli", *argv, "--timeout", "60", "--redis-url", redis_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _wait_for_queued(r, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == cli.EXIT_INTERRUPTED == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["event"] == "interrupted", err
    assert out == ""


def _answer_once(r: redis.Redis, text: str) -> None:
    """A stand-in worker: answers the one queued question with `text`, as a delta and a final."""
    from common.wire.schemas import FinalAnswer, encode_delta, encode_final

    deadline = time.monotonic() + 30
    while not (entries := r.xrange(keys.QUESTIONS)):
        assert time.monotonic() < deadline, "no question queued"
        time.sleep(0.05)
    entry_id, fields = entries[0]
    qid = fields[b"id"].decode()
    r.xadd(keys.answer(qid), encode_delta(text))
    final = FinalAnswer(qid, "cam1", text=text, total_s=0.1, asked=entry_id.decode())
    r.xadd(keys.answer(qid), encode_final(final))


ESCAPES = "a\x1b]0;owned\x07b\x1b[2Jc\x08d\x00e\tf\ng"


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_ask_shows_a_terminal_no_control_character_of_the_answer(terminal, redis_url):
    """A random-weight model's answers (`tiny-random`, README) beeped and garbled the terminal
    `ask` printed them on (BEL, vertical tab, DEL, ...), and an answer with an escape sequence
    could retitle or clear it. On a terminal each is U+FFFD now; a pipe gets the text exactly."""
    import pty
    import threading

    with redis.Redis.from_url(redis_url) as r:
        r.hset(keys.meta("cam1"), "fps", "2")
        master, slave = pty.openpty() if terminal else os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-m", "apps.cli", "ask", "--stream", "cam1", "hi", "--redis-url", redis_url],
            stdout=slave,
            stderr=subprocess.PIPE,
        )
        os.close(slave)
        responder = threading.Thread(target=_answer_once, args=(r, ESCAPES))
        responder.start()
        out = b""
        while chunk := _read(master):
            out += chunk
        responder.join()
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        os.close(master)
    text = out.decode().replace("\r\n", "\n")  # a terminal's line discipline
    if terminal:
        assert text == "a\ufffd]0;owned\ufffdb\ufffd[2Jc\ufffdd\ufffde\tf\ng\n", repr(text)
    else:
        assert text == ESCAPES + "\n", repr(text)


def _read(fd: int) -> bytes:
    """What the command wrote, until it closed its end (a pty's master reads EIO then)."""
    try:
        return os.read(fd, 4096)
    except OSError:
        return b""


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf"])
@pytest.mark.parametrize("argv", [["ask", "--stream", "cam1", "hi"], ["search", "x"]], ids=lambda a: a[0])
def test_a_timeout_that_waits_for_nothing_is_refused_before_anything_is_queued(argv, timeout, redis_url):
    """`--timeout -1` or `nan` queued the question, then gave it up at once (exit 1): a worker
    answered it for nobody."""
    with redis.Redis.from_url(redis_url) as r:
        r.hset(keys.meta("cam1"), "fps", "2")
        out = subprocess.run(
            [sys.executable, "-m", "apps.cli", *argv, "--timeout", timeout, "--redis-url", redis_url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "timeout" in json.loads(lines[0])["error"], out.stderr
        assert r.xlen(keys.QUESTIONS) == 0
