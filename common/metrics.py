"""Every Prometheus metric streamvqa exports, in one place (like keys.py for Redis keys).

The families are created unregistered and grouped by role; each process serves only its own
roles' families on its own port (`metrics_port`): an ingest shows no QA histograms. All carry
the stream as a label where one applies. `common/health.py` serves them with the health checks.
"""

from __future__ import annotations

import dataclasses
import platform
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from common.threadcpu import ThreadCPU
from common.version import VERSION

if TYPE_CHECKING:  # the engine (and torch) load only where a model does
    from common.engine.phases import PhaseClock
    from common.engine.scheduler import DecodeTimes


class _ReadCounter(Collector):
    """A counter family read at every scrape: totals something else keeps anyway (the KV pool's
    re-layouts, dynamo's frames, a version's evictions) are exported as counters, so that rate()
    and increase() apply, and not set as gauges. ``read`` gives label values -> total; by default
    ``values``, which the code sets."""

    def __init__(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        read: Callable[[], dict[tuple[str, ...], float]] | None = None,
    ) -> None:
        self.name, self.doc, self.labels = name, doc, list(labels)
        self.values: dict[tuple[str, ...], float] = {}
        self.read = read or (lambda: self.values)

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.doc, labels=self.labels)]

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for labels, value in sorted(self.read().items()):
            family.add_metric(list(labels), value)
        yield family


_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_R = {"registry": None}  # registered per process, by role (registry_for)

BUILD_INFO = Gauge("svqa_build_info", "Always 1; the labels say what runs", ["version", "python"], **_R)
BUILD_INFO.labels(VERSION, platform.python_version()).set(1)

# ingest
FRAMES_IN = Counter("svqa_ingest_frames_total", "Frames published to the frames stream", ["stream"], **_R)
FRAME_BYTES = Counter("svqa_ingest_frame_bytes_total", "Frame payload bytes published", ["stream"], **_R)
DECODE_ERRORS = Counter("svqa_ingest_decode_errors_total", "Packets or frames that failed to decode", ["stream"], **_R)
RECONNECTS = Counter("svqa_ingest_reconnects_total", "Source reopen attempts", ["stream"], **_R)
STALLS = Counter("svqa_ingest_stalls_total", "Sources that stopped delivering frames", ["stream"], **_R)
INGEST_FPS = Gauge("svqa_ingest_fps", "Frames published per second over the last 10 s (0 when dead)", ["stream"], **_R)
INGEST_UP = Gauge("svqa_ingest_up", "1 while the source is connected and delivering, else 0", ["stream"], **_R)
LAST_FRAME_AGE = Gauge(
    "svqa_ingest_last_frame_age_seconds", "Seconds since the last published frame (or since start)", ["stream"], **_R
)

# encoder
FRAMES_ENCODED = Counter("svqa_encoder_frames_total", "Frames encoded into the cache", ["stream"], **_R)
FRAMES_DROPPED = Counter(
    "svqa_encoder_frames_dropped_total", "Frames dropped (late, duplicate, bad)", ["stream", "reason"], **_R
)
CHUNK_SECONDS = Histogram(
    "svqa_encoder_chunk_seconds", "Vision + prefill time per chunk", ["stream"], buckets=_LATENCY_BUCKETS, **_R
)
CHUNKS_WAITED_FOR_ROOM = Counter(
    "svqa_encoder_chunks_waited_for_kv_room",
    "Chunks the KV pool had no room for at first (questions held old versions' pages): waited for, not dropped",
    ["stream"],
    **_R,
)
ENCODER_LAG = Gauge(
    "svqa_encoder_lag_seconds", "Capture time of the newest frame to its version's publication", ["stream"], **_R
)
# cache gauges and totals: the encoder publishes versions, a separate qa mirrors them
CACHE_TOKENS = Gauge("svqa_cache_tokens", "Tokens in the stream's head version", ["stream"], **_R)
CACHE_BYTES = Gauge("svqa_cache_bytes", "KV bytes of the stream's head version", ["stream"], **_R)
EVICTIONS = _ReadCounter("svqa_cache_evictions", "Evictions since the stream started", ["stream"])
TOKENS_EVICTED = _ReadCounter("svqa_cache_tokens_evicted", "Tokens evicted since the stream started", ["stream"])
VERSION_ID = Gauge("svqa_cache_version", "Head version id", ["stream"], **_R)

# Segment store (the encoder's writer, common/segment_writer.py)
STORE_QUEUE_BYTES = Gauge("svqa_store_queue_bytes", "Segment bytes handed to the writer, not yet written", **_R)
STORE_WRITTEN_BYTES = Counter("svqa_store_written_bytes", "Segment bytes written to the store", **_R)
STORE_WRITE_SECONDS = Histogram(
    "svqa_store_write_seconds",
    "Time to write one segment",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
    **_R,
)
STORE_FAILURES = Counter(
    "svqa_store_failures", "Segment writes that failed: unavailable (retried) or error", ["kind"], **_R
)
WORKER_NAMESAKES = Counter(
    "svqa_worker_namesakes",
    "Heartbeats of this worker's name found written by another live process (two workers given one name)",
    **_R,
)
CACHE_RESTARTS = Counter(
    "svqa_cache_restarts",
    "Streams whose cache could not be restored (a segment missing or corrupt) and started over",
    ["stream"],
    **_R,
)
CACHE_REBUILDS = Counter(
    "svqa_cache_rebuilds",
    "Streams whose cache could not be restored and was rebuilt from the frames log instead",
    ["stream"],
    **_R,
)

# qa
QUESTIONS_IN_FLIGHT = Gauge("svqa_qa_questions_in_flight", "Questions being answered now", **_R)
QUESTIONS = Counter("svqa_qa_questions_total", "Questions finished", ["outcome"], **_R)
QUEUE_WAIT_SECONDS = Histogram(
    "svqa_qa_queue_wait_seconds",
    "Question entry (its stream id's time) to its start on the GPU: in its stream's queue, then in this worker's",
    buckets=_LATENCY_BUCKETS,
    **_R,
)
QUESTIONS_QUEUED = Gauge(
    "svqa_qa_questions_queued",
    "Questions this worker has taken that wait for the GPU (cameras first) or for a turn at a history cache",
    **_R,
)
FIRST_TOKEN_SECONDS = Histogram(
    "svqa_qa_first_token_seconds", "Question start to first answer token", buckets=_LATENCY_BUCKETS, **_R
)
ANSWER_SECONDS = Histogram("svqa_qa_answer_seconds", "Question start to final answer", buckets=_LATENCY_BUCKETS, **_R)
JOB_RUNS = Counter("svqa_qa_job_runs_total", "Periodic job runs", ["job", "stream", "outcome"], **_R)
ALERTS = Counter("svqa_alerts_total", "Alerts fired by alert jobs", ["stream", "job"], **_R)
ALERT_DELIVERIES = Counter(
    "svqa_alert_deliveries_total",
    "Alerts handed to a target (webhook, mqtt) by outcome: delivered, failed (every attempt failed) or dropped"
    " (the delivery queue was full)",
    ["stream", "target", "outcome"],
    **_R,
)

# recorder (the frames log, common/framelog.py)
RECORDER_FRAMES = Counter("svqa_recorder_frames_total", "Frames written to the frames log", ["stream"], **_R)
RECORDER_BYTES = Counter(
    "svqa_recorder_bytes_total", "Bytes written to the frames log (records and index), durable", ["stream"], **_R
)
RECORDER_SKIPPED = Counter(
    "svqa_recorder_skipped_total",
    "Frames entries acked without a write: already logged (duplicate), end-of-stream markers (eos), unreadable (bad), "
    "stamped ahead of the clock (ahead)",
    ["stream", "reason"],
    **_R,
)
RECORDER_COMMIT_SECONDS = Histogram(
    "svqa_recorder_commit_seconds",
    "Group commit of one camera's batch: write and fdatasync of records and index",
    buckets=_LATENCY_BUCKETS,
    **_R,
)
RECORDER_BACKLOG = Gauge(
    "svqa_recorder_backlog_frames",
    "Frames entries not yet durable in the log: read and waiting for the commit, or not yet read",
    ["stream"],
    **_R,
)
RECORDER_LOG_BYTES = Gauge("svqa_recorder_log_bytes", "Bytes of the camera's frames log on disk", ["stream"], **_R)
RECORDER_COLLECTED = Counter(
    "svqa_recorder_collected_bytes_total",
    "Bytes of frames log files deleted by retention: by age (retention_hours) or space (retention_gb)",
    ["stream", "reason"],
    **_R,
)
RECORDER_INDEXED = Gauge(
    "svqa_recorder_indexed_chunks", "Chunks in the camera's search index (their retrieval vectors)", ["stream"], **_R
)
RECORDER_WRITE_FAILING = Gauge(
    "svqa_recorder_write_failing",
    "1 while writes to the frames log fail (disk full, an I/O error): nothing is acked, writes are retried",
    **_R,
)

# the GPU scheduler (encoder, qa and worker: whoever loads a model)
_STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
GPU_STEP_SECONDS = Histogram(
    "svqa_gpu_step_seconds",
    "GPU scheduler steps by kind (encode, history, decode, task), GPU work finished",
    ["kind"],
    buckets=_STEP_BUCKETS,
    **_R,
)
GPU_STEP_UNITS = Counter(
    "svqa_gpu_step_units",
    "Work done by GPU steps: chunks encoded, pieces of the past encoded, question tokens decoded, tasks run",
    ["kind"],
    **_R,
)
GPU_GRAPH_CAPTURES = Histogram(
    "svqa_gpu_graph_capture_seconds",
    "CUDA graph captures of question steps, and of vision batches with gpu_vision_graphs"
    " (the GPU loop stands still during each)",
    buckets=_STEP_BUCKETS,
    **_R,
)
GPU_AT_RISK = _ReadCounter(
    "svqa_gpu_cameras_at_risk_seconds",
    "GPU loop time with a camera near dropping frames (a chunk waited gpu_deadline_share of max_lag_s): every "
    "step encodes first and questions are answered one at a time. A share of the time that grows means the GPU "
    "is at its edge: live answers slow down before frames drop",
)
GPU_ALLOC_RETRIES = _ReadCounter(
    "svqa_gpu_alloc_retries",
    "Times torch's CUDA allocator ran out, freed its cache and retried (each one synchronizes the device)",
    read=lambda: {(): alloc_retries()},
)
GPU_COMPILES = _ReadCounter(
    "svqa_gpu_compiles",
    "torch.compile since start: compiled (graphs made; one made while serving stalls the GPU loop for seconds, "
    "the warm-up should have made them all) and not_compiled (code it declined, a recompile limit reached, "
    "say: that code runs eager from then on, silently slower)",
    ["outcome"],
    read=lambda: {
        ("compiled",): compiled_frames("ok"),
        ("not_compiled",): compiled_frames("total") - compiled_frames("ok"),
    },
)


KV_POOL_TOKENS = Gauge(
    "svqa_kv_pool_tokens",
    "The device's KV pool in token slots: capacity, used (pages held, exact), peak (most used at once)",
    ["state"],
    **_R,
)
KV_RELAYOUTS = _ReadCounter(
    "svqa_kv_relayouts",
    "Caches laid out anew by evictions since start: in_place, or copied to fresh pages because a question "
    "or mirror still held the old ones (a second copy of that cache until it lets go) or the run had no room",
    ["how"],
)


def watch_pool(pool) -> None:
    """Read the KV pool's accounting (common/engine/pool.py) at every scrape."""
    for state in ("capacity", "used", "peak"):
        KV_POOL_TOKENS.labels(state).set_function(lambda s=state: getattr(pool, f"{s}_tokens"))
    KV_RELAYOUTS.read = lambda: {(how,): float(n) for how, n in pool.relayouts.items()}


def watch_scheduler(scheduler) -> None:
    """Read the GPU scheduler's decode times (common/engine/scheduler.py) and its loop's host time
    by phase (common/engine/phases.py) at every scrape."""
    DECODE_TIMES.times = scheduler.decode_times
    LOOP_PHASES.clock = scheduler.phase_clock
    GPU_AT_RISK.read = lambda: {(): scheduler.at_risk_s}


def compiled_frames(name: str) -> float:
    """dynamo's own count of the frames it was handed (total) and compiled (ok)."""
    utils = sys.modules.get("torch._dynamo.utils")  # read where something compiles; never imported for this
    return 0.0 if utils is None else float(utils.counters["frames"][name])


def alloc_retries() -> float:
    """Times torch's CUDA allocator ran out, freed its cache and retried, since start."""
    torch = sys.modules.get("torch")  # read where a model is loaded; never imported for this
    if torch is None or not torch.cuda.is_initialized():
        return 0.0
    return float(torch.cuda.memory_stats_as_nested_dict().get("num_alloc_retries", 0))


_THREADS = ThreadCPU()
THREAD_CPU = _ReadCounter(  # read from /proc at every scrape (threadcpu.py)
    "svqa_process_thread_cpu_seconds",
    "CPU seconds of this process's threads, by role",
    ["role"],
    read=lambda: {(role,): seconds for role, seconds in _THREADS.totals().items()},
)


class _DecodeTimesCollector(Collector):
    """svqa_gpu_decode_seconds_total{part}: the GPU scheduler's `DecodeTimes`, read at every scrape
    (none until `watch_scheduler`)."""

    NAME = "svqa_gpu_decode_seconds"
    HELP = (
        "Where the time of questions being answered went: decode steps from launch until their tokens were read"
        " (steps), the same steps on the device (device: a GPU only), and no decode step in flight while questions"
        " were being answered, inside an encode step (idle_encode) or outside (idle_between)"
    )

    def __init__(self) -> None:
        self.times: DecodeTimes | None = None

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.NAME, self.HELP, labels=["part"])]

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(self.NAME, self.HELP, labels=["part"])
        if self.times is not None:
            for part, seconds in dataclasses.asdict(self.times).items():
                family.add_metric([part], seconds)
        yield family


DECODE_TIMES = _DecodeTimesCollector()


class _PhaseClockCollector(Collector):
    """svqa_gpu_loop_{wall,cpu}_seconds_total{phase}: the GPU loop's `PhaseClock`, read at every
    scrape (none until `watch_scheduler`)."""

    FAMILIES: ClassVar[dict[str, tuple[str, str]]] = {
        "wall": ("svqa_gpu_loop_wall_seconds", "Wall seconds of the GPU loop's thread by phase, nested phases apart"),
        "cpu": ("svqa_gpu_loop_cpu_seconds", "CPU seconds of the GPU loop's thread by phase, nested phases apart"),
    }

    def __init__(self) -> None:
        self.clock: PhaseClock | None = None

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(name, doc, labels=["phase"]) for name, doc in self.FAMILIES.values()]

    def collect(self) -> Iterable[CounterMetricFamily]:
        for clock, (name, doc) in self.FAMILIES.items():
            family = CounterMetricFamily(name, doc, labels=["phase"])
            if self.clock is not None:
                for phase, seconds in dict(getattr(self.clock, clock)).items():
                    family.add_metric([phase], seconds)
            yield family


LOOP_PHASES = _PhaseClockCollector()

_GPU = (
    GPU_STEP_SECONDS,
    GPU_STEP_UNITS,
    DECODE_TIMES,
    LOOP_PHASES,
    GPU_GRAPH_CAPTURES,
    GPU_AT_RISK,
    GPU_ALLOC_RETRIES,
    GPU_COMPILES,
    KV_POOL_TOKENS,
    KV_RELAYOUTS,
)

# api (streamvqa api)
API_ANSWERS = Gauge("svqa_api_answers_in_flight", "Answers this API process is waiting for or streaming", **_R)
API_BUSY = Counter("svqa_api_busy_total", "Requests refused with 503 busy (max_answers, no pooled connection)", **_R)
API_QUEUE_FULL = Counter(
    "svqa_api_queue_full_total", "Questions refused with 429: they would wait past max_queue_wait_s for the GPU", **_R
)

_CACHE = (CACHE_TOKENS, CACHE_BYTES, EVICTIONS, TOKENS_EVICTED, VERSION_ID)
_STORE = (STORE_QUEUE_BYTES, STORE_WRITTEN_BYTES, STORE_WRITE_SECONDS, STORE_FAILURES, CACHE_RESTARTS, CACHE_REBUILDS)
ROLES: dict[str, tuple[Collector, ...]] = {
    "ingest": (
        THREAD_CPU,
        FRAMES_IN,
        FRAME_BYTES,
        DECODE_ERRORS,
        RECONNECTS,
        STALLS,
        INGEST_FPS,
        INGEST_UP,
        LAST_FRAME_AGE,
    ),
    "encoder": (
        THREAD_CPU,
        FRAMES_ENCODED,
        FRAMES_DROPPED,
        CHUNK_SECONDS,
        CHUNKS_WAITED_FOR_ROOM,
        ENCODER_LAG,
        WORKER_NAMESAKES,
        *_CACHE,
        *_STORE,
        *_GPU,
    ),
    "qa": (
        THREAD_CPU,
        QUESTIONS_IN_FLIGHT,
        QUESTIONS,
        QUEUE_WAIT_SECONDS,
        QUESTIONS_QUEUED,
        FIRST_TOKEN_SECONDS,
        ANSWER_SECONDS,
        JOB_RUNS,
        ALERTS,
        ALERT_DELIVERIES,
        *_CACHE,
        *_GPU,
    ),
}
ROLES["recorder"] = (
    THREAD_CPU,
    RECORDER_FRAMES,
    RECORDER_BYTES,
    RECORDER_SKIPPED,
    RECORDER_COMMIT_SECONDS,
    RECORDER_BACKLOG,
    RECORDER_LOG_BYTES,
    RECORDER_COLLECTED,
    RECORDER_WRITE_FAILING,
    RECORDER_INDEXED,
)
ROLES["worker"] = tuple(dict.fromkeys(ROLES["encoder"] + ROLES["qa"]))
ROLES["api"] = (THREAD_CPU, API_ANSWERS, API_BUSY, API_QUEUE_FULL)


def registry_for(roles: Iterable[str]) -> CollectorRegistry:
    """A private registry with build info and the families of these roles (once each)."""
    registry = CollectorRegistry()
    families = dict.fromkeys(m for role in roles for m in ROLES[role])
    for m in (BUILD_INFO, *families):
        registry.register(m)
    return registry


def all_names() -> set[str]:
    """Every family name as Prometheus exposes it (counters with _total): for docs and dashboards."""
    out = set()
    for m in {BUILD_INFO, *(m for ms in ROLES.values() for m in ms)}:
        for family in m.describe():
            out |= {family.name + "_total"} if family.type == "counter" else {family.name}
    return out


def record_version(stream: str, version) -> None:
    """Cache gauges for a newly published or mirrored version."""
    CACHE_TOKENS.labels(stream).set(version.tokens)
    CACHE_BYTES.labels(stream).set(version.kv_bytes())
    EVICTIONS.values[(stream,)] = version.stats.evictions
    TOKENS_EVICTED.values[(stream,)] = version.stats.tokens_evicted
    VERSION_ID.labels(stream).set(version.id)


def record_gpu_step(kind: str, seconds: float, units: int) -> None:
    """What the GPU scheduler reports after every step."""
    GPU_STEP_SECONDS.labels(kind).observe(seconds)
    GPU_STEP_UNITS.labels(kind).inc(units)


def record_graph_capture(seconds: float) -> None:
    GPU_GRAPH_CAPTURES.observe(seconds)
