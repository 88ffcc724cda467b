"""The recorder's side of search: every camera's chunk vectors, from its features stream into its
index beside its frames log (common/chunkindex.py), kept with the log's retention.

An entry is acked only once the index holding it is saved (every `features_save_s`, after a
collection, at shutdown): one the recorder read and then lost in a crash is read again and added
then (a chunk already indexed is not added twice). Vectors of another model or other layers than
the camera's index (the model was changed) start the index anew, with an event: vectors of two
models are not comparable. When retention deletes a camera's oldest files, the chunks captured
before its oldest remaining frame leave the index too, and it is saved at once.
"""

from __future__ import annotations

from pathlib import Path

import redis
import structlog

from common import metrics, redisio
from common.chunkindex import ChunkIndex
from common.framelog import FrameLog
from common.wire import keys
from common.wire.feature_record import ChunkFeatures, decode_features
from common.wire.schemas import SchemaError

log = structlog.get_logger()

SOURCE = "recorder"


class Indexes:
    def __init__(self, r: redis.Redis, frames: redis.Redis, framelog: FrameLog, names: list[str]) -> None:
        """``r`` gets the events; ``frames`` holds the features streams (beside the frames)."""
        self.r, self.frames, self.framelog = r, frames, framelog
        self.loaded: dict[str, ChunkIndex | None] = {}  # by camera; None: none saved or arrived yet
        self.unacked: dict[str, list[str]] = {n: [] for n in names}  # entry ids, acked once saved

    def dir(self, cam: str) -> Path:
        return self.framelog.root / cam  # the name is checked: it is a served stream's

    def index_of(self, cam: str) -> ChunkIndex | None:
        if cam not in self.loaded:
            index = self.loaded[cam] = ChunkIndex.open(self.dir(cam))
            if index is not None:
                metrics.RECORDER_INDEXED.labels(cam).set(len(index))
        return self.loaded[cam]

    def add(self, cam: str, entry_id: str, fields: dict) -> None:
        """One features entry into the camera's index (acked with its next save)."""
        try:
            f = decode_features(fields)
        except SchemaError as e:
            log.warning("features entry unreadable; not indexed", stream=cam, entry_id=entry_id, error=str(e))
        else:
            self._fitting(cam, f).add(f)
        self.unacked[cam].append(entry_id)

    def _fitting(self, cam: str, f: ChunkFeatures) -> ChunkIndex:
        index = self.index_of(cam)
        if index is not None and index.fits(f):
            return index
        if index is not None:
            was = {"was_model": index.model, "was_layers": str(list(index.layers)), "chunks": len(index)}
            log.warning("search index started anew: vectors of another model or layers", stream=cam, **was)
            redisio.event(self.r, cam, SOURCE, "search_index_reset", model=f.model, **was)
        index = self.loaded[cam] = ChunkIndex.new_for(f)
        index.dirty = True
        return index

    def forget_collected(self, cam: str) -> None:
        """After retention deleted files of ``cam``: its chunks captured before the log's oldest
        remaining frame go too, saved now (a search must not find frames that are gone)."""
        index, span = self.index_of(cam), self.framelog.span(cam)
        if index is not None and index.remove_before(span.first_ts if span is not None else float("inf")):
            self.save(cam)

    def save_all(self) -> None:
        for cam in self.unacked:
            self.save(cam)

    def save(self, cam: str) -> None:
        """Save the camera's index if it changed, then ack the entries it holds. A failed save
        (a full disk) acks nothing: the entries are read again after a restart."""
        index = self.index_of(cam)
        if index is not None and index.dirty:
            try:
                self.dir(cam).mkdir(parents=True, exist_ok=True)
                index.save(self.dir(cam))
            except OSError as e:
                log.error("search index not saved; retried", stream=cam, error=str(e))
                return
            metrics.RECORDER_INDEXED.labels(cam).set(len(index))
        if ids := self.unacked.get(cam):  # none for a camera no longer recorded (its log collected)
            self.frames.xack(keys.features(cam), keys.RECORDER_GROUP, *ids)
            redisio.trim_consumed(self.frames, keys.features(cam), keys.RECORDER_GROUP)
            ids.clear()
