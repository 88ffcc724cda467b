"""A question's span edges, `since` and `until`: seconds before the question was asked, or a time.

What the protocol, `streamvqa ask --since 1h` and the HTTP API all take, in one form:

- seconds before the question was asked: a number (`3600`, `90.5`) or a duration (`90s`, `15m`,
  `1h`, `2h30m`, `1d`);
- a point in time: ISO 8601 with its UTC offset (`2026-11-28T02:00:00+01:00`, `...Z`). A time
  without one is refused on the wire: the worker cannot know which zone the asker meant (the CLI
  reads one as the asker's local time, `naive_is_local`).

"Before it was asked", not before a worker takes it: a question that waited in the queue still
means the span its asker meant (the worker counts from the question's entry id).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

MAX_TEXT = 64
MAX_AGO_S = 10 * 366 * 86_400  # ten years: beyond any retention
_UNITS = {"d": 86_400.0, "h": 3_600.0, "m": 60.0, "s": 1.0}
_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?|\.[0-9]+")
_DURATION = re.compile("".join(rf"(?:([0-9]+(?:\.[0-9]+)?){unit})?" for unit in _UNITS))  # 2h30m: units in this order
FORMS = "seconds before now (90, 90s, 15m, 1h, 2h30m, 1d) or an ISO 8601 time with its UTC offset"


@dataclass(frozen=True)
class TimeRef:
    """One edge of a span: `ago_s` seconds before the question was asked, or the unix time `at`."""

    ago_s: float | None = None
    at: float | None = None

    def __post_init__(self) -> None:
        if (self.ago_s is None) == (self.at is None):
            raise ValueError("a time reference is either seconds ago or a time")

    def resolve(self, asked_at: float) -> float:
        """The edge as unix seconds, for a question asked at `asked_at`."""
        return self.at if self.at is not None else asked_at - self.ago_s

    def __str__(self) -> str:
        """Its wire text, which `parse_time_ref` reads back to an equal value."""
        if self.ago_s is not None:
            return format(Decimal(repr(self.ago_s)), "f")  # positional: 5e-05 is no form the parser reads
        return datetime.fromtimestamp(self.at, UTC).isoformat()


def in_the_future(since: float, asked_at: float, asking: str = "question") -> str | None:
    """Why a span starting at `since` (unix seconds) is refused when asked at `asked_at`, or None:
    questions and searches are about the past, and one starting after it was asked names nothing
    logged (a search found nothing there, as if the past held nothing). Judged by the worker,
    from the asking: the asker's clock is not the worker's."""
    if since <= asked_at:
        return None
    after = f"since is {since - asked_at:.0f} s after the {asking} was asked, not before"
    return f"{after}: it is in the future, ask about the past"


def parse_time_ref(text: str, naive_is_local: bool = False) -> TimeRef:
    """`text` in one of the FORMS; ValueError saying which forms are taken. `naive_is_local`: a
    time without a UTC offset is this machine's local time (what a person at a terminal means)."""
    s = text.strip()
    if len(s) > MAX_TEXT:
        raise ValueError(f"too long ({len(s)} characters): expected {FORMS}")
    if not s:
        raise ValueError(f"empty: expected {FORMS}")
    ago = _seconds(s)
    if ago is not None:
        return seconds_ago(ago)
    try:
        when = datetime.fromisoformat(s)
    except ValueError:
        raise ValueError(f"expected {FORMS}, got {s!r}") from None
    if when.tzinfo is None and not naive_is_local:
        raise ValueError(f"{s!r} has no UTC offset: add Z or one like +01:00")
    try:
        at = when.timestamp()
        datetime.fromtimestamp(at, UTC)  # its wire text (__str__) is a UTC time: years 1 to 9999
    except (ValueError, OverflowError, OSError):
        raise ValueError(f"{s!r} is not a time of the years 1 to 9999 in UTC") from None
    return TimeRef(at=at)


def seconds_ago(seconds: float) -> TimeRef:
    """`seconds` before the question was asked (a JSON number, say); ValueError unless 0 to ten years."""
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{seconds!r}: expected {FORMS}")
    if seconds > MAX_AGO_S:
        raise ValueError(f"{seconds:g} s is more than ten years")
    return TimeRef(ago_s=float(seconds))


def _seconds(s: str) -> float | None:
    """Seconds in a number or a duration; None for anything else (a time, say)."""
    if _NUMBER.fullmatch(s):
        return float(s)
    m = _DURATION.fullmatch(s.lower())
    if m is None or not any(m.groups()):
        return None
    seconds = sum(float(v) * _UNITS[unit] for v, unit in zip(m.groups(), "dhms", strict=True) if v)
    return seconds if math.isfinite(seconds) else None
