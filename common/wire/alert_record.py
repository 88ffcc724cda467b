"""An alert as it is kept (the fields of ``svqa:{cam}:alerts``) and as it is told: one JSON shape
for the HTTP API (``/api/alerts``), the webhook and MQTT, with numbers as numbers, the frame as
a URL and the time it fired also in ISO 8601."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from typing import Any

from common.wire.keys import PREFIX


def frame_path(stream: str, alert_id: str) -> str:
    """Where the HTTP API serves the frame an alert fired on (api/streams.py)."""
    return f"/api/streams/{stream}/alerts/{alert_id}/frame.jpg"


@dataclass(frozen=True)
class Alert:
    id: str
    stream: str
    job: str
    question: str
    score: float  # P(yes)
    threshold: float
    version: int
    t_start: float  # capture-time range of the version that answered yes
    t_end: float
    at: float  # unix time it fired
    frame: str | None  # URL of the frame it fired on (`frame_path`, under a base URL if set); None: no frame

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    def fields(self) -> dict[str, str]:
        """Stream fields for ``svqa:{cam}:alerts``: floats in full (their shortest exact text), so
        that the API tells the numbers the webhook and MQTT were sent."""
        return {k: "" if v is None else str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_fields(cls, raw: Mapping[str, str]) -> Alert:
        """Back from ``fields``: each field to its type."""
        typed: dict[str, Any] = {}
        for f in fields(cls):
            value = raw.get(f.name, "")
            typed[f.name] = float(value) if f.type == "float" else int(value) if f.type == "int" else value
        frame = typed["frame"] or None
        if frame is not None and frame.startswith(f"{PREFIX}:"):  # kept before frames were URLs: a Redis key
            frame = frame_path(typed["stream"], typed["id"])
        return cls(**typed | {"frame": frame})

    def payload(self) -> dict[str, Any]:
        """What receivers get: the fields, typed, and ``at_iso`` (UTC, ISO 8601) beside ``at``."""
        return asdict(self) | {"at_iso": datetime.fromtimestamp(self.at, UTC).isoformat(timespec="milliseconds")}


def alert_payload(raw: Mapping[str, str]) -> dict[str, Any]:
    """An entry of ``svqa:{cam}:alerts`` as the HTTP API answers it: the same JSON as the webhook
    and MQTT send."""
    return Alert.from_fields(raw).payload()
