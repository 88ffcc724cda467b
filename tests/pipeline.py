"""Helpers for end-to-end tests: run the real services as processes against a real redis-server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import redis

from common.wire import keys
from common.wire.schemas import Manifest, decode_manifest, manifest_from_bytes

T = TypeVar("T")


class Services:
    """Starts `streamvqa <service>` processes with one shared environment; kills them at the end."""

    def __init__(self, redis_url: str, workdir: Path, **env: str):
        self.workdir = workdir
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "SVQA_REDIS_URL": redis_url,
            "SVQA_MODEL": "tiny-random",
            "SVQA_DEVICE": "cpu",
            "SVQA_SEGMENT_STORE": str(workdir / "segments"),
            "SVQA_BLOCK_MS": "200",
            "SVQA_LOG_LEVEL": "INFO",
            **env,
        }
        self.procs: list[subprocess.Popen] = []

    def start(self, service: str, *args: str, module: str = "apps.cli", **env: str) -> subprocess.Popen:
        """``module``: what runs `main` (a test's wrapper of apps.cli, say)."""
        log = open(self.workdir / f"{service}-{len(self.procs)}.log", "w")  # noqa: SIM115 (lives with the process)
        proc = subprocess.Popen(
            [sys.executable, "-m", module, service, *args],
            env={**self.env, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.workdir.glob("*.log")))

    def stop_all(self, timeout_s: float = 10) -> None:
        """SIGTERM, then SIGKILL to what has not exited ``timeout_s`` later: a test that checks
        what a graceful stop leaves behind gives it long enough for a loaded machine."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()


def wait_for(
    cond: Callable[[], object], timeout_s: float, what: str, services: Services | None = None, poll_s: float = 0.1
):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}\n{services.logs() if services else ''}")


def head(r: redis.Redis, stream: str) -> Manifest | None:
    raw = r.get(keys.head(stream))
    return manifest_from_bytes(raw) if raw else None


def manifests(r: redis.Redis, stream: str) -> list[Manifest]:
    return [decode_manifest(f) for _, f in r.xrange(keys.versions(stream))]


def manifest_of(r: redis.Redis, stream: str, version: int) -> Manifest:
    found = [m for m in manifests(r, stream) if m.version == version]
    assert found, f"version {version} not on the versions stream"
    return found[0]


def chunk_frames_in_history(r: redis.Redis, stream: str) -> list[int]:
    """Frame seqs of every chunk any version of the stream ever held, one entry per chunk membership:
    a frame encoded twice would appear twice. A segment id must mean the same frames everywhere."""
    chunks: dict[str, tuple[int, int]] = {}
    for m in manifests(r, stream):
        for seg in m.segments[1:]:
            assert chunks.setdefault(seg.id, seg.frame_seqs) == seg.frame_seqs, seg.id
    return sorted(s for lo, hi in chunks.values() for s in range(lo, hi + 1))


def with_deadline(fn: Callable[[], T], deadline_s: float, *, what: str = "call") -> T:
    """Run `fn()` in a daemon thread; TimeoutError after `deadline_s` (a hung PyAV call fails the
    test instead of hanging the suite: a thread stuck in C cannot be killed, only abandoned)."""
    done, box = threading.Event(), {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name=f"deadline:{what}", daemon=True).start()
    if not done.wait(deadline_s):
        raise TimeoutError(f"{what} did not finish within {deadline_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["result"]


def reading_questions(r: redis.Redis) -> bool:
    """A qa loop runs: the questions' consumer group has a consumer (made at its first read)."""
    try:
        return any(int(g["consumers"]) > 0 for g in r.xinfo_groups(keys.QUESTIONS))
    except redis.ResponseError:  # no queue yet
        return False


def audited(r: redis.Redis) -> list[str]:
    """The question ids on the audit stream `svqa:answers`, in order (a final's audit copy is
    written after the final itself: wait for it, not for the final)."""
    return [f[b"id"].decode() for _, f in r.xrange(keys.ANSWERS)]
