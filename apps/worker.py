"""`streamvqa worker`: encoder and QA in one process, for one GPU that owns its streams.

One copy of the weights and one copy of each cache: questions read the encoder's versions
directly (zero-copy snapshots), nothing goes through the segment store on the way. The store
still receives every segment, so a restart continues where it stopped.
"""

from __future__ import annotations

from apps.worker_config import WorkerConfig
from common import boot, redisio
from common.engine.runtime import Runtime
from common.segment_store import open_store
from encoder_worker.service import EncoderService
from qa_worker.service import QAService


def main(argv: list[str]) -> int:
    cfg, r = boot.start(WorkerConfig, argv, "streamvqa worker")
    rt = boot.load_runtime(cfg.model, cfg.device, cfg, cfg.gemm_dtype)
    cfg = boot.stream_capacity(cfg, rt, history_tokens(cfg, rt))
    frames = boot.frames_redis(cfg, r)
    encoder = EncoderService(cfg, rt, r, open_store(cfg.segment_store, r), frames)
    # the encoder is QA's version source; its decoder processes decode the logged frames too
    service = QAService(cfg, rt, r, encoder, frames, decoder=encoder.decoder, live_tokens=live_tokens(cfg, rt))
    return redisio.exit_code(lambda: service.run(boot.stop_on_signals()))


def history_tokens(cfg: WorkerConfig, rt: Runtime) -> int:
    """The KV pool tokens kept out of the live streams' room for questions about the past: as many
    temporary caches as may be held at once (none without a frames log to answer them from)."""
    if cfg.framelog_dir is None:
        return 0
    return cfg.history_max_concurrent * rt.in_pages(cfg.history_max_tokens)


def live_tokens(cfg: WorkerConfig, rt: Runtime) -> int | None:
    """The KV pool tokens the worker's live streams are guaranteed (what history caches stay out
    of); None when they have no bound: no `max_streams`, or no `max_cache_tokens` budget."""
    if cfg.max_streams is None or cfg.max_cache_tokens is None:
        return None
    return rt.live_tokens(cfg.max_streams, cfg.max_cache_tokens)
