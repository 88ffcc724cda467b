"""Configuration: one frozen dataclass per service, filled from four layers.

Precedence, lowest first: dataclass defaults < YAML file < environment ``SVQA_<FIELD>`` < CLI
``--field-name``. The YAML file is named by ``--config PATH`` or ``SVQA_CONFIG``. Flags and
variable names are derived from the dataclass, so a new setting is one new field. Supported
field types: int, float, str, bool, Path, Literal[...], X | None, tuple[X, ...]. Strings from
the environment and the CLI are converted; ``none``/``null``/empty set an optional field to
None; tuples take comma-separated values. Any bad value raises ``ConfigError`` naming where it
came from. Each setting is declared once, with ``setting(default, help)``: its flag's help, its
variable's name and the README's table (scripts/settings_table.py) come from that declaration.

Also here: the cameras/jobs YAML file (``load_cameras_file``), shared by ingest and qa_worker,
and ``check_settings``, what every service checks before it touches Redis or a model.

Secrets stay out of YAML files: any string in them may hold ``${VAR}`` (from the environment)
or ``${file:/run/secrets/name}`` (a file's content, e.g. a Docker secret); ``$${`` is a literal
``${``. A missing variable or file is a ConfigError that names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import socket
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import yaml

from common.engine.grid import min_pixels_limit
from common.engine.names import DEFAULT_MODEL
from common.engine.scheduler import SchedulePolicy
from common.engine.settings import setting
from common.logs import redact_url
from common.redisio import cluster_nodes
from common.wire.schemas import MAX_CLOCK_SKEW_S, MAX_FRAME_PIXELS, MAX_QUESTION_CHARS, SchemaError, check_stream_name

T = TypeVar("T")
ENV_PREFIX = "SVQA_"
CONFIG_FLAG = "config"  # --config / SVQA_CONFIG: the YAML file; reserved, not a field name
OTHER_ENV = ("SVQA_KILL_AT",)  # read outside the config classes (common/faults.py: tests' kill points)
_NONE = {"", "none", "null"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A setting is missing, unknown or has a bad value; the message says which and where."""


# --------------------------------------------------------------------------- value conversion


def _convert(tp: Any, v: Any, where: str) -> Any:
    """Convert ``v`` (a str from env/CLI, or a YAML value) to type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if v is None or (isinstance(v, str) and v.strip().lower() in _NONE):
            return None
        if len(inner) != 1:
            raise TypeError(f"{where}: unsupported type {tp}")
        return _convert(inner[0], v, where)
    if origin is Literal:
        for choice in args:
            try:
                if _convert(type(choice), v, where) == choice:
                    return choice
            except ConfigError:
                pass
        raise ConfigError(f"{where}: {v!r} is not one of {', '.join(map(str, args))}")
    if origin in (tuple, list):
        item = args[0]
        if isinstance(v, str):
            v = [s.strip() for s in v.split(",") if s.strip()]
        if not isinstance(v, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {v!r}")
        items = [_convert(item, x, f"{where}[{i}]") for i, x in enumerate(v)]
        return tuple(items) if origin is tuple else items
    return _scalar(tp, v, where)


def _scalar(tp: Any, v: Any, where: str) -> Any:
    if v is None:
        raise ConfigError(f"{where}: a value is required (the setting is not optional)")
    if tp is bool:
        if isinstance(v, bool):
            return v
        s = str(v).strip().lower()
        if s in _TRUE or s in _FALSE:
            return s in _TRUE
        raise ConfigError(f"{where}: expected a boolean (true/false), got {v!r}")
    if tp is int:
        try:  # YAML gives int, env/CLI give str; bool and float (1.5) are mistakes
            if isinstance(v, bool) or not isinstance(v, int | str):
                raise ValueError
            return int(v)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {v!r}") from None
    if tp is float:
        try:
            if isinstance(v, bool) or not isinstance(v, int | float | str):
                raise ValueError
            f = float(v)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {v!r}") from None
        if not math.isfinite(f):
            raise ConfigError(f"{where}: expected a finite number, got {v!r}")
        return f
    if tp is str or tp is Path:
        if not isinstance(v, str):  # e.g. YAML `model: 7`: quote it rather than guess the text
            raise ConfigError(f"{where}: expected a string, got {type(v).__name__} {v!r} (quote it)")
        return Path(v) if tp is Path else v
    raise TypeError(f"{where}: unsupported config type {tp}")


# --------------------------------------------------------------------------- layers


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # argparse would print and exit(2)
        raise ConfigError(f"command line: {message}")


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fs = [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init]
    if any(f.name == CONFIG_FLAG for f, _ in fs):
        raise TypeError(f"{cls.__name__}: field name {CONFIG_FLAG!r} is reserved for the YAML file")
    return fs


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def env_names(cls: type, name: str) -> tuple[str, ...]:
    """The variables a field is read from, first found wins. A config class may set ``ENV_PREFIX``
    (``SVQA_API_``) so its own names come first and the shared ``SVQA_<FIELD>`` still applies."""
    own = getattr(cls, "ENV_PREFIX", ENV_PREFIX) + name.upper()
    return tuple(dict.fromkeys((own, env_name(name))))


def unknown_env(classes: Sequence[type], env: Mapping[str, str] = os.environ) -> dict[str, str | None]:
    """The ``SVQA_*`` variables of ``env`` that no field of ``classes`` (every service's config:
    compose gives one set of variables to services that each read part of it) is read from, each
    with the closest known name (None: nothing close). A misspelt variable is otherwise ignored
    in silence: a benchmark meant for FP8 ran bf16 under ``SVQA_GPU_GEMM_DTYPE``, a name nothing
    reads (``SVQA_GEMM_DTYPE`` is)."""
    known = {env_name(CONFIG_FLAG), *OTHER_ENV}
    for cls in classes:
        known.update(v for f, _ in _fields(cls) for v in env_names(cls, f.name))
    return {
        var: next(iter(difflib.get_close_matches(var, known, n=1, cutoff=0.8)), None)
        for var in sorted(env)
        if var.startswith(ENV_PREFIX) and var not in known
    }


def _parse_cli(cls: type, argv: Sequence[str], prog: str | None) -> dict[str, Any]:
    p = _Parser(prog=prog, description=description(cls), allow_abbrev=False)
    p.add_argument("--config", metavar="PATH", help=f"YAML config file (or {env_name(CONFIG_FLAG)})")
    for f, tp in _fields(cls):
        _add_flag(p, cls, f, tp, default=None)
    ns = p.parse_args(list(argv))
    return {k: v for k, v in vars(ns).items() if v is not None}


def description(cls: type) -> str | None:
    """The first line of a config class's own docstring (a dataclass without one gets its repr)."""
    doc = (cls.__dict__.get("__doc__") or "").strip()
    return None if not doc or doc.startswith(f"{cls.__name__}(") else doc.splitlines()[0]


def _add_flag(p: argparse.ArgumentParser, cls: type, f: dataclasses.Field[Any], tp: Any, default: Any) -> None:
    """The flag of one setting: its name, metavar and help derived from the declaration."""
    help_ = f"{f.metadata.get('help', '')} [{env_names(cls, f.name)[0]}; {default_text(f)}]".replace("%", "%%")
    if tp is bool:
        p.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_)
    else:
        metavar = "URL" if f.name.endswith("_url") else _metavar(tp)
        p.add_argument(_flag(f.name), dest=f.name, metavar=metavar, default=default, help=help_)


def add_tool_flags(p: argparse.ArgumentParser, cls: type, names: Sequence[str]) -> None:
    """Flags of a command-line tool for settings a service declares (``--redis-url`` of `streamvqa
    ask`): the same names, help and variables, the variable read now, else the declared default."""
    env = os.environ
    for f, tp in _fields(cls):
        if f.name in names:
            var = next((v for v in env_names(cls, f.name) if v in env), None)
            _add_flag(p, cls, f, tp, default=_convert(tp, env[var], var) if var else _default(f))


def _metavar(tp: Any) -> str:
    """What a flag takes, from the setting's type: N, X, TEXT, PATH, A|B, A,B,..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _metavar(next(a for a in args if a is not type(None)))
    if origin is Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if origin in (tuple, list):
        return f"{_metavar(args[0])},..."
    return {int: "N", float: "X", Path: "PATH"}.get(tp, "TEXT")


def default_text(f: dataclasses.Field[Any]) -> str:
    """A setting's default as people read it: what metadata ``shown`` says where the value is
    computed (a host name), "required", "none" or the value."""
    if "shown" in f.metadata:
        return f.metadata["shown"]
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    value = _default(f)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    return str(value)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _read_yaml(path: str | Path) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    return substitute(data, os.environ, str(path))


# $${ (a literal ${), ${file:/path}, ${VAR}
_SUBST = re.compile(r"\$\$\{|\$\{file:(?P<file>[^}]+)\}|\$\{(?P<var>[A-Za-z_][A-Za-z0-9_]*)\}")


def substitute(node: Any, env: Mapping[str, str], where: str) -> Any:
    """Every string of a parsed YAML tree with ${VAR} and ${file:PATH} replaced (secrets)."""
    if isinstance(node, dict):
        return {k: substitute(v, env, where) for k, v in node.items()}
    if isinstance(node, list):
        return [substitute(v, env, where) for v in node]
    if not isinstance(node, str) or "${" not in node:
        return node

    def one(m: re.Match[str]) -> str:
        if m["file"]:
            try:
                return Path(m["file"]).read_text(encoding="utf-8").strip()
            except OSError as e:
                raise ConfigError(f"{where}: ${{file:{m['file']}}}: cannot read: {e.strerror or e}") from None
        if m["var"]:
            if m["var"] not in env:
                raise ConfigError(f"{where}: ${{{m['var']}}}: environment variable not set")
            return env[m["var"]]
        return "${"

    return _SUBST.sub(one, node)


def _unknown(key: Any, known: Sequence[str], where: str) -> ConfigError:
    hint = difflib.get_close_matches(str(key), known, n=1)
    return ConfigError(f"{where}: unknown setting {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""))


def _yaml_layer(path: str | Path, names: Sequence[str]) -> dict[str, Any]:
    data = _read_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    out = {}
    for k, v in data.items():
        name = str(k).replace("-", "_")
        if name not in names:
            raise _unknown(k, names, str(path))
        out[name] = v
    return out


def load_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] = os.environ,
    *,
    prog: str | None = None,
) -> T:
    """Build ``cls`` from defaults < YAML (--config / SVQA_CONFIG) < SVQA_* env < CLI flags."""
    fields = _fields(cls)
    names = [f.name for f, _ in fields]
    cli = _parse_cli(cls, sys.argv[1:] if argv is None else argv, prog)
    yaml_path = cli.pop(CONFIG_FLAG, None) or env.get(env_name(CONFIG_FLAG)) or None
    raw: dict[str, tuple[Any, str]] = {}  # field -> (value, where it came from)
    if yaml_path:
        raw |= {k: (v, f"{yaml_path}: {k}") for k, v in _yaml_layer(yaml_path, names).items()}
    for n in names:
        var = next((v for v in env_names(cls, n) if v in env), None)
        if var is not None:
            raw[n] = (env[var], var)
    raw |= {n: (v, _flag(n)) for n, v in cli.items()}
    values = {}
    for f, tp in fields:
        if f.name in raw:
            v, where = raw[f.name]
            values[f.name] = _convert(tp, v, where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(
                f"missing required setting {f.name!r} (set {_flag(f.name)}, {env_names(cls, f.name)[0]} "
                f"or {f.name}: in the config file)"
            )
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:  # the dataclass's own __post_init__ checks
        raise ConfigError(f"{cls.__name__}: {e}") from None


# --------------------------------------------------------------------------- declarations


DEFAULT_REDIS_URL = "redis://localhost:6379/0"


@dataclass(frozen=True)
class RedisSettings:
    """Settings of every service, the API included."""

    redis_url: str = setting(
        DEFAULT_REDIS_URL,
        "the Redis every service talks to; `redis+cluster://h:p,h:p` for a Redis Cluster (README)",
    )
    frames_redis_url: str | None = setting(
        None,
        'the Redis for frames and frame pictures, best one without persistence (README "Redis sizing")',
        shown="none (= redis_url)",
    )
    log_level: str = setting("INFO", "structlog JSON logs on stderr: DEBUG, INFO, WARNING, ERROR")


def policy_settings(policy: type, names: Mapping[str, str], defaults: Mapping[str, Any]) -> type:
    """Service settings declared by an engine policy (a frozen dataclass the engine takes, whose
    fields with help are settings): a frozen dataclass with, for each policy field in ``names``,
    the setting ``names[field]`` of the same type and help, and the same default unless
    ``defaults`` gives the services' own. The engine never imports this module."""
    hints = typing.get_type_hints(policy)
    fields = [
        (names[f.name], hints[f.name], setting(defaults.get(f.name, f.default), f.metadata["help"]))
        for f in dataclasses.fields(policy)
        if f.name in names
    ]
    doc = f"{policy.__name__}'s fields with help, as service settings."
    return dataclasses.make_dataclass(
        f"{policy.__name__}Settings", fields, frozen=True, namespace={"__module__": __name__, "__doc__": doc}
    )


def described(policy: type) -> tuple[str, ...]:
    """The fields of a policy that are settings: those declared with help."""
    return tuple(f.name for f in dataclasses.fields(policy) if "help" in f.metadata)


GPU_PREFIX = "gpu_"
POLICY_SETTINGS = described(SchedulePolicy)
# The scheduler's settings, as `gpu_<name>`. Services start questions beside encode steps by
# default: boot.py makes the KV pool defer frees, what the engine's default (off) leaves to
# whoever builds a Scheduler.
SchedulerSettings = policy_settings(
    SchedulePolicy, {name: GPU_PREFIX + name for name in POLICY_SETTINGS}, {"join_during_encode": True}
)


@dataclass(frozen=True)
class GPUSettings(SchedulerSettings):  # type: ignore[misc,valid-type]
    """How the GPU scheduler shares the device (common/engine/scheduler.py): the settings of every
    service that loads a model."""

    gpu_vision_graphs: bool = setting(
        True,
        "the vision tower replays a batch of chunks from a CUDA graph (one launch instead of ~500 from "
        "Python; the warm-up captures every batch size up to `gpu_max_chunks`, a new composition is captured "
        "the second time it comes, at most 16). Measured at 64 cameras (H200): encode steps of 7.4-7.8 "
        "chunks took 210-219 ms against 226-231 without. Its graphs keep a cuBLAS workspace of their own "
        "(docs/DESIGN.md): captured on the question graphs' stream, a worker hung",
    )
    gpu_profile_dir: Path | None = setting(
        None,
        "set a directory and `kill -USR2 <pid>` writes a torch.profiler trace of the GPU scheduler's next "
        "steps there (a Chrome trace for Perfetto and a table of the ops with the most device time); off "
        "and free otherwise",
    )
    gpu_profile_steps: int = setting(20, "steps one trace covers (`gpu_profile_dir`)")
    gpu_stuck_s: float = setting(
        120.0,
        "a GPU step still running after this long (a hung device, a deadlock: the loop cannot report it "
        "itself) ends the process with exit 5 and one line, `gpu loop stuck`, giving the loop thread's "
        "Python stack; 0 never. GPU only: on a CPU a long step is merely slow",
    )

    def __post_init__(self) -> None:
        self.schedule_policy()  # its checks fail at start-up
        if self.gpu_profile_steps < 1:
            raise ValueError("gpu_profile_steps must be at least 1")
        if self.gpu_stuck_s < 0:
            raise ValueError("gpu_stuck_s must be >= 0 (0: never)")

    def schedule_policy(self) -> SchedulePolicy:
        return SchedulePolicy(**{name: getattr(self, GPU_PREFIX + name) for name in POLICY_SETTINGS})


@dataclass(frozen=True)
class ServiceSettings(RedisSettings):
    """Settings of a service that runs until stopped, with metrics and health checks."""

    redis_grace_s: float = setting(300.0, "ride out a Redis outage this long, then exit 3")
    metrics_port: int | None = setting(
        None, 'Prometheus metrics and `/health/live`, `/health/ready` on this port (README "Operating it")'
    )

    def __post_init__(self) -> None:
        if not self.redis_grace_s >= 0:
            raise ValueError(f"redis_grace_s must be 0 or more, got {self.redis_grace_s}")


@dataclass(frozen=True)
class CamerasSettings(ServiceSettings):
    """Settings of a service that reads the cameras file: ingest, encoder, qa, worker, recorder."""

    cameras_file: str | None = setting(
        None,
        "cameras and jobs (YAML, above): ingest reads its cameras, encoder and qa serve them as streams, qa "
        "runs its jobs",
    )


@dataclass(frozen=True)
class ReaderSettings:
    """Settings of whoever blocks on Redis reads."""

    block_ms: int = setting(1000, "longest blocking Redis read: how long a stop or a new question may wait for it")


@dataclass(frozen=True)
class ClockSettings:
    """Settings of whoever takes frames' capture times as they come: the encoder, the recorder."""

    max_clock_skew_s: float = setting(
        MAX_CLOCK_SKEW_S,
        "frames stamped further ahead of Redis's clock (which ingest stamps with) are refused: live ones "
        "dead-lettered (encoder), any not logged (recorder: logged, one would be the camera's newest and the "
        "frames after it taken for ones logged already); a service whose host clock is further off Redis's says so "
        "at start",
    )

    def check_clock(self) -> None:
        if not self.max_clock_skew_s >= 0:
            raise ValueError(f"max_clock_skew_s must be 0 or more, got {self.max_clock_skew_s}")


@dataclass(frozen=True)
class QueueSettings:
    """Settings of whoever makes questions wait: the API before it queues one, qa for a history cache."""

    max_queue_wait_s: float = setting(
        30.0,
        "a question that would wait longer than this for the GPU (the questions queued ahead over the answering "
        "worker's answers a second; for a question about the past, its wait for a turn at a history cache "
        "added, reckoned alike) is refused with 429 and `Retry-After`, not queued (api); a question about "
        "the past that has waited this long for its turn at a history cache (`history_max_concurrent`) gets an "
        "error final (qa)",
    )

    def __post_init__(self) -> None:
        if not self.max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s must be > 0, got {self.max_queue_wait_s}")


@dataclass(frozen=True)
class StreamSettings(CamerasSettings):
    """Settings of a service that serves a set of streams: encoder, qa, worker, recorder."""

    streams: tuple[str, ...] = setting(
        (),
        "stream (camera) names to serve, comma-separated, or every camera of `cameras_file`; among encoders "
        "and qa workers, leases decide which one does",
    )

    def __post_init__(self) -> None:
        ServiceSettings.__post_init__(self)
        for name in self.streams:
            check_stream_name("streams", name)
        if not self.streams and not self.cameras_file:
            raise ValueError("no streams: set streams (SVQA_STREAMS=cam1,cam2) or cameras_file")


@dataclass(frozen=True)
class ModelSettings(GPUSettings, ReaderSettings, StreamSettings):
    """Settings of the services that load a model: encoder, qa, worker."""

    model: str = setting(DEFAULT_MODEL, "hub id, local path, `tiny-random`, `random-3b`")
    device: str | None = setting(None, "cuda, cpu, ...", shown="cuda when available")
    gemm_dtype: Literal["bf16", "fp8"] = setting(
        "bf16",
        "the dense layers' matrix products (language model and vision blocks: projections and MLPs): `bf16` "
        "in the model's own dtype (bf16 on a GPU), exact against transformers; `fp8` (opt-in, lossy) weights "
        "and activations in FP8 (e4m3, a scale per weight row and per token) on Hopper's FP8 tensor cores, "
        "those weights in half the memory: answers equal one-shot inference with the same quantization, not "
        "bf16's; its GPU tests pass on an H200, its speed is not yet measured (README "
        '"GPU sizing and limits")',
    )
    segment_store: str = setting(
        "shm:///dev/shm/streamvqa/segments",
        "where cache segments are kept: `shm://` a directory in shared host memory (tmpfs: outlives the "
        "worker, not the host; no fsync), `dir://` or a path (a disk, fsynced), `redis://` (or "
        "`redis+cluster://`: the service's own Redis), `memory://` (one process)",
    )
    consumer: str = setting(
        f"{socket.gethostname()}-{os.getpid()}", "this worker's name in Redis consumer groups", shown="host-pid"
    )
    max_deliveries: int = setting(
        3,
        "a frame handed out more often, or a question under way alone in this many workers that died, "
        "is rejected unprocessed",
    )
    framelog_dir: str | None = setting(
        None,
        "the recorder's frames log, read only: a stream whose segments are lost (host reboot or loss) is rebuilt "
        "by re-encoding its kept frames from it (encoder), and questions about a past span (`since`) are "
        'answered from it (qa); none: such a stream starts over empty (README "What survives what") and such a '
        'question gets an error (README "Asking about the past")',
    )

    decode_processes: int = setting(
        2,
        "processes decoding frames' pixels, out of the worker's GIL (the GPU loop waits for the GIL after "
        "every kernel launch: decoded in the worker's threads, 64 cameras' frames held it 12 % of the time, "
        "docs/BENCHMARKS.md): the encoder's live frames, and the logged frames a question about the past "
        "reads (qa, only with `framelog_dir`; a worker's encoder and qa share them); two decode about 320 "
        "448x448 frames a second, 2.5x what 64 cameras at 2 fps send",
    )

    def __post_init__(self) -> None:
        GPUSettings.__post_init__(self)
        StreamSettings.__post_init__(self)
        if self.decode_processes < 1:
            raise ValueError(f"decode_processes must be 1 or more, got {self.decode_processes}")


# --------------------------------------------------------------------------- cameras file

JobKind = Literal["caption", "subtitles", "custom", "alert"]
SubtitleFormat = Literal["vtt", "srt"]
MIN_PIXELS_FLOOR = 28 * 28  # one merged patch of the model grid
MAX_FPS = 240.0


def check_pixel_bounds(min_pixels: int | None, max_pixels: int | None) -> None:
    """Model grid bounds (None: the service default) with which every grid chosen stays within the
    frame limit: ValueError naming the one that is off."""
    limits = {"min_pixels": min_pixels_limit(MAX_FRAME_PIXELS), "max_pixels": MAX_FRAME_PIXELS}
    for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if v is not None and not MIN_PIXELS_FLOOR <= v <= limits[k]:
            raise ValueError(f"{k}: must be in [{MIN_PIXELS_FLOOR}, {limits[k]}], got {v}")
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise ValueError(f"min_pixels: {min_pixels} > max_pixels {max_pixels}")


def _check_name(field: str, v: str) -> None:
    try:
        check_stream_name(field, v)
    except SchemaError as e:
        raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class Camera:
    name: str  # the stream name: keys, logs, questions use it
    url: str  # file path, rtsp://, http(s)://, or /dev/videoN
    fps: float  # target sampling rate (by presentation time)
    realtime: bool | None = None  # drop frames when behind (live) vs backpressure; None = by url
    max_pixels: int | None = None  # model grid bounds; None = the service default
    min_pixels: int | None = None

    def __post_init__(self) -> None:
        _check_name("name", self.name)
        if not self.url.strip():
            raise ConfigError("url: empty")
        if not 0 < self.fps <= MAX_FPS:
            raise ConfigError(f"fps: must be in (0, {MAX_FPS:g}], got {self.fps}")
        try:
            check_pixel_bounds(self.min_pixels, self.max_pixels)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class Job:
    name: str
    stream: str  # a camera name, or "*" for every camera in the file
    kind: JobKind
    prompt: str | None = None  # required for kind "custom"; caption/subtitles have defaults
    every_s: float | None = None  # run every N seconds of capture time ...
    every_versions: int | None = None  # ... and/or every N new cache versions
    formats: tuple[SubtitleFormat, ...] = ("vtt",)
    # kind "alert": `prompt` is a yes/no question; it fires when P(yes) >= threshold for `debounce`
    # runs in a row, then not again before `cooldown_s` nor before the answer has turned to no.
    threshold: float = 0.5
    debounce: int = 1
    cooldown_s: float = 300.0
    webhook: str | None = None  # http(s) URL that receives each alert as a JSON POST
    mqtt: str | None = None  # mqtt://[user:password@]host[:port]/topic

    def __post_init__(self) -> None:
        _check_name("name", self.name)
        if self.stream != "*":
            _check_name("stream", self.stream)
        if self.kind in ("custom", "alert") and not (self.prompt or "").strip():
            raise ConfigError(f"prompt: required for kind {self.kind!r}")
        self._check_alert()
        if self.prompt is not None and len(self.prompt) > MAX_QUESTION_CHARS:
            raise ConfigError(f"prompt: longer than {MAX_QUESTION_CHARS} chars")
        if self.every_s is None and self.every_versions is None:
            raise ConfigError("every_s: set every_s and/or every_versions")
        if self.every_s is not None and self.every_s <= 0:
            raise ConfigError(f"every_s: must be > 0, got {self.every_s}")
        if self.every_versions is not None and self.every_versions < 1:
            raise ConfigError(f"every_versions: must be >= 1, got {self.every_versions}")
        if len(set(self.formats)) != len(self.formats):
            raise ConfigError(f"formats: duplicates in {list(self.formats)}")

    def _check_alert(self) -> None:
        if self.kind != "alert":
            if self.webhook or self.mqtt:
                raise ConfigError(f"webhook: only alert jobs deliver (kind is {self.kind!r})")
            return
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"threshold: must be in [0, 1], got {self.threshold}")
        if self.debounce < 1:
            raise ConfigError(f"debounce: must be >= 1, got {self.debounce}")
        if self.cooldown_s < 0:
            raise ConfigError(f"cooldown_s: must be >= 0, got {self.cooldown_s}")
        _check_url("webhook", self.webhook, ("http", "https"), need_path=False)
        _check_url("mqtt", self.mqtt, ("mqtt", "mqtts"), need_path=True)


def _check_url(field: str, url: str | None, schemes: tuple[str, ...], need_path: bool) -> None:
    if url is None:
        return
    parts = urlsplit(url)
    if parts.scheme not in schemes or not parts.hostname:
        raise ConfigError(f"{field}: expected {'|'.join(schemes)}://host..., got {redact_url(url)!r}")
    if need_path and not parts.path.strip("/"):
        raise ConfigError(f"{field}: no topic in {redact_url(url)!r} (…/topic)")


@dataclass(frozen=True)
class CamerasFile:
    cameras: tuple[Camera, ...] = ()
    jobs: tuple[Job, ...] = ()

    def __post_init__(self) -> None:
        _unique("cameras", [c.name for c in self.cameras])
        _unique("jobs", [j.name for j in self.jobs])
        names = {c.name for c in self.cameras}
        for i, j in enumerate(self.jobs):
            if j.stream != "*" and j.stream not in names:  # a typo would leave a job silently idle
                raise ConfigError(f"jobs[{i}].stream: {j.stream!r} is not a camera in this file")

    def camera(self, name: str) -> Camera:
        for c in self.cameras:
            if c.name == name:
                return c
        raise KeyError(name)

    def jobs_for(self, stream: str) -> list[Job]:
        return [j for j in self.jobs if j.stream in ("*", stream)]


def _unique(where: str, names: list[str]) -> None:
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{where}: duplicate names {dup}")


def _from_mapping(cls: type[T], data: Any, where: str) -> T:
    """Build a small dataclass from a YAML mapping: unknown keys, missing keys, bad types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: tp for f, tp in _fields(cls)}
    for k in data:
        if k not in fields:
            raise _unknown(k, list(fields), where)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kw[f.name] = _convert(fields[f.name], data[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING:
            raise ConfigError(f"{where}.{f.name}: missing")
    try:
        return cls(**kw)
    except ConfigError as e:
        raise ConfigError(f"{where}.{e}") from None


def load_cameras_file(path: str | Path) -> CamerasFile:
    """Parse and validate a cameras/jobs YAML file; ConfigError names the file and the entry."""
    data = _read_yaml(path)
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with 'cameras' and 'jobs'")
    for k in data:
        if k not in ("cameras", "jobs"):
            raise _unknown(k, ["cameras", "jobs"], str(path))
    parts: dict[str, tuple[Any, ...]] = {}
    for key, cls in (("cameras", Camera), ("jobs", Job)):
        items = data.get(key) or []
        if not isinstance(items, list):
            raise ConfigError(f"{path}: {key}: expected a list")
        parts[key] = tuple(_from_mapping(cls, x, f"{path}: {key}[{i}]") for i, x in enumerate(items))
    try:
        return CamerasFile(**parts)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


# --------------------------------------------------------------------------- start-up checks

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def check_redis_url(url: str, where: str) -> None:
    """A URL redis-py can use: right scheme, a port in range (every node's, for a cluster); the
    message never shows a password."""
    try:
        parts = urlsplit(url)
        cluster = cluster_nodes(url)
        port = parts.port if cluster is None else None
    except ValueError as e:
        # The parser's words quote the piece it choked on, a piece of the password when that holds
        # an unescaped '/', '?', '#' or '@' ("Port could not be cast to integer value as 'pa'").
        problem = "bad host or port (percent-encode '@', ':', '/', '?' and '#' in a password)" if "@" in url else e
        raise ConfigError(f"{where}: {redact_url(url)}: {problem}") from None
    if parts.scheme not in REDIS_SCHEMES:
        schemes = ", ".join(f"{s}://" for s in REDIS_SCHEMES)
        raise ConfigError(f"{where}: {redact_url(url)}: not a Redis URL (use {schemes})")
    if parts.scheme != "unix" and cluster is None and not parts.hostname:
        raise ConfigError(f"{where}: {redact_url(url)}: no host")
    if port == 0:
        raise ConfigError(f"{where}: {redact_url(url)}: port 0")


def check_settings(cfg: Any) -> None:
    """What a service checks before Redis or a model: Redis URLs, stream names, the cameras file."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name.endswith("redis_url") and value is not None:
            check_redis_url(value, f.name)
        elif f.name == "stream" and value is not None:
            _check_name("stream", value)
        elif f.name == "streams":
            for name in value:
                _check_name("streams", name)
    if getattr(cfg, "cameras_file", None):
        load_cameras_file(cfg.cameras_file)
