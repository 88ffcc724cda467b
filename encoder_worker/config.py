"""Encoder worker settings: defaults < YAML (--config) < SVQA_* environment < flags."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from common.config import GPUSettings
from common.engine.eviction import EvictionMode, EvictionPolicy
from common.engine.names import DEFAULT_MODEL
from common.wire.schemas import check_stream_name


@dataclass(frozen=True)
class EncoderConfig(GPUSettings):
    redis_url: str = "redis://localhost:6379/0"
    frames_redis_url: str | None = None  # frames and frame pictures, best a Redis without AOF; None: redis_url
    streams: tuple[str, ...] = ()  # stream names this worker may encode (leases decide who does)
    cameras_file: str | None = None  # alternatively: every camera in this file
    model: str = DEFAULT_MODEL  # hub id, local path, tiny-random, random-3b
    device: str | None = None  # default: cuda when available
    segment_store: str = "/var/lib/streamvqa/segments"  # directory, dir://, redis://, memory://
    chunk_frames: int = 4  # an even number: 2 frames make one temporal patch
    max_cache_tokens: int | None = 32768  # per stream; None keeps everything
    sink_chunks: int = 1
    low_watermark: float = 0.75
    eviction: EvictionMode = "rebase"  # rebase, exact or absolute: what retained chunks become (README)
    rebase: bool = True  # kept for old configs: false is eviction=absolute
    salient_chunks: int = 0  # chunks kept for a scene change, inside max_cache_tokens
    max_lag_s: float = 10.0  # live streams: frames older than this are dropped, not encoded
    # Processes decoding frames' pixels for all streams (decoding.py): out of the worker's GIL,
    # which the GPU loop takes back after every kernel launch. Decoded in the stream threads they
    # held it 12 % of the time at 64 cameras (H200, 2026-11-27); two decode 320 frames/s, 2.5x what
    # 64 cameras at 2 fps send (16 cores, Pillow 12.3, 448x448 WebP; docs/BENCHMARKS.md).
    decode_processes: int = 2
    lease_ms: int = 5000  # a dead worker's streams are taken over within about lease_ms + 2 s
    max_streams: int | None = None  # capacity: streams this worker holds at most (None: no bound)
    block_ms: int = 1000
    versions_maxlen: int = 1000
    keep_versions: int = 4  # segments of this many recent versions survive garbage collection
    consumer: str = f"{socket.gethostname()}-{os.getpid()}"
    redis_grace_s: float = 300.0  # ride out a Redis outage this long, then exit 3
    max_deliveries: int = 3  # an entry delivered more often is dead-lettered unprocessed
    metrics_port: int | None = None
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        GPUSettings.__post_init__(self)
        if self.chunk_frames <= 0 or self.chunk_frames % 2:
            raise ValueError(f"chunk_frames must be a positive even number, got {self.chunk_frames}")
        if self.lease_ms < 3 * self.block_ms:
            raise ValueError("lease_ms must be at least 3 x block_ms so the lease is renewed in time")
        if self.decode_processes < 1:
            raise ValueError(f"decode_processes must be 1 or more, got {self.decode_processes}")
        if self.max_streams is not None and self.max_streams < 0:
            raise ValueError(f"max_streams must be 0 or more, got {self.max_streams}")
        for name in self.streams:
            check_stream_name("streams", name)
        if not self.streams and not self.cameras_file:
            raise ValueError("no streams: set streams (SVQA_STREAMS=cam1,cam2) or cameras_file")
        if not self.rebase and self.eviction == "exact":
            raise ValueError("rebase=false means eviction=absolute; it contradicts eviction=exact")
        self.eviction_policy()  # its own checks (watermark, sink, salient chunks) fail at start-up

    def eviction_policy(self) -> EvictionPolicy:
        return EvictionPolicy(
            self.max_cache_tokens,
            self.low_watermark,
            self.sink_chunks,
            mode=self.eviction if self.rebase else "absolute",
            salient_chunks=self.salient_chunks,
        )
