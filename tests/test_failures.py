"""Every way a start can fail ends in one JSON line on stderr and a documented exit code:
2 configuration, 3 Redis, 4 model, 5 the GPU failing later (README "Operating it"). Each case runs the real command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port

GOOD_CAMERAS = "cameras:\n  - {name: cam1, url: /media/a.mp4, fps: 2}\n"
FILES = {
    "malformed.yaml": "cameras: [ {name: cam1\n",
    "unknown-camera.yaml": GOOD_CAMERAS + "jobs:\n  - {name: cap, stream: cam2, kind: caption, every_s: 5}\n",
    "good.yaml": GOOD_CAMERAS,
}

# (id, argv after `streamvqa`, exit code, a word the line must contain)
CASES = [
    ("cameras-file-missing", ["ingest", "--cameras-file", "{tmp}/nope.yaml"], 2, "nope.yaml"),
    ("cameras-file-malformed", ["ingest", "--cameras-file", "{tmp}/malformed.yaml"], 2, "invalid YAML"),
    ("job-unknown-camera", ["qa", "--cameras-file", "{tmp}/unknown-camera.yaml"], 2, "cam2"),
    ("metrics-port-busy", ["ingest", "--cameras-file", "{tmp}/good.yaml", "--metrics-port", "{busy}"], 2, "metrics"),
    ("bad-log-level", ["ingest", "--cameras-file", "{tmp}/good.yaml", "--log-level", "LOUD"], 2, "LOUD"),
    ("redis-url-http", ["ingest", "--cameras-file", "{tmp}/good.yaml", "--redis-url", "http://h:6379/0"], 2, "http"),
    ("redis-url-port", ["ingest", "--cameras-file", "{tmp}/good.yaml", "--redis-url", "redis://h:99999/0"], 2, "99999"),
    ("bad-stream-name", ["ingest", "--url", "/media/a.mp4", "--stream", "bad name!"], 2, "bad name!"),
    ("bad-streams", ["encoder", "--streams", "ok,bad name!"], 2, "bad name!"),
    ("ask-bad-stream", ["ask", "--stream", "bad name!", "hi"], 2, "bad name!"),
    ("ask-redis-down", ["ask", "--redis-url", "redis://127.0.0.1:{closed}/0", "--stream", "cam1", "hi"], 3, "Redis"),
    ("ask-unknown-stream", ["ask", "--stream", "nope", "hi"], 2, "unknown stream"),
    ("transcript-unknown-stream", ["transcript", "--stream", "nope"], 2, "unknown stream"),
    # refused before Redis is asked: the closed port is never tried
    (
        "ask-max-tokens-0",
        ["ask", "--redis-url", "redis://127.0.0.1:{closed}/0", "--stream", "c", "--max-tokens", "0", "hi"],
        2,
        "max_tokens",
    ),
    ("status-redis-down", ["status", "--redis-url", "redis://127.0.0.1:{closed}/0"], 3, "Redis"),
    ("device-cuda-on-cpu", ["worker", "--streams", "cam1", "--model", "tiny-random", "--device", "cuda"], 2, "cuda"),
    ("model-path-missing", ["encoder", "--streams", "cam1", "--model", "/nonexistent/model"], 4, "local directory"),
    ("model-hub-unreachable", ["qa", "--streams", "cam1", "--model", "Org/not-cached"], 4, "unreachable"),
    ("replay-hub-unreachable", ["replay", "{tmp}/clip.mp4", "--model", "Org/not-cached"], 4, "unreachable"),
    ("replay-model-path-missing", ["replay", "{tmp}/clip.mp4", "--model", "/nonexistent/model"], 4, "local directory"),
]


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        yield s.getsockname()[1]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize(("argv", "code", "word"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_failure_is_one_json_line_and_an_exit_code(argv, code, word, tmp_path: Path, redis_url: str, busy_port: int):
    if "--device" in argv and _cuda_available():
        pytest.skip("this machine has CUDA")
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    subs = {"tmp": str(tmp_path), "busy": str(busy_port), "closed": str(free_port())}
    env = {
        **os.environ,
        "SVQA_REDIS_URL": redis_url,
        "SVQA_LOG_LEVEL": "WARNING",  # the start-up line is info: only the failure remains
        "SVQA_SEGMENT_STORE": str(tmp_path / "segments"),
        "HF_HOME": str(tmp_path / "hf"),  # an empty cache ...
        "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",  # ... and a hub that refuses at once
    }
    env.pop("HF_HUB_OFFLINE", None)
    out = subprocess.run(
        [sys.executable, "-m", "apps.cli", *(a.format(**subs) for a in argv)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    lines = out.stderr.splitlines()
    assert out.returncode == code, out.stderr
    assert len(lines) == 1, out.stderr
    line = json.loads(lines[0])
    assert line["level"] == "error" and line["exit_code"] == code, line
    assert word in json.dumps(line), line
    assert out.stdout == ""


GPU_FAILS = """
import time
from common import boot
from common.engine.scheduler import Scheduler
from common.engine.work import StepWork
from common.logs import configure_logging

class Poisoned(StepWork):
    @classmethod
    def step_batch(cls, batch):
        raise RuntimeError("CUDA error: device-side assert triggered (redis://enc:hunter2@redis:6379)")

configure_logging("INFO")
scheduler = Scheduler(on_fatal=boot._gpu_failed)
scheduler.submit(Poisoned())
scheduler.start()
time.sleep(30)
"""


GPU_STUCK = """
import threading
import time
from common import boot
from common.engine.scheduler import Scheduler
from common.engine.work import StepWork
from common.logs import configure_logging
from common.stalls import StuckWatch

class Hangs(StepWork):
    @classmethod
    def step_batch(cls, batch):
        threading.Event().wait()  # a step that never ends, as on a device that hung

configure_logging("INFO")
scheduler = Scheduler().start()
StuckWatch(scheduler, 0.5, boot._gpu_stuck).start()
scheduler.submit(Hangs())
time.sleep(30)
"""


def test_a_gpu_step_that_never_ends_is_one_line_with_where_it_stands_and_exit_5():
    """A hung device or a deadlock stops the GPU loop without an error: the watch sees the step
    run past `gpu_stuck_s`, says where the loop thread stands, and exits 5 like a failed device."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", GPU_STUCK], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 5, out.stderr
    lines = [json.loads(x) for x in out.stderr.splitlines() if '"gpu loop stuck"' in x]
    assert len(lines) == 1 and lines[0]["exit_code"] == 5 and lines[0]["seconds"] >= 0.5, out.stderr
    assert any(frame.endswith(" step_batch") for frame in lines[0]["stack"]), lines[0]["stack"]


def test_a_device_that_fails_while_running_is_one_line_and_exit_5():
    """The GPU loop's own failure (a CUDA error poisons the device for the process) ends the
    process at once, from the loop's thread, with the documented code and no secret in the line."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", GPU_FAILS], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 5, out.stderr
    lines = [json.loads(x) for x in out.stderr.splitlines() if '"gpu failed"' in x]
    assert len(lines) == 1 and lines[0]["exit_code"] == 5 and "device-side assert" in lines[0]["error"]
    assert "hunter2" not in out.stderr


def test_a_short_redis_grace_bounds_the_wait_at_start_too(tmp_path: Path):
    """`--redis-grace-s 1` with no Redis: exit 3 after about a second, not after the 30 s a service
    otherwise waits at start (the subprocess's own limit, 20 s, would end the test first)."""
    (tmp_path / "good.yaml").write_text(GOOD_CAMERAS)
    argv = ["ingest", "--cameras-file", str(tmp_path / "good.yaml"), "--redis-grace-s", "1"]
    argv += ["--redis-url", f"redis://127.0.0.1:{free_port()}/0"]
    out = subprocess.run(
        [sys.executable, "-m", "apps.cli", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "SVQA_LOG_LEVEL": "WARNING"},
        timeout=20,
    )
    (line,) = [json.loads(x) for x in out.stderr.splitlines()]
    assert out.returncode == 3 and line["exit_code"] == 3 and "redis" in line["event"], out.stderr
