"""Encoder worker settings: defaults < YAML (--config) < SVQA_* environment < flags."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from common.config import ClockSettings, ModelSettings, described, policy_settings, setting
from common.engine.eviction import EvictionPolicy

# The eviction settings, declared in EvictionPolicy: `eviction` is its `mode`; a stream's cache
# gets a budget by default (the engine's default keeps everything)
_EVICTION = {name: "eviction" if name == "mode" else name for name in described(EvictionPolicy)}
EvictionSettings = policy_settings(EvictionPolicy, _EVICTION, {"max_cache_tokens": 32768})
RESTORE_THREADS = min(16, os.cpu_count() or 1)


@dataclass(frozen=True)
class EncoderConfig(EvictionSettings, ClockSettings, ModelSettings):  # type: ignore[misc,valid-type]
    """`streamvqa encoder`: encodes each stream's frames into the model's KV cache, version by version."""

    chunk_frames: int = setting(4, "frames per chunk, an even number: 2 frames make one temporal patch")
    rebase: bool = setting(True, "kept for old configs: false is the old spelling of `eviction` `absolute`")
    max_lag_s: float = setting(
        10.0,
        "live frames older than this (on Redis's clock, which ingest stamps with) are dropped, not encoded; a "
        "stream taken over (a dead worker's) counts from the takeover for the frames of its backlog not older "
        "than this then",
    )
    lease_ms: int = setting(
        5000, "stream ownership: a dead worker's streams are taken within `lease_ms` + 0.2 s, then restored"
    )
    max_streams: int | None = setting(
        None,
        'capacity: streams this worker holds at most ("Several GPUs and hosts"); on a GPU never more than '
        "fit in its KV pool at `max_cache_tokens` with 4 budgets to spare (a stream past that would fail "
        "every chunk) and, in a worker with `framelog_dir`, room for `history_max_concurrent` history caches, "
        "unbounded on a CPU",
        shown="what the GPU's KV pool holds",
    )
    versions_maxlen: int = setting(1000, "versions kept in each stream's history")
    keep_versions: int = setting(4, "segments of this many recent versions survive garbage collection")
    store_writers: int = setting(4, "threads writing segments off the stream threads; a stream's writes stay on one")
    restore_threads: int = setting(
        RESTORE_THREADS,
        "threads reading and checking the segments of streams taken over (a dead worker's) into page-locked "
        "memory, from which the GPU loop copies them; each reads and checks (CRC-32C) about 2 GB/s (a 32K cache is "
        "1.2 GB; an H200 host's 8 readers 15.6 GB/s, 16 readers 18.8)",
        shown="the host's cores, at most 16",
    )

    def __post_init__(self) -> None:
        ModelSettings.__post_init__(self)
        if self.chunk_frames <= 0 or self.chunk_frames % 2:
            raise ValueError(f"chunk_frames must be a positive even number, got {self.chunk_frames}")
        if self.lease_ms < 3 * self.block_ms:
            raise ValueError("lease_ms must be at least 3 x block_ms so the lease is renewed in time")
        self.check_clock()
        if self.store_writers < 1:
            raise ValueError(f"store_writers must be 1 or more, got {self.store_writers}")
        if self.restore_threads < 1:
            raise ValueError(f"restore_threads must be 1 or more, got {self.restore_threads}")
        if self.max_streams is not None and self.max_streams < 0:
            raise ValueError(f"max_streams must be 0 or more, got {self.max_streams}")
        if not self.rebase and self.eviction == "exact":
            raise ValueError("rebase=false means eviction=absolute; it contradicts eviction=exact")
        self.eviction_policy()  # its own checks (watermark, sink, salient chunks) fail at start-up

    def eviction_policy(self) -> EvictionPolicy:
        policy = EvictionPolicy(**{name: getattr(self, setting) for name, setting in _EVICTION.items()})
        return policy if self.rebase else dataclasses.replace(policy, mode="absolute")
