"""Redis's clock, the one every host shares: what frames' capture times are stamped and judged by.

A frame is stamped on one host (ingest) and its age judged on another (the encoder drops it as
late past `max_lag_s`, dead-letters it when stamped more than `max_clock_skew_s` ahead; the
recorder refuses to log one ahead). Each read its own wall clock, so one host whose NTP broke
judged every frame wrong: an encoder 30 s fast dropped every frame of the cameras it took as
late, one 30 s slow dead-lettered them all as ahead. Each now reads Redis's clock (`TIME`) as its
own plus an offset, measured at start and again every REFRESH_S (a clock stepped or drifting is
followed). Hosts that keep time with Redis measure an offset of milliseconds: nothing changes.
"""

from __future__ import annotations

import time

import redis
import structlog

from common import redisio

log = structlog.get_logger()

REFRESH_S = 10.0  # the offset measured again this often (where the caller asks: `refresh_if_due`)
# A measurement whose round trip took longer is not taken (the offset is known only to half of it),
# unless there is none yet: a Redis stalled for a moment leaves the last good offset in place
MAX_ROUND_TRIP_S = 0.5


class SharedClock:
    """Redis's time, read as this host's time plus `offset_s` (Redis's minus this host's)."""

    def __init__(self, r: redis.Redis, refresh_s: float = REFRESH_S):
        self.r, self.refresh_s = r, refresh_s
        self.offset_s = 0.0
        self.measured = False  # an offset was measured (none yet: this host's clock is used)
        self.refused = False  # Redis refused TIME (a users file from before it was granted)
        self._measured_at = -float("inf")  # monotonic
        self.refresh()

    def now(self) -> float:
        """Unix seconds on Redis's clock."""
        return time.time() + self.offset_s

    def refresh_if_due(self) -> None:
        if time.monotonic() - self._measured_at >= self.refresh_s:
            self.refresh()

    def refresh(self) -> None:
        """Measure the offset again. Redis away keeps the last offset (tried again when next due:
        the caller's own commands find the outage); a refused TIME keeps this host's clock, said once."""
        self._measured_at = time.monotonic()
        try:
            offset_s, round_trip_s = redis_offset(self.r)
        except redisio.OUTAGE_ERRORS:
            return
        except redis.ResponseError as e:  # NOPERM: behaviour as before the shared clock, said once
            if not self.refused:
                log.warning("redis refused TIME; frames are judged on this host's clock", error=str(e)[:200])
            self.refused = True
            return
        if self.measured and round_trip_s > MAX_ROUND_TRIP_S:
            return
        self.offset_s, self.measured = offset_s, True


def redis_offset(r: redis.Redis) -> tuple[float, float]:
    """(Redis's clock minus this host's, the round trip it was read in), both in seconds. Redis's
    reply is taken as the time at the middle of the round trip."""
    before = time.time()
    reply = r.time()
    after = time.time()
    if isinstance(reply, dict):  # a cluster's client may answer per node: any node's clock will do
        reply = next(iter(reply.values()))
    seconds, micros = reply
    return int(seconds) + int(micros) / 1e6 - (before + after) / 2, after - before


def warn_if_skewed(r: redis.Redis, max_skew_s: float, service: str) -> None:
    """One warning line at a service's start when this host's clock is more than ``max_skew_s`` off
    Redis's: its frames' times are judged on Redis's clock, but its logs, events and file names are
    still stamped with its own. Nothing when Redis refuses TIME or is away (said elsewhere)."""
    try:
        offset_s, _ = redis_offset(r)
    except redis.RedisError:
        return
    if abs(offset_s) > max_skew_s:
        ahead = "ahead of" if offset_s < 0 else "behind"
        log.warning(
            f"this host's clock is {abs(offset_s):.1f} s {ahead} Redis's; fix its time sync (NTP)",
            service=service,
            clock_minus_redis_s=round(-offset_s, 3),
            max_clock_skew_s=max_skew_s,
        )
