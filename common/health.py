"""The metrics port: Prometheus `/metrics`, plus `/health/live` and `/health/ready` for compose.

Ready means the service can do its work now: Redis answers PING and takes writes (a refusal,
redisio.REFUSALS, fails `redis_writes` with what Redis said), the model is loaded (GPU roles),
the encoder's lease loop has run recently (it holds and renews its streams' leases), and no check
a service marked failing (the recorder's frames log while its writes fail) is, with why.
Both answer JSON; 200 when fine, 503 with the failing checks otherwise. The HTTP API answers its
own /health/* in the same shape (`LIVE`, `ready_body`), so one probe reads every service.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from common import redisio

PROBE_TIMEOUT_S = 1.0
LIVE = {"live": True}  # /health/live's body


def ready_body(checks: dict[str, bool], leases: list[str], failing: dict[str, str]) -> tuple[bool, dict[str, Any]]:
    """/health/ready's verdict and body: `ready`, every check's outcome, the leases held, and why
    each failing one fails (`reasons`, only when one does)."""
    ok = all(checks.values())
    return ok, {"ready": ok, "checks": checks, "leases": leases} | ({"reasons": failing} if failing else {})


@dataclass
class Readiness:
    """What this process has reached; the service sets fields as it starts and runs."""

    redis_url: str | None = None
    frames_redis_url: str | None = None  # a second Redis for frames, when the service uses one
    needs_model: bool = False
    model_loaded: bool = False
    lease_period_s: float | None = None  # encoder: the lease loop must run at least this often
    last_lease_check: float | None = None  # monotonic
    leases: list[str] = field(default_factory=list)
    # a check that failed and why, set and cleared by the service (the recorder: "frames_log")
    failing: dict[str, str] = field(default_factory=dict)

    def leases_checked(self, held: list[str], period_s: float) -> None:
        self.leases, self.lease_period_s, self.last_lease_check = sorted(held), period_s, time.monotonic()

    def check(self) -> tuple[bool, dict[str, Any]]:
        checks: dict[str, Any] = {"redis": self._answers(self.redis_url)}
        if self.frames_redis_url is not None:
            checks["frames_redis"] = self._answers(self.frames_redis_url)
        if self.needs_model:
            checks["model"] = self.model_loaded
        if self.lease_period_s is not None:
            assert self.last_lease_check is not None
            checks["leases"] = time.monotonic() - self.last_lease_check < 2 * self.lease_period_s
        failing = dict(self.failing)  # one copy: the service changes it from another thread
        if (refused := redisio.REFUSING.why()) is not None:  # answers PING, refuses writes: not ready
            failing["redis_writes"] = refused
        checks |= dict.fromkeys(failing, False)
        return ready_body(checks, self.leases, failing)

    @staticmethod
    def _answers(url: str | None) -> bool:
        return url is not None and redisio.ping_problem(url, PROBE_TIMEOUT_S) is None


READINESS = Readiness()  # one per process


def serve(port: int | None, registry: CollectorRegistry, readiness: Readiness = READINESS) -> None:
    """Serve /metrics and /health/* in a daemon thread (no-op without a port); OSError if busy."""
    if port is None:
        return

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/health/live":
                self._send(200, json.dumps(LIVE).encode(), "application/json")
            elif path == "/health/ready":
                ok, body = readiness.check()
                self._send(200 if ok else 503, json.dumps(body).encode(), "application/json")
            else:
                self._send(404, b"not found", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # scrapes every few seconds: not worth a log line
            pass

    server = ThreadingHTTPServer(("", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
