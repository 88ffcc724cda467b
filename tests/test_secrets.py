"""A camera password reaches the camera and nothing else: not Redis, not a log line, not
`streamvqa status`, not /metrics. The password comes from the environment through ${VAR} in the
cameras file, the RTSP server really requires it, and the whole pipeline runs on it."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
import redis

from common.config import ConfigError, check_redis_url
from common.logs import MASK, redact_text, redact_url
from tests.conftest import free_port
from tests.pipeline import Services, head, wait_for
from tests.rtsp_server import RtspServer, gst_available

PASSWORD = "Sup3r-s3cret-PW"
USER = "viewer"


def all_redis_bytes(r: redis.Redis) -> list[bytes]:
    """Every key name and every value of every type, as bytes."""
    out = []
    for key in r.scan_iter(count=1000):
        out.append(key)
        kind = r.type(key).decode()
        if kind == "string":
            out.append(r.get(key) or b"")
        elif kind == "hash":
            out += [b for kv in r.hgetall(key).items() for b in kv]
        elif kind == "stream":
            out += [b for _, fields in r.xrange(key) for kv in fields.items() for b in kv]
        elif kind == "list":
            out += r.lrange(key, 0, -1)
        elif kind in ("set", "zset"):
            out += list(r.smembers(key)) if kind == "set" else r.zrange(key, 0, -1)
    return out


@pytest.mark.skipif(not gst_available()[0], reason=gst_available()[1])
def test_camera_password_is_in_no_redis_key_no_log_line_no_status(redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    cameras = tmp_path / "cameras.yaml"
    with RtspServer(fps=10, width=160, height=120, credentials=(USER, PASSWORD)) as server:
        cameras.write_text(
            "cameras:\n"
            f"  - {{name: cam1, url: 'rtsp://{USER}:${{CAM_PASSWORD}}@127.0.0.1:{server.port}/cam1', fps: 4}}\n"
            # never connects: its errors quote the URL, with the password, on every retry
            f"  - {{name: down, url: 'rtsp://{USER}:${{CAM_PASSWORD}}@127.0.0.1:{free_port()}/x', fps: 2}}\n"
        )
        services = Services(
            redis_url,
            tmp_path,
            CAM_PASSWORD=PASSWORD,
            SVQA_CAMERAS_FILE=str(cameras),
            SVQA_LOG_LEVEL="DEBUG",
            SVQA_OPEN_TIMEOUT_S="2",
            SVQA_RECONNECT_MIN_S="0.2",
            SVQA_RECONNECT_MAX_S="0.5",
        )
        metrics_port = free_port()
        try:
            services.start("ingest", "--metrics-port", str(metrics_port))
            services.start("worker", "--chunk-frames", "2")
            wait_for(lambda: head(r, "cam1"), 180, "a cache version of the password-protected camera", services)
            wait_for(lambda: r.xlen("svqa:{down}:events") >= 3, 60, "retries of the camera that is down", services)
            scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
            status = subprocess.run(
                [sys.executable, "-m", "apps.cli", "status", "--redis-url", redis_url],
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            services.stop_all()
    assert status.returncode == 0, status.stderr
    assert "down" in status.stdout and "never connected" in status.stdout  # a camera that never connected shows
    assert f"{USER}:***@" in status.stdout
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert "connected" in logs and f"{USER}:***@" in logs  # the URL is logged, redacted
    secret = PASSWORD.encode()
    leaks = [b[:200] for b in all_redis_bytes(r) if secret in b]
    assert not leaks, leaks
    assert PASSWORD not in logs
    assert PASSWORD not in status.stdout + status.stderr
    assert secret not in scraped


@pytest.mark.skipif(not gst_available()[0], reason=gst_available()[1])
def test_password_with_raw_at_hash_or_question_mark_is_masked_whole(redis_url, tmp_path):
    """FFmpeg takes a raw @ in a password (the last @ ends it), so such cameras work; and a # or ?
    typed into one fails to parse. Either way no part of the password may reach a log line or Redis."""
    r = redis.Redis.from_url(redis_url)
    cameras = tmp_path / "cameras.yaml"
    at_pw, hash_pw, query_pw = "Sec@Ret-9x7", "Pa#Ss-Wd5", "Pa?Qs-Zz3"
    with RtspServer(fps=10, width=160, height=120, credentials=(USER, at_pw)) as server:
        cameras.write_text(
            "cameras:\n"
            f"  - {{name: cam1, url: 'rtsp://{USER}:${{AT_PW}}@127.0.0.1:{server.port}/cam1', fps: 4}}\n"
            f"  - {{name: down1, url: 'rtsp://{USER}:${{AT_PW}}@127.0.0.1:{free_port()}/x', fps: 2}}\n"
            f"  - {{name: down2, url: 'rtsp://{USER}:${{HASH_PW}}@127.0.0.1:{free_port()}/x', fps: 2}}\n"
            f"  - {{name: down3, url: 'rtsp://{USER}:${{QUERY_PW}}@127.0.0.1:{free_port()}/x', fps: 2}}\n"
        )
        services = Services(
            redis_url,
            tmp_path,
            AT_PW=at_pw,
            HASH_PW=hash_pw,
            QUERY_PW=query_pw,
            SVQA_CAMERAS_FILE=str(cameras),
            SVQA_OPEN_TIMEOUT_S="2",
            SVQA_RECONNECT_MIN_S="0.2",
            SVQA_RECONNECT_MAX_S="0.5",
        )
        try:
            services.start("ingest")
            wait_for(lambda: r.xlen("svqa:{cam1}:frames") >= 2, 60, "frames of the camera", services)
            for cam in ("down1", "down2", "down3"):
                wait_for(lambda cam=cam: r.xlen(f"svqa:{{{cam}}}:events") >= 4, 30, f"retries of {cam}", services)
        finally:
            services.stop_all()
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert f"{USER}:***@127.0.0.1" in logs
    for pw in (at_pw, hash_pw, query_pw):
        tail = pw[3:]  # what follows the @, # or ?: a mask that stops at that character shows it
        assert tail not in logs, [line for line in logs.splitlines() if tail in line][:3]
        leaks = [b[:200] for b in all_redis_bytes(r) if tail.encode() in b]
        assert not leaks, leaks


def test_password_in_the_query_string_is_masked(redis_url, tmp_path):
    """Cameras that take rtsp://host/stream?user=...&password=...: FFmpeg's errors quote that URL on
    every retry, and neither the log nor the events may show the password."""
    r = redis.Redis.from_url(redis_url)
    cameras = tmp_path / "cameras.yaml"
    url = f"rtsp://127.0.0.1:{free_port()}/live?user={USER}&password=${{CAM_PASSWORD}}&channel=1"
    cameras.write_text(f"cameras:\n  - {{name: down, url: '{url}', fps: 2}}\n")
    services = Services(
        redis_url,
        tmp_path,
        CAM_PASSWORD=PASSWORD,
        SVQA_CAMERAS_FILE=str(cameras),
        SVQA_RECONNECT_MIN_S="0.2",
        SVQA_RECONNECT_MAX_S="0.5",
    )
    try:
        services.start("ingest")
        wait_for(lambda: r.xlen("svqa:{down}:events") >= 4, 30, "retries of the camera that is down", services)
    finally:
        services.stop_all()
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert "password=***" in logs and "Connection refused" in logs
    assert PASSWORD not in logs, [line for line in logs.splitlines() if PASSWORD in line][:3]
    leaks = [b[:200] for b in all_redis_bytes(r) if PASSWORD.encode() in b]
    assert not leaks, leaks


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        # FFmpeg takes one slash and streams; its errors quote the other forms on every retry
        ("rtsp:/viewer:OneSlash-PW7@10.0.0.5/cam", f"rtsp:/viewer:{MASK}@10.0.0.5/cam"),
        ("rtsp:viewer:NoSlash-PW7@10.0.0.5/cam", f"rtsp:viewer:{MASK}@10.0.0.5/cam"),
        ("rtsp://admin:correct horse@10.0.0.5/cam", f"rtsp://admin:{MASK}@10.0.0.5/cam"),
        ("rtsp://10.0.0.5/cam?user=admin&pw=Query-PW7", f"rtsp://10.0.0.5/cam?user=admin&pw={MASK}"),
        # redis_url typed without '//': the bad-configuration line quotes it
        ("ingest:Redis-PW7@redis:6379/0", f"ingest:{MASK}@redis:6379/0"),
        ("redis:/ingest:Redis-PW7@redis:6379/0", f"redis:/ingest:{MASK}@redis:6379/0"),
    ],
)
def test_every_url_form_people_type_is_masked(url, masked):
    assert redact_url(url) == masked
    assert redact_text(f"cam1: '{url}': Connection refused") == f"cam1: '{masked}': Connection refused"
    assert redact_text(f"{url} and rtsp://u:Other-PW7@h2/x") == f"{masked} and rtsp://u:{MASK}@h2/x"


def test_free_text_without_a_url_keeps_its_words():
    assert redact_text("error: no frames for bob@example.com") == "error: no frames for bob@example.com"


@pytest.mark.parametrize("url", ["ingest:Redis-PW7@redis:6379/0", "redis:/ingest:Redis-PW7@redis:6379/0"])
def test_a_redis_url_without_slashes_is_refused_without_its_password(url):
    with pytest.raises(ConfigError) as e:
        check_redis_url(url, "redis_url")
    assert "Redis-PW7" not in str(e.value) and MASK in str(e.value)
