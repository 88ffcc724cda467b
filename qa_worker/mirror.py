"""Where a QA worker gets versions: mirrored from the encoder through Redis and the segment store.

A background thread tails `versions` of every served stream and applies the newest manifest
as soon as it appears, loading only segments it does not hold yet. Questions then take the
head that is already on the GPU: answering never waits on a transfer.
"""

from __future__ import annotations

import threading

import redis
import structlog

from common import metrics, redisio
from common.engine.eviction import EvictionPolicy
from common.engine.kvcache import StreamCache, Version
from common.engine.runtime import Runtime
from common.segment_store import SegmentStore, SegmentStoreError
from common.wire import keys
from common.wire.manifest import from_manifest
from common.wire.schemas import Manifest, SchemaError, decode_manifest, manifest_from_bytes

log = structlog.get_logger()

RECENT_VERSIONS = 8  # versions answerable by id (`at`): this many, since the last eviction


class StreamMirror:
    def __init__(self, rt: Runtime, store: SegmentStore, name: str):
        self.rt, self.store, self.name = rt, store, name
        self.cache: StreamCache | None = None
        self.recent: dict[int, Version] = {}

    @property
    def head(self) -> Version | None:
        return self.cache.head if self.cache else None

    def reset(self) -> None:
        self.cache, self.recent = None, {}

    def apply(self, manifest: Manifest) -> Version:
        state = from_manifest(manifest)
        if self.cache is None:
            self.cache = self.rt.new_cache(state.spec, EvictionPolicy())
        cache = self.cache
        # Storage I/O here, in the mirror's thread; only the copies to the device wait for the GPU.
        loaded = {seg.id: self.store.get(self.name, seg.id) for seg in cache.missing(state.cache)}
        if not cache.appends(state.cache):
            # An eviction: the recent versions are of the layout it replaces (and would be dropped
            # below). Let go of them first, so that unless a question still reads one the cache
            # moves in place instead of being copied whole (see kvcache.py).
            self.recent = {}
        version = self.rt.executor.call(lambda: cache.apply(state.cache, lambda seg: loaded[seg.id]))
        # Keep recent versions answerable by id, but only those of the head's layout: an older one
        # pins the pages of a whole cache that an eviction already replaced.
        self.recent = {vid: v for vid, v in self.recent.items() if v.layout is version.layout}
        self.recent[version.id] = version
        for old in sorted(self.recent)[:-RECENT_VERSIONS]:
            del self.recent[old]
        return version


class Mirror:
    """Mirrors every served stream; `get(stream)` is the head, `get(stream, at)` a recent version.
    The constructor catches every stream up from its head, so questions can be answered at once."""

    exclusive = False  # every QA process that mirrors a stream answers its questions

    def __init__(self, rt: Runtime, r: redis.Redis, store: SegmentStore, streams: list[str], block_ms: int = 1000):
        self.r, self.block_ms = r, block_ms
        self.streams = {name: StreamMirror(rt, store, name) for name in streams}
        # Each cursor is the newest entry's id before catching up from head: a version published in
        # between is read again and skipped if it is the head. (Not "$": a cluster polls, see read_streams.)
        self.cursors = {keys.versions(n): _newest_id(r, keys.versions(n)) for n in streams}
        for name in streams:
            self._catch_up(name)

    def get(self, stream: str, at: int | None = None) -> Version | None:
        mirror = self.streams[stream]
        return mirror.head if at is None else mirror.recent.get(at)

    def serves(self, stream: str) -> bool:
        return stream in self.streams

    def answering(self) -> list[str]:
        return list(self.streams)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.poll()
            except (redis.RedisError, RuntimeError) as e:  # keep mirroring once Redis or the GPU recovers
                log.error("mirror poll failed; retrying", error=str(e))
                stop.wait(1.0)

    def poll(self) -> None:
        """One blocking read of new manifests; applies the newest of each stream."""
        newest = {
            key: (eid, fields)
            for key, eid, fields in redisio.read_streams(self.r, self.cursors, 100, block_ms=self.block_ms)
        }
        for key, (entry_id, fields) in newest.items():
            self.cursors[key] = entry_id
            name = keys.stream_of(key)
            try:
                self._apply(name, decode_manifest(fields))
            except (SchemaError, SegmentStoreError, KeyError) as e:
                # A segment already collected (we fell behind) or a bad manifest: take the head instead.
                log.warning("version not applied; catching up from head", stream=name, error=str(e))
                self._catch_up(name)

    def _catch_up(self, name: str) -> None:
        raw = self.r.get(keys.head(name))
        if raw is None:
            return
        try:
            self._apply(name, manifest_from_bytes(raw))
        except (SchemaError, SegmentStoreError, KeyError) as e:
            log.error("head not applicable", stream=name, error=str(e))

    def _apply(self, name: str, manifest: Manifest) -> None:
        mirror = self.streams[name]
        head = mirror.head
        if head is not None and (manifest.epoch, manifest.version) == (head.epoch, head.id):
            return  # already applied (the head we caught up from is also the newest entry)
        if head is not None and (manifest.epoch != head.epoch or manifest.version < head.id):
            # Another epoch (or, before epochs, a lower id: entries arrive in order) means the stream
            # started over (its Redis came back empty): follow it rather than keep answering from a
            # cache that no longer exists.
            was = {"was_epoch": head.epoch, "was_version": head.id}
            log.warning("stream restarted; following it", stream=name, epoch=manifest.epoch, **was)
            redisio.event(self.r, name, "qa", "restarted", epoch=manifest.epoch, version=manifest.version, **was)
            mirror.reset()  # its segment ids restart too: nothing cached may be reused
        version = mirror.apply(manifest)
        metrics.record_version(name, version)
        log.debug("version mirrored", stream=name, version=version.id, tokens=version.tokens)


def _newest_id(r: redis.Redis, key: str) -> str:
    last = r.xrevrange(key, count=1)
    return last[0][0].decode() if last else "0-0"
