"""Every Prometheus metric streamvqa exports, in one place (like keys.py for Redis keys).

Each service serves them on its own port (`metrics_port`); all carry the stream as a label
where one applies. Compose healthchecks read this endpoint too.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# ingest
FRAMES_IN = Counter("svqa_ingest_frames_total", "Frames published to the frames stream", ["stream"])
DECODE_ERRORS = Counter("svqa_ingest_decode_errors_total", "Packets or frames that failed to decode", ["stream"])
RECONNECTS = Counter("svqa_ingest_reconnects_total", "Source reopen attempts", ["stream"])
STALLS = Counter("svqa_ingest_stalls_total", "Sources that stopped delivering frames", ["stream"])
INGEST_FPS = Gauge("svqa_ingest_fps", "Frames published per second, recent", ["stream"])

# encoder
FRAMES_ENCODED = Counter("svqa_encoder_frames_total", "Frames encoded into the cache", ["stream"])
FRAMES_DROPPED = Counter(
    "svqa_encoder_frames_dropped_total", "Frames dropped (late, duplicate, bad)", ["stream", "reason"]
)
CHUNK_SECONDS = Histogram(
    "svqa_encoder_chunk_seconds", "Vision + prefill time per chunk", ["stream"], buckets=_LATENCY_BUCKETS
)
ENCODER_LAG = Gauge(
    "svqa_encoder_lag_seconds", "Capture time of the newest frame to its version's publication", ["stream"]
)
CACHE_TOKENS = Gauge("svqa_cache_tokens", "Tokens in the stream's head version", ["stream"])
CACHE_BYTES = Gauge("svqa_cache_bytes", "KV bytes of the stream's head version", ["stream"])
EVICTIONS = Gauge("svqa_cache_evictions", "Evictions since the stream started", ["stream"])
TOKENS_EVICTED = Gauge("svqa_cache_tokens_evicted", "Tokens evicted since the stream started", ["stream"])
VERSION = Gauge("svqa_cache_version", "Head version id", ["stream"])

# qa
QUESTIONS_IN_FLIGHT = Gauge("svqa_qa_questions_in_flight", "Questions being answered now")
QUESTIONS = Counter("svqa_qa_questions_total", "Questions finished", ["outcome"])
FIRST_TOKEN_SECONDS = Histogram(
    "svqa_qa_first_token_seconds", "Question start to first answer token", buckets=_LATENCY_BUCKETS
)
ANSWER_SECONDS = Histogram("svqa_qa_answer_seconds", "Question start to final answer", buckets=_LATENCY_BUCKETS)
JOB_RUNS = Counter("svqa_qa_job_runs_total", "Periodic job runs", ["job", "stream", "outcome"])


def serve(port: int | None) -> None:
    """Start the /metrics endpoint in a daemon thread (no-op without a port)."""
    if port is not None:
        start_http_server(port)


def record_version(stream: str, version) -> None:
    """Cache gauges for a newly published or mirrored version."""
    CACHE_TOKENS.labels(stream).set(version.tokens)
    CACHE_BYTES.labels(stream).set(version.kv_bytes())
    EVICTIONS.labels(stream).set(version.stats.evictions)
    TOKENS_EVICTED.labels(stream).set(version.stats.tokens_evicted)
    VERSION.labels(stream).set(version.id)
