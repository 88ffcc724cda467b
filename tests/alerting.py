"""Real alert receivers for tests: an HTTP webhook receiver that can fail its first requests, and a
mosquitto broker on a free port with a subscriber."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from tests.conftest import free_port

MOSQUITTO = os.environ.get("SVQA_TEST_MOSQUITTO") or shutil.which("mosquitto") or "/usr/sbin/mosquitto"


class Webhook:
    """Records every POST; answers 500 to the first ``fail_first`` of them, then 200. While
    ``answering`` is cleared, each POST is recorded and then held without an answer."""

    def __init__(self, fail_first: int = 0):
        self.fail_first, self.requests, self.accepted = fail_first, [], []
        self.answering = threading.Event()
        self.answering.set()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                hook.requests.append((dict(self.headers), body))
                hook.answering.wait(60)
                ok = len(hook.requests) > hook.fail_first
                if ok:
                    hook.accepted.append(body)
                self.send_response(200 if ok else 500)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook?secret=s3cr3t"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Broker:
    """A mosquitto process on a free loopback port, and a subscriber to every topic: ``messages``
    are the JSON payloads on ``topic``, ``raw`` every (topic, payload, retain) in order."""

    def __init__(self, workdir: Path, topic: str):
        if not os.access(MOSQUITTO, os.X_OK):
            pytest.skip(f"mosquitto not found at {MOSQUITTO}")
        self.port, self.topic, self.messages = free_port(), topic, []
        self.raw: list[tuple[str, bytes, bool]] = []
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
        self.start()
        self.url = f"mqtt://127.0.0.1:{self.port}/{topic}"
        self.subscriber = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-subscriber")
        subscribed = threading.Event()
        self.subscriber.on_connect = lambda c, *_: c.subscribe("#", qos=1)
        self.subscriber.on_subscribe = lambda *_: subscribed.set()
        self.subscriber.on_message = lambda _c, _u, msg: self._received(msg)
        self._connect(timeout_s=10)
        self.subscriber.loop_start()
        assert subscribed.wait(10), "mosquitto subscription not acknowledged"

    def _received(self, msg: mqtt.MQTTMessage) -> None:
        self.raw.append((msg.topic, msg.payload, bool(msg.retain)))
        if msg.topic == self.topic:
            self.messages.append(json.loads(msg.payload))

    def retained(self, pattern: str, count: int, timeout_s: float = 10.0) -> dict[str, bytes]:
        """What a subscriber that comes now reads on ``pattern``: the retained messages (waits for
        ``count`` of them, at most ``timeout_s``)."""
        got: dict[str, bytes] = {}
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        client.on_connect = lambda c, *_: c.subscribe(pattern, qos=1)
        client.on_message = lambda _c, _u, msg: got.__setitem__(msg.topic, msg.payload) if msg.retain else None
        client.connect("127.0.0.1", self.port)
        client.loop_start()
        deadline = time.monotonic() + timeout_s
        while len(got) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        client.loop_stop()
        client.disconnect()
        return dict(got)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [MOSQUITTO, "-c", str(self.conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def _connect(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.subscriber.connect("127.0.0.1", self.port)
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        self.subscriber.loop_stop()
        self.subscriber.disconnect()
        self.proc.terminate()
        self.proc.wait(timeout=5)


@contextmanager
def webhook(fail_first: int = 0) -> Iterator[Webhook]:
    hook = Webhook(fail_first)
    try:
        yield hook
    finally:
        hook.close()


@contextmanager
def broker(workdir: Path, topic: str = "streamvqa/alerts") -> Iterator[Broker]:
    b = Broker(workdir, topic)
    try:
        yield b
    finally:
        b.close()
