"""Service start-up shared by every `streamvqa <service>`: config, logs, metrics, Redis, model.

Each failure exits non-zero with one clear JSON log line on stderr, so an orchestrator sees why
a service is not running: 2 bad configuration (the cameras file included, checked before the
model loads), 3 Redis unusable, 4 model unusable. Exit 4 is final: compose does not restart it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar
from urllib.parse import urlsplit

import redis
import structlog

from common import health, metrics, redisio
from common.clock import warn_if_skewed
from common.config import (
    ConfigError,
    GPUSettings,
    check_redis_url,
    check_settings,
    load_cameras_file,
    load_config,
    unknown_env,
)
from common.engine.names import RANDOM_MODELS
from common.engine.scheduler import Scheduler
from common.logs import configure_logging, redact_text
from common.stalls import StallWatch, StepSampler, StuckWatch, freeze_heap
from common.version import VERSION
from common.wire.schemas import MAX_CLOCK_SKEW_S

if TYPE_CHECKING:  # torch only where a model is loaded
    from common.engine.profiling import StepProfiler
    from common.engine.runtime import Runtime

T = TypeVar("T")
log = structlog.get_logger()

EXIT_CONFIG, EXIT_REDIS, EXIT_MODEL, EXIT_GPU = 2, 3, 4, 5
GIL_SWITCH_S = 0.0005
HUB_PROBE_TIMEOUT_S = 3.0
REDIS_START_WAIT_S = 30.0  # a service that finds no Redis at start waits this long at most
LOCAL_WEIGHTS_HINT = (
    "point --model (SVQA_MODEL) at a local directory holding a Qwen2.5-VL checkpoint (config.json, "
    "*.safetensors, tokenizer files), or mount a Hugging Face cache that has it at HF_HOME; "
    "to try the pipeline without weights: --model tiny-random (random weights, meaningless answers)"
)


def stream_capacity(cfg: T, rt: Runtime, beside_tokens: int = 0) -> T:
    """`cfg` with `max_streams` capped by what the device's KV pool holds at `max_cache_tokens`,
    `beside_tokens` kept for questions' temporary caches: a worker never takes a stream its memory
    cannot hold (placement leaves it to another worker, or free), where it would fail every chunk
    of it. Exit 2 when not one stream fits."""
    fits = rt.streams_fit(cfg.max_cache_tokens, beside_tokens)
    if fits is None or (cfg.max_streams is not None and cfg.max_streams <= fits):
        return cfg
    pool = {"max_cache_tokens": cfg.max_cache_tokens, "kv_pool_tokens": rt.pool.limit_tokens()}
    pool |= {"history_tokens": beside_tokens} if beside_tokens else {}
    if fits == 0:
        fail(EXIT_CONFIG, "no stream fits in the KV pool: lower max_cache_tokens", **pool)
    log.info("max_streams from the KV pool", max_streams=fits, configured=cfg.max_streams, **pool)
    return dataclasses.replace(cfg, max_streams=fits)


def fail(code: int, event: str, **fields: Any) -> NoReturn:
    """The one line an operator reads, then the exit code an orchestrator reads."""
    log.error(event, exit_code=code, **fields)
    raise SystemExit(code)


def configure(cls: type[T], argv: list[str], prog: str, every: Sequence[type] = ()) -> T:
    """Config (flags, SVQA_*, YAML, the cameras file) and logging, or exit 2 with one line.
    The CLI calls this before it imports a service, so a typo costs no torch import. ``every``:
    every service's config class; an SVQA_* variable none of them reads is warned about (not an
    error: a variable of a newer or older release is not a typo)."""
    configure_logging("INFO")  # so that even a bad --log-level is reported as a JSON line
    for var, close in (unknown_env(every) if every else {}).items():  # first: it may be why the config is bad
        log.warning("no service reads this setting; ignored", service=prog, variable=var, did_you_mean=close)
    try:
        cfg = load_config(cls, argv[1:], prog=prog)
        configure_logging(cfg.log_level)
        check_settings(cfg)
    except (ConfigError, ValueError) as e:
        fail(EXIT_CONFIG, "bad configuration", service=prog, error=str(e))
    return cfg


def start(cls: type[T], argv: list[str], prog: str) -> tuple[T, redis.Redis]:
    """configure(), then the metrics/health endpoint and a live Redis."""
    cfg = configure(cls, argv, prog)
    serve_metrics(cfg, prog)
    log.info("starting", service=prog, version=VERSION, **startup_fields(cfg))
    try:
        r = redisio.wait_for_redis(cfg.redis_url, timeout_s=start_wait_s(cfg), block_ms=getattr(cfg, "block_ms", 5000))
    except redisio.NotACluster as e:
        fail(EXIT_CONFIG, "bad configuration", service=prog, error=str(e))
    except TimeoutError as e:
        fail(EXIT_REDIS, "redis unusable at start", service=prog, error=str(e))
    # frames are judged on Redis's clock (common/clock.py), but logs, events, status ages and
    # questions' times still read this host's: an operator learns at once that its time sync is off
    warn_if_skewed(r, getattr(cfg, "max_clock_skew_s", MAX_CLOCK_SKEW_S), prog)
    return cfg, r


def start_wait_s(cfg: Any) -> float:
    """How long a service waits for Redis at start: REDIS_START_WAIT_S, or its `redis_grace_s` when
    that is shorter (`--redis-grace-s 3` means three seconds at start too)."""
    return min(REDIS_START_WAIT_S, getattr(cfg, "redis_grace_s", REDIS_START_WAIT_S))


def serve_metrics(cfg: Any, prog: str) -> None:
    """The metrics/health endpoint on ``cfg.metrics_port`` (none: nothing), or exit 2 when it is taken."""
    role = prog.split()[-1]  # "streamvqa worker" -> worker
    health.READINESS.redis_url = cfg.redis_url
    health.READINESS.frames_redis_url = getattr(cfg, "frames_redis_url", None)
    health.READINESS.needs_model = hasattr(cfg, "model")
    port = getattr(cfg, "metrics_port", None)
    try:
        health.serve(port, metrics.registry_for([role]))
    except OSError as e:
        fail(EXIT_CONFIG, "metrics port unusable", service=prog, metrics_port=port, error=e.strerror or str(e))


def frames_redis(cfg: Any, r: redis.Redis) -> redis.Redis:
    """The Redis for frames and frame pictures (``frames_redis_url``): ``r`` itself when none is set.
    Frames are only in transit, so they may live on an instance without persistence (README)."""
    url = getattr(cfg, "frames_redis_url", None)
    if url is None or url == cfg.redis_url:
        return r
    try:
        return redisio.wait_for_redis(url, timeout_s=start_wait_s(cfg), block_ms=getattr(cfg, "block_ms", 5000))
    except TimeoutError as e:
        fail(EXIT_REDIS, "frames redis unusable at start", error=str(e))


def startup_fields(cfg: Any) -> dict[str, Any]:
    """Model, device and streams always; every other setting only where it differs from its default."""
    always = ("model", "device", "streams", "stream", "cameras_file")
    out: dict[str, Any] = {k: getattr(cfg, k) for k in always if hasattr(cfg, k)}
    if getattr(cfg, "cameras_file", None) and not getattr(cfg, "streams", None):
        # the streams the file names (its cameras' URLs, which may hold credentials, are never shown)
        out["streams"] = [c.name for c in load_cameras_file(cfg.cameras_file).cameras]
    changed = {}
    for f in dataclasses.fields(cfg):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = getattr(cfg, f.name)
        if f.name not in always and value != default:
            secret = f.metadata.get("secret") and value is not None  # a token: that it is set, never what it is
            changed[f.name] = "***" if secret else redact_text(value) if isinstance(value, str) else value
    return out | {"settings": changed}


def connect_tool(url: str, prog: str, timeout_s: float = 3.0) -> redis.Redis:
    """Redis for a command-line tool (ask, status, transcript): exit 2/3 with one line, never a traceback."""
    try:
        check_redis_url(url, "--redis-url")
    except ConfigError as e:
        fail(EXIT_CONFIG, "bad configuration", service=prog, error=str(e))
    try:
        return redisio.wait_for_redis(url, timeout_s=timeout_s)
    except redisio.NotACluster as e:
        fail(EXIT_CONFIG, "bad configuration", service=prog, error=str(e))
    except TimeoutError as e:
        fail(EXIT_REDIS, "redis unusable", service=prog, error=str(e))


# --------------------------------------------------------------------------- the model


def load_runtime(model: str, device: str | None, gpu: GPUSettings | None = None, gemm_dtype: str = "bf16"):
    """The model on its device (its dense products in `gemm_dtype`), its GPU scheduler running as
    `gpu` says, or exit: 2 for a device this machine lacks, 4 for the model. Each step below is
    named for what it does, in the order it must run in."""
    gpu = gpu or GPUSettings()
    t0 = time.monotonic()
    rt = load_model_or_exit(
        model,
        device,
        gemm_dtype=gemm_dtype,
        vision_graphs=gpu.gpu_vision_graphs,
        on_graph_capture=metrics.record_graph_capture,
        max_chunks=gpu.gpu_max_chunks,
    )
    load_s = time.monotonic() - t0
    metrics.watch_pool(rt.pool)
    warm_up_s = _prepare_device(rt, gpu)
    # what start-up made lives as long as the process (stalls.py); frozen before the stall watch
    # starts timing collections, so that this deliberate one is not reported as a pause
    frozen = freeze_heap()
    rt.executor = _start_gpu_loop(rt, gpu)
    health.READINESS.model_loaded = True
    log.info(
        "model loaded",
        model=model,
        device=str(rt.device),
        gemm_dtype=gemm_dtype,
        load_s=round(load_s, 1),
        warm_up_s=round(warm_up_s, 1),
        frozen_objects=frozen,
    )
    return rt


def _prepare_device(rt: Runtime, gpu: GPUSettings) -> float:
    """On a GPU, the process set up to feed it and everything compiled and captured now, not as
    stalls of the GPU loop once cameras stream: the warm-up's seconds (0 on a CPU)."""
    if rt.device.type != "cuda":
        return 0.0
    from common.engine.warmup import warm_up

    # Before the warm-up: a compiled function's guards include torch's thread count, so a
    # change after it recompiled everything the warm-up compiled, as stalls of the serving loop.
    _one_cpu_thread_per_op()
    warm_up_s = warm_up(rt, max_chunks=gpu.gpu_max_chunks)
    # The GPU loop drops the GIL at every CUDA wait; with dozens of stream and question threads
    # busy, taking it back costs up to a whole switch interval (5 ms by default) each time,
    # many times a step. A short interval hands it back sooner.
    sys.setswitchinterval(GIL_SWITCH_S)
    return warm_up_s


def _start_gpu_loop(rt: Runtime, gpu: GPUSettings) -> Scheduler:
    """The one loop that owns the device (batches every stream and question), running, with its
    metrics and, on a GPU, the watches that report a slow or stuck step."""
    policy = gpu.schedule_policy()
    if policy.join_during_encode:  # questions start beside encode steps: frees wait for the loop's settle (pool.py)
        rt.pool.defer_frees()
    # on a CPU every encode step takes seconds: a slow step says nothing there
    stall_watch = StallWatch() if rt.device.type == "cuda" else StallWatch(slow_s=math.inf)
    scheduler = Scheduler(
        policy,
        on_step=stall_watch.on_step,
        on_fatal=_gpu_failed,
        profiler=_profiler(gpu),
        on_settled=rt.pool.settled,
        room=rt.pool.room_tokens,  # questions leave the room evictions beside them may need
    ).start()
    metrics.watch_scheduler(scheduler)
    if rt.device.type == "cuda":  # on a CPU a long step is only a slow one
        stall_watch.sampler = StepSampler(scheduler).start()
        if gpu.gpu_stuck_s:
            StuckWatch(scheduler, gpu.gpu_stuck_s, _gpu_stuck).start()
    return scheduler


def load_model_or_exit(model: str, device: str | None, gemm_dtype: str = "bf16", **runtime: Any) -> Runtime:
    """The model on its device (its dense products in `gemm_dtype`), with no scheduler yet, or
    exit: 2 for a device this machine lacks, 4 for the model (the hub probed once, not retried for
    a minute)."""
    tried = check_model_source(model)
    from common.engine.model import load_model
    from common.engine.runtime import Runtime  # torch/transformers only where a model is needed

    check_device(device)
    try:
        return Runtime(load_model(model, device=device, gemm_dtype=gemm_dtype), **runtime)
    except (OSError, ValueError, RuntimeError) as e:
        fail(EXIT_MODEL, "model unusable at start", model=model, tried=tried, error=str(e), hint=LOCAL_WEIGHTS_HINT)


def _one_cpu_thread_per_op() -> None:
    """With the model on a GPU, torch's CPU ops here are host copies (a chunk's K/V out of
    page-locked memory, frames into it), made by dozens of stream threads at once. Each thread
    that runs one gets its own OpenMP team, as many threads as cores: with 64 cameras that was
    1,100 threads spinning on 16 cores, and the GPU loop's host work waited for a core. One
    thread per op (measured on an H200 with 64 cameras and full caches: 24-28 % of frames
    dropped before, 4 % after). OMP_NUM_THREADS, where an operator sets it, wins."""
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


def _profiler(gpu: GPUSettings) -> StepProfiler | None:
    """With `gpu_profile_dir` set, SIGUSR2 asks for a trace of the next steps (profiling.py)."""
    if gpu.gpu_profile_dir is None:
        return None
    from common.engine.profiling import StepProfiler

    profiler = StepProfiler(gpu.gpu_profile_dir, gpu.gpu_profile_steps)
    signal.signal(signal.SIGUSR2, lambda *_: profiler.request())
    log.info("gpu profiling ready: send SIGUSR2 for a trace", dir=str(gpu.gpu_profile_dir))
    return profiler


def _gpu_failed(error: BaseException) -> NoReturn:
    """The GPU loop broke (a CUDA error leaves the device unusable to this process): one line, then
    exit 5 at once, from its thread. Nothing unfinished was acked, so a restarted worker (or another
    one) gets every frame and question again."""
    where = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_tb(error.__traceback__)]
    _exit_gpu("gpu failed", error=redact_text(f"{type(error).__name__}: {error}"), where=where[-6:])


def _gpu_stuck(seconds: float, stack: list[str]) -> NoReturn:
    """A GPU step has run past `gpu_stuck_s` (a hung device does not come back to this process):
    one line saying where the loop stands, then exit 5 as for a failed device, from the watch's
    thread; what was not finished is delivered again to the restarted worker."""
    _exit_gpu("gpu loop stuck", seconds=round(seconds, 1), stack=stack)


def _exit_gpu(event: str, **fields: object) -> NoReturn:
    """One line, then exit 5 at once, from whichever thread saw the GPU loop lost."""
    log.error(event, exit_code=EXIT_GPU, **fields)
    logging.shutdown()
    os._exit(EXIT_GPU)


def check_device(device: str | None) -> None:
    import torch

    if device is None:
        return
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        fail(EXIT_CONFIG, "bad configuration", error=f"device: {e}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        build = (
            "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU is visible"
        )
        fail(EXIT_CONFIG, "bad configuration", error=f"device {device!r}: torch {torch.__version__} is {build}")


def check_model_source(model: str) -> list[str]:
    """Where the weights will come from, said before transformers tries (and retries for a minute).
    Exits 4 when no source can work; turns hub access off when only the local cache can."""
    if model in RANDOM_MODELS:
        return ["built-in random weights"]
    path = Path(model).expanduser()
    if path.is_dir():
        return [f"local directory {path}"]
    tried = [f"local directory {path}: does not exist"]
    if model.startswith(("/", ".", "~")) or not _valid_repo_id(model):
        fail(
            EXIT_MODEL,
            "model unusable at start",
            model=model,
            tried=[*tried, "hub: not a hub id (org/name)"],
            hint=LOCAL_WEIGHTS_HINT,
        )
    cached = _in_hf_cache(model)
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        reachable, why = False, "HF_HUB_OFFLINE is set"
    else:
        reachable, why = hub_reachable()
    if reachable:
        return [*tried, "Hugging Face cache" if cached else "Hugging Face hub"]
    if not cached:
        fail(
            EXIT_MODEL,
            "model unusable at start",
            model=model,
            tried=[*tried, "Hugging Face cache: not there", f"Hugging Face hub: unreachable ({why})"],
            hint=LOCAL_WEIGHTS_HINT,
        )
    _hub_offline()
    return [*tried, f"Hugging Face cache (hub unreachable: {why}; offline mode)"]


def hub_reachable() -> tuple[bool, str]:
    """(reachable, why not): one TCP connect to the hub's host instead of transformers' retries."""
    from huggingface_hub import constants

    parts = urlsplit(constants.ENDPOINT)
    host, port = parts.hostname or "huggingface.co", parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
        return True, ""
    except OSError as e:
        return False, f"{host}:{port}: {e.strerror or e}"


def _hub_offline() -> None:
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"  # read at import by libraries not yet imported
    constants.HF_HUB_OFFLINE = True  # read at call time by those already imported


def _valid_repo_id(model: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
        return True
    except HFValidationError:
        return False


def _in_hf_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop
