"""Alerts: a yes/no question about a stream, turned into events people are told about.

An alert job scores its question as multiple choice (yes / no) on a schedule; ``Gate`` decides
when a yes becomes an alert (debounced, once per turn to yes, not again within the cooldown).
Each alert is an entry of ``svqa:{cam}:alerts`` and is handed to ``Delivery``: one thread that
POSTs it to a webhook and/or publishes it to MQTT (QoS 1), retrying with backoff. Delivery runs
beside the answering loop, so a slow or dead receiver never delays a question. Delivery is at
least once: a retry after a lost response sends the same alert again, with the same ``id``
(JSON field and ``Idempotency-Key`` header), so receivers drop duplicates by it.
"""

from __future__ import annotations

import json
import math
import queue
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt
import structlog

from common import metrics

log = structlog.get_logger()

YES_NO = ("yes", "no")


def p_yes(scores: list[float]) -> float:
    """P(yes) from the mean log-probabilities of the options "yes" and "no" (a two-way softmax)."""
    yes, no = scores
    return 1.0 / (1.0 + math.exp(max(-700.0, min(700.0, no - yes))))


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
    frame: str | None  # Redis key of the frame copy (keys.alert_frame), None if no frame was there

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    def fields(self) -> dict[str, str]:
        """Stream fields for ``svqa:{cam}:alerts``."""
        return {
            k: ("" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in asdict(self).items()
        }

    def payload(self) -> bytes:
        return json.dumps(asdict(self)).encode()


@dataclass
class Gate:
    """Fires once when the answer has been yes for ``debounce`` runs in a row, then stays quiet
    until it has turned back to no, and never fires twice within ``cooldown_s``."""

    debounce: int
    cooldown_s: float
    streak: int = 0
    armed: bool = True  # a no since the last alert
    last_fired: float = -math.inf

    def observe(self, yes: bool, now: float) -> bool:
        if not yes:
            self.streak, self.armed = 0, True
            return False
        self.streak += 1
        if self.armed and self.streak >= self.debounce and now - self.last_fired >= self.cooldown_s:
            self.armed, self.last_fired = False, now
            return True
        return False


@dataclass(frozen=True)
class Retry:
    attempts: int = 6
    backoff_s: float = 0.5  # doubled after each failure, up to backoff_max_s
    backoff_max_s: float = 30.0
    timeout_s: float = 5.0  # per attempt


def post_webhook(url: str, alert: Alert, timeout_s: float) -> None:
    """One POST; raises on a network error or a status other than 2xx."""
    req = urllib.request.Request(
        url,
        data=alert.payload(),
        method="POST",
        headers={"Content-Type": "application/json", "Idempotency-Key": alert.id, "User-Agent": "streamvqa-alerts"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # urlopen raises HTTPError on 4xx/5xx
        if not 200 <= resp.status < 300:
            raise OSError(f"webhook answered {resp.status}")


def publish_mqtt(url: str, alert: Alert, timeout_s: float) -> None:
    """Connect, publish with QoS 1 (the broker acknowledges), disconnect; raises when not acknowledged."""
    parts = urlsplit(url)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"streamvqa-{alert.id[:12]}")
    if parts.username:
        client.username_pw_set(unquote(parts.username), unquote(parts.password or ""))
    if parts.scheme == "mqtts":
        client.tls_set_context(ssl.create_default_context())
    client.connect(parts.hostname or "localhost", parts.port or (8883 if parts.scheme == "mqtts" else 1883))
    client.loop_start()
    try:
        info = client.publish(unquote(parts.path.lstrip("/")), alert.payload(), qos=1)
        deadline = time.monotonic() + timeout_s
        while not info.is_published() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not info.is_published():
            raise OSError(f"MQTT broker did not acknowledge within {timeout_s:g} s")
    finally:
        client.disconnect()
        client.loop_stop()


def _where(url: str) -> str:
    """Scheme, host and port only: webhook paths and queries often carry secrets (tokens)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


Sender = Callable[[str, Alert, float], None]
SENDERS: dict[str, Sender] = {"webhook": post_webhook, "mqtt": publish_mqtt}


class Delivery:
    """A queue and one thread: ``submit`` returns at once; the thread sends and retries."""

    def __init__(self, retry: Retry = Retry(), maxsize: int = 1000):
        self.retry = retry
        self.queue: queue.Queue[tuple[Alert, str, str] | None] = queue.Queue(maxsize)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="alert-delivery", daemon=True)
        self.thread.start()

    def submit(self, alert: Alert, targets: dict[str, str | None]) -> None:
        for kind, url in targets.items():
            if url is None:
                continue
            try:
                self.queue.put_nowait((alert, kind, url))
            except queue.Full:  # receivers down for long: the alert stays in Redis, delivery is dropped
                log.error("alert delivery queue full; dropped", alert=alert.id, target=kind)
                metrics.ALERT_DELIVERIES.labels(alert.stream, kind, "dropped").inc()

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued for up to ``timeout_s``, then give up on the rest."""
        self.queue.put(None)
        self.thread.join(timeout_s)
        self.stop.set()
        self.thread.join(self.retry.timeout_s + 1)

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            self._deliver(*item)

    def _deliver(self, alert: Alert, kind: str, url: str) -> bool:
        bound = log.bind(alert=alert.id, stream=alert.stream, job=alert.job, target=kind, to=_where(url))
        delay = self.retry.backoff_s
        for attempt in range(1, self.retry.attempts + 1):
            try:
                SENDERS[kind](url, alert, self.retry.timeout_s)
                bound.info("alert delivered", attempt=attempt)
                metrics.ALERT_DELIVERIES.labels(alert.stream, kind, "delivered").inc()
                return True
            except (OSError, urllib.error.URLError, ValueError) as e:
                bound.warning("alert delivery failed", attempt=attempt, error=str(e)[:300])
            if attempt == self.retry.attempts or self.stop.wait(delay):
                break
            delay = min(delay * 2, self.retry.backoff_max_s)
        bound.error("alert not delivered", attempts=attempt)
        metrics.ALERT_DELIVERIES.labels(alert.stream, kind, "failed").inc()
        return False
