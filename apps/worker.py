"""`streamvqa worker`: encoder and QA in one process, for one GPU that owns its streams.

One copy of the weights and one copy of each cache: questions read the encoder's versions
directly (zero-copy snapshots), nothing goes through the segment store on the way. The store
still receives every segment, so a restart continues where it stopped.
"""

from __future__ import annotations

from apps.worker_config import WorkerConfig
from common import boot, redisio
from common.segment_store import open_store
from encoder_worker.service import EncoderService
from qa_worker.service import QAService


def main(argv: list[str]) -> int:
    cfg, r = boot.start(WorkerConfig, argv, "streamvqa worker")
    rt = boot.load_runtime(cfg.model, cfg.device, cfg)
    cfg = boot.stream_capacity(cfg, rt)
    frames = boot.frames_redis(cfg, r)
    encoder = EncoderService(cfg, rt, r, open_store(cfg.segment_store, r), frames)
    service = QAService(cfg, rt, r, encoder, frames)  # the encoder is QA's version source
    return redisio.exit_code(lambda: service.run(boot.stop_on_signals()))
