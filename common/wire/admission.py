"""What the API reads before it accepts a question: `keys.admission(cam)`, a hash with one entry per
QA process answering the stream (field: its consumer name), written about once a second
(qa_worker/admission.py): the questions it has taken that the GPU has not started, and how many
it answers a second while busy; and the same of its questions about the past waiting for a turn at
a history cache (qa_worker/history.py `CacheGate`), and how many turns it finishes a second."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FRESH_S = 5.0  # an entry older than this is a process gone or stuck: not read
KEY_TTL_S = 10  # the hash goes with the last process that wrote it


@dataclass(frozen=True)
class AdmissionEntry:
    queued: int
    rate: float | None  # answers a second; None until the process has answered one
    at: float  # unix time written
    history_queued: int = 0  # questions about the past waiting for a turn at a history cache
    history_rate: float | None = None  # turns finished a second; None until one has (or no frames log)

    def to_json(self) -> str:
        return json.dumps(
            {
                "queued": self.queued,
                "rate": self.rate,
                "at": self.at,
                "history_queued": self.history_queued,
                "history_rate": self.history_rate,
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> AdmissionEntry | None:
        """None for an entry that does not parse (never an error: it only informs a guess). An
        entry without the history fields (an older worker's) has no history queue."""
        try:
            entry = json.loads(raw)
            return cls(
                int(entry["queued"]),
                _rate(entry["rate"]),
                float(entry["at"]),
                int(entry.get("history_queued", 0)),
                _rate(entry.get("history_rate")),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def wait_s(self, backlog: int, about_past: bool) -> float | None:
        """A new question's estimated wait in this process: for the GPU, (its queue + `backlog` + 1)
        over its rate; a question about the past first waits for a turn at a history cache too,
        (its history queue + 1) over its history rate, and the two add up (as in its `queue_s`).
        A part without a rate is not counted; None when neither has one."""
        parts = [(self.queued + backlog + 1, self.rate)]
        if about_past:
            parts.append((self.history_queued + 1, self.history_rate))
        known = [ahead / rate for ahead, rate in parts if rate]
        return sum(known) if known else None


def _rate(value: Any) -> float | None:
    return None if value is None else float(value)


def estimated_wait_s(
    entries: Mapping[Any, Any], backlog: int = 0, now: float | None = None, about_past: bool = False
) -> float | None:
    """A new question's estimated wait on a stream, from its admission hash: the shortest, over the
    processes answering it that wrote in the last FRESH_S, of their `AdmissionEntry.wait_s` (with
    `backlog`, the stream's questions no process has taken yet; `about_past`: a question about
    the past, which waits for a turn at a history cache too); None when none has a rate. A live
    question is never refused for a history queue: it does not wait in it."""
    now = time.time() if now is None else now
    fresh = [e for e in map(AdmissionEntry.from_json, entries.values()) if e is not None and now - e.at <= FRESH_S]
    return min((w for e in fresh if (w := e.wait_s(backlog, about_past)) is not None), default=None)
