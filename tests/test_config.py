"""Config layering (default < yaml < env < cli), type conversion, and the cameras file."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from apps import cli
from common.config import (
    Camera,
    CamerasFile,
    ConfigError,
    GPUSettings,
    Job,
    env_names,
    load_cameras_file,
    load_config,
    unknown_env,
)
from common.engine.eviction import EvictionPolicy
from common.engine.grid import MAX_ASPECT, choose_grid, min_pixels_limit
from common.engine.scheduler import SchedulePolicy
from common.wire.schemas import MAX_FRAME_PIXELS
from encoder_worker.config import EncoderConfig
from ingest.config import IngestConfig


@dataclass(frozen=True)
class ExampleConfig:
    """Example service config (only for these tests)."""

    redis_url: str = "redis://localhost:6379/0"
    block_ms: int = field(default=5000, metadata={"help": "longest blocking read"})
    fps: float = 2.0
    realtime: bool = False
    max_pixels: int | None = None
    model_dir: Path | None = None
    device: Literal["cuda", "cpu"] = "cuda"
    streams: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.block_ms < 0:
            raise ValueError("block_ms must be >= 0")


@dataclass(frozen=True)
class NeedsName:
    name: str
    level: str = "INFO"


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_defaults():
    assert load_config(ExampleConfig, [], env={}) == ExampleConfig()


def test_precedence_default_yaml_env_cli(tmp_path):
    y = _write(tmp_path, "block_ms: 100\nfps: 3.5\nrealtime: true\nmax-pixels: 1000\nstreams: [a, b]\n")
    env = {"SVQA_CONFIG": str(y), "SVQA_BLOCK_MS": "200", "SVQA_FPS": "4", "SVQA_OTHER_SERVICE": "x"}
    cfg = load_config(ExampleConfig, ["--block-ms", "300"], env=env)
    assert cfg.block_ms == 300  # cli > env > yaml
    assert cfg.fps == 4.0  # env > yaml
    assert cfg.realtime is True and cfg.max_pixels == 1000 and cfg.streams == ("a", "b")  # yaml > default
    assert cfg.redis_url == "redis://localhost:6379/0"  # default
    assert load_config(ExampleConfig, ["--config", str(y)], env={}).block_ms == 100  # --config flag


def test_env_and_cli_conversions():
    env = {
        "SVQA_REALTIME": "yes",
        "SVQA_MAX_PIXELS": "none",
        "SVQA_MODEL_DIR": "/models/x",
        "SVQA_DEVICE": "cpu",
        "SVQA_STREAMS": "cam1, cam2,",
    }
    cfg = load_config(ExampleConfig, [], env=env)
    assert cfg.realtime is True and cfg.max_pixels is None and cfg.model_dir == Path("/models/x")
    assert cfg.device == "cpu" and cfg.streams == ("cam1", "cam2")
    cfg = load_config(ExampleConfig, ["--no-realtime", "--max-pixels", "401408", "--fps=0.5"], env=env)
    assert cfg.realtime is False and cfg.max_pixels == 401408 and cfg.fps == 0.5


@pytest.mark.parametrize(
    ("argv", "env", "match"),
    [
        ([], {"SVQA_BLOCK_MS": "abc"}, "SVQA_BLOCK_MS: expected an integer, got 'abc'"),
        ([], {"SVQA_BLOCK_MS": "1.5"}, "SVQA_BLOCK_MS: expected an integer"),
        (["--fps", "fast"], {}, "--fps: expected a number, got 'fast'"),
        (["--fps", "nan"], {}, "--fps: expected a finite number"),
        ([], {"SVQA_REALTIME": "maybe"}, "SVQA_REALTIME: expected a boolean"),
        ([], {"SVQA_DEVICE": "tpu"}, "SVQA_DEVICE: 'tpu' is not one of cuda, cpu"),
        (["--block-ms", "-1"], {}, "ExampleConfig: block_ms must be >= 0"),  # the dataclass's own check
        (["--bogus", "1"], {}, "command line: unrecognized arguments: --bogus"),
        (["--block-ms"], {}, "command line: argument --block-ms: expected one argument"),
    ],
)
def test_bad_values(argv, env, match):
    with pytest.raises(ConfigError, match=match):
        load_config(ExampleConfig, argv, env=env)


def test_bad_yaml(tmp_path):
    cases = {
        "block_ms: [1]\n": r"c.yaml: block_ms: expected an integer",
        "block_ms: true\n": r"expected an integer, got True",
        "redis_url: 7\n": r"redis_url: expected a string, got int 7 \(quote it\)",
        "blok_ms: 5\n": r"unknown setting 'blok_ms' \(did you mean 'block_ms'\?\)",
        "- a\n- b\n": r"expected a mapping of settings, got list",
        "a: [\n": r"invalid YAML",
    }
    for text, match in cases.items():
        y = _write(tmp_path, text)
        with pytest.raises(ConfigError, match=match):
            load_config(ExampleConfig, ["--config", str(y)], env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(ExampleConfig, [], env={"SVQA_CONFIG": str(tmp_path / "missing.yaml")})
    assert load_config(ExampleConfig, ["--config", str(_write(tmp_path, ""))], env={}) == ExampleConfig()


def test_required_field():
    with pytest.raises(ConfigError, match=r"missing required setting 'name' \(set --name, SVQA_NAME"):
        load_config(NeedsName, [], env={})
    assert load_config(NeedsName, [], env={"SVQA_NAME": "enc-1"}).name == "enc-1"


def test_help_mentions_env(capsys):
    with pytest.raises(SystemExit) as ei:
        load_config(ExampleConfig, ["--help"], env={})
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert "--block-ms" in out and "SVQA_BLOCK_MS" in out and "longest blocking read" in out


SERVICES = {name: getattr(importlib.import_module(module), cls) for name, (module, cls) in cli.CONFIGS.items()}
# The recorder's consumer is one fixed name (one recorder per frames log), a worker's one per process.
# The recorder writes its frames log at a default path; the API reads one only when told where
# (unset: it serves no clips and cites none).
OWN_MEANING = {"consumer", "framelog_dir"}


@pytest.mark.parametrize("name", SERVICES)
def test_a_services_help_describes_it_and_every_setting(name, capsys):
    """One declaration per setting, with its help: no dataclass repr, no bare VALUE, no setting
    without a word about it."""
    cls = SERVICES[name]
    with pytest.raises(SystemExit):
        load_config(cls, ["--help"], env={}, prog=f"streamvqa {name}")
    out = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert f"`streamvqa {name}`:" in out and f"{cls.__name__}(" not in out, out[:400]
    assert "VALUE" not in out
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
        assert f"{f.metadata['help'].split()[0]}" in out and env_names(cls, f.name)[0] in out


def test_a_setting_shared_by_services_is_one_declaration():
    by_name: dict[str, dataclasses.Field] = {}
    for cls in SERVICES.values():
        for f in dataclasses.fields(cls):
            first = by_name.setdefault(f.name, f)
            assert first is f or f.name in OWN_MEANING, f"{f.name} is declared twice ({cls.__name__})"


def test_the_gpu_settings_are_the_schedule_policys_fields():
    """GPUSettings derives gpu_<name> from each SchedulePolicy field with help: same type and help,
    and the same default but join_during_encode, which the services turn on (their pool defers frees)."""
    policy = {f.name: f for f in dataclasses.fields(SchedulePolicy) if "help" in f.metadata}
    gpu = {f.name: f for f in dataclasses.fields(GPUSettings)}
    hints, policy_hints = typing.get_type_hints(GPUSettings), typing.get_type_hints(SchedulePolicy)
    for name, f in policy.items():
        mine = gpu[f"gpu_{name}"]
        assert mine.metadata["help"] == f.metadata["help"] and hints[mine.name] == policy_hints[name]
        assert mine.default == (True if name == "join_during_encode" else f.default), name
    changed = {f"gpu_{n}": not f.default if isinstance(f.default, bool) else f.default + 1 for n, f in policy.items()}
    changed["gpu_encode_share"] = changed["gpu_max_encode_share"] = changed["gpu_deadline_share"] = 0.5
    changed["gpu_history_share"] = 0.5
    got = load_config(GPUSettings, [], env={f"SVQA_{k.upper()}": str(v) for k, v in changed.items()}).schedule_policy()
    assert {f"gpu_{n}": getattr(got, n) for n in policy} == changed


def test_the_eviction_settings_are_the_eviction_policys_fields():
    """EncoderConfig's eviction settings are EvictionPolicy's fields with help (`eviction` its
    `mode`), and the policy it builds is the one they say; by default a stream's cache has a budget."""
    policy = {f.name: f for f in dataclasses.fields(EvictionPolicy) if "help" in f.metadata}
    mine = {f.name: f for f in dataclasses.fields(EncoderConfig)}
    for name, f in policy.items():
        assert mine["eviction" if name == "mode" else name].metadata["help"] == f.metadata["help"]
    env = {"SVQA_STREAMS": "cam1", "SVQA_MAX_CACHE_TOKENS": "9000", "SVQA_LOW_WATERMARK": "0.5"}
    env |= {"SVQA_SINK_CHUNKS": "2", "SVQA_EVICTION": "exact", "SVQA_SALIENT_CHUNKS": "3"}
    got = load_config(EncoderConfig, [], env=env).eviction_policy()
    assert (got.max_cache_tokens, got.low_watermark, got.sink_chunks, got.mode, got.salient_chunks) == (
        9000,
        0.5,
        2,
        "exact",
        3,
    )
    assert load_config(EncoderConfig, [], env={"SVQA_STREAMS": "cam1"}).eviction_policy().max_cache_tokens == 32768
    assert load_config(EncoderConfig, ["--no-rebase"], env={"SVQA_STREAMS": "c"}).eviction_policy().mode == "absolute"


# --------------------------------------------------------------------------- cameras file

GOOD = """\
cameras:
  - {name: cam1, url: "rtsp://10.0.0.5/stream", fps: 2, realtime: true, max_pixels: 401408}
  - {name: lobby.2, url: /data/lobby.mp4, fps: 1.5}
jobs:
  - {name: captions, stream: "*", kind: caption, every_s: 30}
  - {name: subs, stream: cam1, kind: subtitles, every_versions: 2, formats: [vtt, srt]}
  - {name: count, stream: lobby.2, kind: custom, prompt: "How many people?", every_s: 10, every_versions: 5}
"""


def test_cameras_file_ok(tmp_path):
    cf = load_cameras_file(_write(tmp_path, GOOD))
    assert cf.cameras[0] == Camera("cam1", "rtsp://10.0.0.5/stream", 2.0, True, 401408, None)
    assert cf.camera("lobby.2").realtime is None and cf.camera("lobby.2").fps == 1.5
    assert cf.jobs[0] == Job("captions", "*", "caption", every_s=30.0)
    assert cf.jobs[1].formats == ("vtt", "srt") and cf.jobs[0].formats == ("vtt",)
    assert [j.name for j in cf.jobs_for("cam1")] == ["captions", "subs"]
    assert load_cameras_file(_write(tmp_path, "")) == CamerasFile()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "cameras: [{name: cam1, url: a, fps: 1}, {name: cam1, url: b, fps: 1}]",
            r"cameras: duplicate names",
        ),
        ("cameras: [{name: 'cam 1', url: a, fps: 1}]", r"cameras\[0\]\.name: invalid value 'cam 1'"),
        ("cameras: [{name: cam1, url: a, fps: 0}]", r"cameras\[0\]\.fps: must be in \(0, 240\]"),
        ("cameras: [{name: cam1, url: a, fps: -2}]", r"cameras\[0\]\.fps"),
        ("cameras: [{name: cam1, url: a, fps: x}]", r"cameras\[0\]\.fps: expected a number"),
        ("cameras: [{name: cam1, url: a}]", r"cameras\[0\]\.fps: missing"),
        ("cameras: [{name: cam1, url: a, fps: 1, fsp: 2}]", r"unknown setting 'fsp' \(did you mean 'fps'"),
        ("cameras: [{name: cam1, url: '', fps: 1}]", r"cameras\[0\]\.url: empty"),
        ("cameras: [{name: c, url: a, fps: 1, min_pixels: 9000, max_pixels: 8000}]", r"min_pixels: 9000 >"),
        ("cameras: [{name: c, url: a, fps: 1, max_pixels: 10}]", r"max_pixels: must be in"),
        # inside [784, 4096²], but a frame scaled up to it rounds past 4096² pixels (exit 1 at the first frame)
        (
            "cameras: [{name: c, url: a, fps: 1, min_pixels: 16600000, max_pixels: 16777216}]",
            r"min_pixels: must be in \[784, 15223690\]",
        ),
        ("cameras: {name: cam1}", r"cameras: expected a list"),
        ("cams: []", r"unknown setting 'cams'"),
    ],
)
def test_cameras_file_errors(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as ei:
        load_cameras_file(_write(tmp_path, text))
    assert str(ei.value).startswith(str(tmp_path / "c.yaml"))


@pytest.mark.parametrize(
    ("job", "match"),
    [
        ("{name: j, stream: c, kind: caption}", r"jobs\[0\]\.every_s: set every_s and/or every_versions"),
        ("{name: j, stream: c, kind: caption, every_s: 0}", r"every_s: must be > 0"),
        ("{name: j, stream: c, kind: caption, every_versions: 0}", r"every_versions: must be >= 1"),
        ("{name: j, stream: c, kind: poem, every_s: 1}", r"jobs\[0\]\.kind: 'poem' is not one of caption"),
        ("{name: j, stream: c, kind: custom, every_s: 1}", r"prompt: required for kind 'custom'"),
        (
            "{name: j, stream: c, kind: caption, every_s: 1, formats: [ass]}",
            r"formats\[0\]: 'ass' is not one",
        ),
        ("{name: j, stream: c, kind: caption, every_s: 1, formats: [vtt, vtt]}", r"formats: duplicates"),
        ("{name: j, stream: cam9, kind: caption, every_s: 1}", r"jobs\[0\]\.stream: 'cam9' is not a camera"),
        ("{name: j, stream: 'c/..', kind: caption, every_s: 1}", r"jobs\[0\]\.stream: invalid value"),
        ("{name: j, stream: c, kind: caption, every_s: 1, prompt: 5}", r"prompt: expected a string"),
    ],
)
def test_job_errors(tmp_path, job, match):
    text = f"cameras: [{{name: c, url: a, fps: 1}}]\njobs: [{job}]\n"
    with pytest.raises(ConfigError, match=match):
        load_cameras_file(_write(tmp_path, text))


def test_the_largest_min_pixels_chooses_no_grid_over_the_frame_limit():
    """Scaling up to min_pixels rounds each side up: the bound holds at every aspect ratio allowed."""
    limit = min_pixels_limit(MAX_FRAME_PIXELS)
    for short in (1, 2, 3, 7, 13, 27, 29, 100, 1000):
        for long in range(short, MAX_ASPECT * short + 1, max(1, MAX_ASPECT * short // 499)):
            grid = choose_grid(short, long, min_pixels=limit, max_pixels=MAX_FRAME_PIXELS)
            assert grid.height * grid.width <= MAX_FRAME_PIXELS, (short, long)
    assert limit > 15_000_000  # not much below the limit: only the rounding's worst case is cut


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--max-backlog", "0"], r"max_backlog must be at least 1"),  # a file waited for ever
        (["--frames-maxlen", "-1"], r"frames_maxlen must be at least 1"),
        (["--read-timeout-s", "0"], r"read_timeout_s must be positive"),  # every source stalled at once
        (["--open-timeout-s", "-1"], r"open_timeout_s must be positive"),
        (["--redis-grace-s", "-1"], r"redis_grace_s must be 0 or more"),
        (["--max-reconnects", "-1"], r"max_reconnects must be 0 or more"),
        (["--max-pixels", str(10**13)], r"max_pixels: must be in \[784, 16777216\]"),
        (["--min-pixels", "17000000", "--max-pixels", "16777216"], r"min_pixels: must be in \[784, 15223690\]"),
        (["--fps", "1000"], r"fps must be in \(0, 240\]"),
        (["--cameras-file", "c.yaml"], r"url and stream \(one source\) cannot go with cameras_file"),
    ],
)
def test_bad_ingest_settings_are_refused_at_start(argv, match):
    with pytest.raises(ConfigError, match=match):
        load_config(IngestConfig, ["--url", "a.mp4", "--stream", "cam1", *argv], env={})


def test_duplicate_jobs(tmp_path):
    j = "{name: j, stream: '*', kind: caption, every_s: 1}"
    with pytest.raises(ConfigError, match=r"jobs: duplicate names \['j'\]"):
        load_cameras_file(_write(tmp_path, f"jobs: [{j}, {j}]\n"))


def _every_config() -> list[type]:
    return [getattr(importlib.import_module(module), name) for module, name in cli.CONFIGS.values()]


def test_every_setting_compose_and_the_docs_name_is_read_by_a_service():
    """The warning below must not fire on what the project itself tells people to set."""
    import re

    root = Path(__file__).resolve().parents[1]
    named = set()
    for doc in ("compose.yaml", ".env.example", "README.md", "docs/DESIGN.md"):
        named |= set(re.findall(r"\bSVQA_[A-Z0-9_]*[A-Z0-9]\b", (root / doc).read_text()))
    assert len(named) > 20 and unknown_env(_every_config(), dict.fromkeys(named, "x")) == {}


def test_a_setting_no_service_reads_is_warned_about_with_the_name_meant_never_its_value(redis_url):
    """`SVQA_GPU_GEMM_DTYPE=fp8` ran a benchmark in bf16 without a word (the setting is
    SVQA_GEMM_DTYPE). Every service warns about a variable none of them reads, naming the
    closest known one; its value (it may be a secret) is never shown. A variable another service
    reads is no typo: no warning."""
    import subprocess
    import sys

    env = {
        **os.environ,
        "SVQA_GPU_GEMM_DTYPE": "fp8-s3cret",
        "SVQA_RETENTION_HOURS": "12",  # the recorder's: read by a service, not this one
        "SVQA_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    out = subprocess.run(
        [sys.executable, "-m", "apps.cli", "ingest", "--streams", "cam1", "--redis-grace-s", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    lines = [json.loads(x) for x in out.stderr.splitlines() if x.startswith("{")]
    warned = [x for x in lines if x["event"] == "no service reads this setting; ignored"]
    assert [(x["variable"], x["did_you_mean"]) for x in warned] == [("SVQA_GPU_GEMM_DTYPE", "SVQA_GEMM_DTYPE")]
    assert "s3cret" not in out.stdout + out.stderr
