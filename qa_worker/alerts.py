"""Alerts: a yes/no question about a stream, turned into events people are told about.

An alert job scores its question as multiple choice (yes / no) on a schedule; ``Gate`` decides
when a yes becomes an alert (debounced, once per turn to yes, not again within the cooldown).
Each alert is an entry of ``svqa:{cam}:alerts`` and is handed to ``Delivery``: one thread that
POSTs it to a webhook and/or publishes it to MQTT (QoS 1), retrying with backoff. Delivery runs
beside the answering loop, so a slow or dead receiver never delays a question. Delivery is at
least once: a retry after a lost response sends the same alert again, with the same ``id``
(JSON field and ``Idempotency-Key`` header), so receivers drop duplicates by it.

MQTT as Frigate's users know it: beside the alert's JSON on the configured topic, each stream and
job has a state topic ``<topic>/<stream>/<job>`` (``ON`` when it fired, ``OFF`` once the answer
turned back to no; retained) with the last alert's JSON on ``.../attributes``, and a Home
Assistant MQTT discovery config (retained), so each alert job appears there as a binary sensor.
"""

from __future__ import annotations

import http.client
import json
import math
import queue
import re
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt
import structlog

from common import metrics
from common.version import VERSION
from common.wire.alert_record import Alert

log = structlog.get_logger()

YES_NO = ("yes", "no")


def p_yes(scores: list[float]) -> float:
    """P(yes) from the mean log-probabilities of the options "yes" and "no" (a two-way softmax)."""
    yes, no = scores
    return 1.0 / (1.0 + math.exp(max(-700.0, min(700.0, no - yes))))


@dataclass(frozen=True)
class AlertSettings:
    maxlen: int = 10_000  # alerts kept per stream
    frame_ttl_s: int = 7 * 24 * 3600  # how long an alert's frame copy is kept
    base_url: str = ""  # the HTTP API as receivers reach it: alert frames are URLs under it ("": a path)
    discovery_prefix: str = "homeassistant"  # Home Assistant's MQTT discovery prefix ("": no discovery)


@dataclass(frozen=True)
class State:
    """An alert job's state on a stream, told over MQTT: on when it fired, off once the answer is no."""

    stream: str
    job: str
    on: bool


Message = Alert | State


@dataclass
class Gate:
    """Fires once when the answer has been yes for ``debounce`` runs in a row, then stays quiet
    until it has turned back to no, and never fires twice within ``cooldown_s``."""

    debounce: int
    cooldown_s: float
    streak: int = 0
    armed: bool = True  # a no since the last alert
    last_fired: float = -math.inf

    def resume(self, fired_ago_s: float, armed: bool, now: float) -> None:
        """Go on from an alert fired ``fired_ago_s`` ago, before a restart: quiet until the answer
        has turned to no (``armed``: it had, before the restart) and for the rest of the cooldown."""
        self.armed, self.last_fired = armed, now - max(0.0, fired_ago_s)

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
        data=json.dumps(alert.payload()).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Idempotency-Key": alert.id, "User-Agent": "streamvqa-alerts"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # urlopen raises HTTPError on 4xx/5xx
        if not 200 <= resp.status < 300:
            raise OSError(f"webhook answered {resp.status}")


def _topic_id(name: str) -> str:
    """A stream or job name as Home Assistant takes it in discovery topics and ids ([A-Za-z0-9_-])."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


def discovery(topic: str, stream: str, job: str, prefix: str) -> tuple[str, dict]:
    """Home Assistant's MQTT discovery topic and config of the binary sensor of one alert job on
    one stream; the stream is the device (one per camera)."""
    state = f"{topic}/{stream}/{job}"
    object_id = f"{_topic_id(stream)}_{_topic_id(job)}"
    config = {
        "name": job,
        "unique_id": f"streamvqa_{object_id}",
        "state_topic": state,
        "payload_on": "ON",
        "payload_off": "OFF",
        "json_attributes_topic": f"{state}/attributes",
        "device": {"identifiers": [f"streamvqa_{_topic_id(stream)}"], "name": stream, "manufacturer": "streamvqa"},
        "origin": {"name": "streamvqa", "sw_version": VERSION},
    }
    return f"{prefix}/binary_sensor/streamvqa/{object_id}/config", config


def mqtt_messages(topic: str, message: Message, discovery_prefix: str) -> list[tuple[str, bytes, bool]]:
    """(topic, payload, retain) to publish for an alert or a state change: the alert's JSON on
    ``topic``, the last alert's on the state's attributes topic, the state, and the discovery config.
    All but the first are retained, so that a subscriber that comes later reads the state now."""
    state_topic = f"{topic}/{message.stream}/{message.job}"
    out: list[tuple[str, bytes, bool]] = []
    if discovery_prefix:
        where, config = discovery(topic, message.stream, message.job, discovery_prefix)
        out.append((where, json.dumps(config).encode(), True))
    if isinstance(message, Alert):
        body = json.dumps(message.payload()).encode()
        out += [(topic, body, False), (f"{state_topic}/attributes", body, True)]
    on = isinstance(message, Alert) or message.on
    out.append((state_topic, b"ON" if on else b"OFF", True))
    return out


def publish_mqtt(url: str, messages: list[tuple[str, bytes, bool]], timeout_s: float) -> None:
    """Connect, publish with QoS 1 (the broker acknowledges each), disconnect; raises when one is
    not acknowledged."""
    parts = urlsplit(url)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)  # a random client id
    if parts.username:
        client.username_pw_set(unquote(parts.username), unquote(parts.password or ""))
    if parts.scheme == "mqtts":
        client.tls_set_context(ssl.create_default_context())
    refused: list[str] = []  # a broker that refuses the client (its credentials) says so in its CONNACK
    client.on_connect = lambda _c, _u, _f, reason, _p: refused.append(str(reason)) if reason.is_failure else None
    client.connect(parts.hostname or "localhost", parts.port or (8883 if parts.scheme == "mqtts" else 1883))
    client.loop_start()
    try:
        sent = [client.publish(topic, payload, qos=1, retain=retain) for topic, payload, retain in messages]
        deadline = time.monotonic() + timeout_s
        while not _published(sent, refused) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not _published(sent, refused):
            raise OSError(f"MQTT broker did not acknowledge within {timeout_s:g} s")
    finally:
        client.disconnect()
        client.loop_stop()


def _published(sent: list[mqtt.MQTTMessageInfo], refused: list[str]) -> bool:
    """Whether the broker acknowledged every message; OSError once it refused the client: that was
    waited out as no acknowledgement, and a publish after the refusal raised RuntimeError, which
    no retry caught."""
    if refused:
        raise OSError(f"MQTT broker refused the connection: {refused[0]}")
    try:
        return all(info.is_published() for info in sent)
    except RuntimeError as e:  # paho: the message cannot be sent (the client is not connected)
        raise OSError(f"MQTT publish failed: {e}") from None


def mqtt_topic(url: str) -> str:
    return unquote(urlsplit(url).path.lstrip("/"))


def _where(url: str) -> str:
    """Scheme, host and port only: webhook paths and queries often carry secrets (tokens)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def _scrubbed(error: str, url: str) -> str:
    """An error's text without the URL's secrets (its password, path and query): some name the URL
    (http.client's InvalidURL quotes the path and query of one with a space, a token's say)."""
    parts = urlsplit(url)
    for secret in (url, parts.password, parts.path + (f"?{parts.query}" if parts.query else ""), parts.query):
        if secret and secret != "/":
            error = error.replace(secret, "…").replace(repr(secret)[1:-1], "…")
    return error


class Delivery:
    """A queue and one thread: ``submit`` and ``tell`` return at once; the thread sends and retries."""

    def __init__(self, retry: Retry = Retry(), maxsize: int = 1000, discovery_prefix: str = "homeassistant"):
        self.retry, self.discovery_prefix = retry, discovery_prefix
        self.queue: queue.Queue[tuple[Message, str, str] | None] = queue.Queue(maxsize)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="alert-delivery", daemon=True)
        self.thread.start()

    def submit(self, alert: Alert, targets: dict[str, str | None]) -> None:
        for kind, url in targets.items():
            if url is not None:
                self._put(alert, kind, url)

    def tell(self, state: State, mqtt_url: str | None) -> None:
        """An alert job's state (and its discovery config) to its MQTT broker, if it has one."""
        if mqtt_url is not None:
            self._put(state, "mqtt", mqtt_url)

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued for up to ``timeout_s``, then give up on the rest."""
        self.queue.put(None)
        self.thread.join(timeout_s)
        self.stop.set()
        self.thread.join(self.retry.timeout_s + 1)

    def _put(self, message: Message, kind: str, url: str) -> None:
        try:
            self.queue.put_nowait((message, kind, url))
        except queue.Full:  # receivers down for long: an alert stays in Redis, its delivery is dropped
            log.error("alert delivery queue full; dropped", stream=message.stream, job=message.job, target=kind)
            if isinstance(message, Alert):
                metrics.ALERT_DELIVERIES.labels(message.stream, kind, "dropped").inc()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            try:
                self._deliver(*item)
            except Exception as e:  # this thread ending ended every later delivery, and close() waited on a full queue
                message, kind, url = item
                where = {"stream": message.stream, "job": message.job, "target": kind, "to": _where(url)}
                log.error("alert delivery failed unexpectedly", **where, error=_scrubbed(repr(e), url)[:300])

    def _send(self, message: Message, kind: str, url: str) -> None:
        if kind == "webhook":
            assert isinstance(message, Alert), "only alerts go to webhooks"
            post_webhook(url, message, self.retry.timeout_s)
        else:
            publish_mqtt(url, mqtt_messages(mqtt_topic(url), message, self.discovery_prefix), self.retry.timeout_s)

    def _deliver(self, message: Message, kind: str, url: str) -> bool:
        what = {"alert": message.id} if isinstance(message, Alert) else {"state": "on" if message.on else "off"}
        bound = log.bind(**what, stream=message.stream, job=message.job, target=kind, to=_where(url))
        delay = self.retry.backoff_s
        for attempt in range(1, self.retry.attempts + 1):
            try:
                self._send(message, kind, url)
                bound.info("alert delivered", attempt=attempt)
                self._count(message, kind, "delivered")
                return True
            # HTTPException: a receiver's answer that is no HTTP (a bad status line), or a URL
            # http.client refuses (a space in it): it escaped and ended the delivery thread
            except (OSError, urllib.error.URLError, ValueError, http.client.HTTPException) as e:
                bound.warning("alert delivery failed", attempt=attempt, error=_scrubbed(str(e), url)[:300])
            if attempt == self.retry.attempts or self.stop.wait(delay):
                break
            delay = min(delay * 2, self.retry.backoff_max_s)
        bound.error("alert not delivered", attempts=attempt)
        self._count(message, kind, "failed")
        return False

    @staticmethod
    def _count(message: Message, kind: str, outcome: str) -> None:
        if isinstance(message, Alert):  # states are not alerts: their failures are logged only
            metrics.ALERT_DELIVERIES.labels(message.stream, kind, outcome).inc()
