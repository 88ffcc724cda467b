"""common/clock.py on a real redis-server: every host reads Redis's clock, whatever its own says."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis
from structlog.testing import capture_logs

from common import clock
from common.clock import SharedClock, warn_if_skewed


def skew_this_host(monkeypatch: pytest.MonkeyPatch, skew_s: float) -> None:
    """This process's wall clock `skew_s` off (a host whose NTP is broken): a host's own clock
    cannot be changed in a test."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew_s)


@pytest.mark.parametrize("skew_s", [30.0, -30.0, 0.0])
def test_the_shared_clock_reads_redis_time_on_a_host_whose_clock_is_off(redis_url, monkeypatch, skew_s):
    r = redis.Redis.from_url(redis_url)
    skew_this_host(monkeypatch, skew_s)
    shared = SharedClock(r)
    assert shared.offset_s == pytest.approx(-skew_s, abs=0.1)
    seconds, micros = r.time()
    assert shared.now() == pytest.approx(seconds + micros / 1e6, abs=0.1)


def test_the_offset_follows_a_clock_stepped_while_running(redis_url, monkeypatch):
    r = redis.Redis.from_url(redis_url)
    shared = SharedClock(r, refresh_s=0.0)
    assert shared.offset_s == pytest.approx(0.0, abs=0.1)
    skew_this_host(monkeypatch, 30.0)
    shared.refresh_if_due()
    assert shared.offset_s == pytest.approx(-30.0, abs=0.1)


def test_a_host_whose_clock_is_off_says_so_in_one_line_at_start(redis_url, monkeypatch):
    r = redis.Redis.from_url(redis_url)
    with capture_logs() as said:
        warn_if_skewed(r, 2.0, "streamvqa encoder")
    assert said == [], "a host on time says nothing"
    skew_this_host(monkeypatch, 30.0)
    with capture_logs() as said:
        warn_if_skewed(r, 2.0, "streamvqa encoder")
    (line,) = said
    assert line["event"].startswith("this host's clock is 30.0 s ahead of Redis's"), line
    assert line["clock_minus_redis_s"] == pytest.approx(30.0, abs=0.1)


def test_a_redis_that_refuses_time_leaves_this_hosts_clock_said_once(redis_server, monkeypatch):
    """A users file from before TIME was granted: frames are judged as before, on this host's clock."""
    admin = redis.Redis.from_url(redis_server.url)
    password = uuid.uuid4().hex
    admin.acl_setuser("old", enabled=True, passwords=[f"+{password}"], commands=["-@all", "+ping"])
    r = redis.Redis(port=redis_server.port, username="old", password=password)
    skew_this_host(monkeypatch, 30.0)
    with capture_logs() as said:
        shared = SharedClock(r, refresh_s=0.0)
        shared.refresh_if_due()
    assert shared.offset_s == 0.0 and shared.refused
    assert [x["event"] for x in said] == ["redis refused TIME; frames are judged on this host's clock"]


def test_a_slow_measurement_does_not_replace_a_good_offset(redis_url, monkeypatch):
    r = redis.Redis.from_url(redis_url)
    shared = SharedClock(r)
    monkeypatch.setattr(clock, "redis_offset", lambda _r: (99.0, clock.MAX_ROUND_TRIP_S + 1))
    shared.refresh()
    assert shared.offset_s == pytest.approx(0.0, abs=0.1)


def test_ingest_on_a_host_whose_clock_is_off_stamps_live_frames_with_redis_time(redis_url, monkeypatch):
    """Frames are judged on Redis's clock by every encoder: an ingest host 30 s off stamped them
    30 s late (dropped) or ahead (dead-lettered) on all of them."""
    from ingest.config import IngestConfig
    from ingest.source import Source, SourceSpec

    r = redis.Redis.from_url(redis_url)
    skew_this_host(monkeypatch, 30.0)
    cfg = IngestConfig(redis_url=redis_url, url="rtsp://127.0.0.1:1/cam", stream="cam")
    spec = SourceSpec("cam", cfg.url, 2.0, False, cfg.min_pixels, cfg.max_pixels)
    source = Source(r, spec, cfg, threading.Event())
    seconds, micros = r.time()
    assert source._stamp(None) == pytest.approx(seconds + micros / 1e6, abs=0.1)
