"""What the API reads before it accepts a question: `keys.admission(cam)`, a hash with one entry per
QA process answering the stream (field: its consumer name), written about once a second
(qa_worker/admission.py): the questions it has taken that the GPU has not started, and how many
it answers a second while busy."""

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

    def to_json(self) -> str:
        return json.dumps({"queued": self.queued, "rate": self.rate, "at": self.at})

    @classmethod
    def from_json(cls, raw: str | bytes) -> AdmissionEntry | None:
        """None for an entry that does not parse (never an error: it only informs a guess)."""
        try:
            entry = json.loads(raw)
            rate = entry["rate"]
            return cls(int(entry["queued"]), None if rate is None else float(rate), float(entry["at"]))
        except (ValueError, KeyError, TypeError):
            return None


def estimated_wait_s(entries: Mapping[Any, Any], backlog: int = 0, now: float | None = None) -> float | None:
    """A new question's estimated wait on a stream, from its admission hash: the shortest, over the
    processes answering it that wrote in the last FRESH_S, of (their queue + `backlog`, the
    stream's questions no process has taken yet, + 1) over their rate; None when none has a rate."""
    now = time.time() if now is None else now
    entries_ = [AdmissionEntry.from_json(raw) for raw in entries.values()]
    return min(
        ((e.queued + backlog + 1) / e.rate for e in entries_ if e is not None and e.rate and now - e.at <= FRESH_S),
        default=None,
    )
