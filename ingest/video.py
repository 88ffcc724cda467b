"""Decode video sources (RTSP, HLS, V4L2 devices, files) with PyAV and sample frames by time.

Shared by the ingest service (live cameras) and the ``replay`` command (files).

Hang protection, in layers (PyAV #584: ``av.open`` on a server that accepts the TCP connection
and never answers blocks forever without them):

1. PyAV's ``timeout=(open, read)`` argument installs an FFmpeg interrupt callback: the open, and
   then every single packet read, is aborted after that many seconds without progress.
2. For RTSP we also set FFmpeg's own socket ``timeout`` option (µs), so a blocking socket call
   gives up even where FFmpeg does not poll the interrupt callback.
3. Callers that must never stall (the ingest service, ``ingest/source.py``) decode in a worker
   thread and watch it from outside: no frame within the read timeout means the source stalled.
   A thread stuck in C cannot be killed, so the last resort is restarting the process.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import select
import stat
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email.message import Message
from typing import IO

import av
import numpy as np

from common.engine.grid import Grid, resize_to_grid

log = logging.getLogger(__name__)


_LIVE_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "rtmps://", "rtp://", "udp://", "srt://", "tcp://")
# After this many demux errors in a row we stop: the rest of the input is not readable.
_MAX_CONSECUTIVE_DEMUX_ERRORS = 5
# A live stream whose timestamps jump back by more than this restarted its clock: re-anchor.
_REWIND_S = 1.0
_MAX_PLAYLIST_BYTES = 1 << 20
# Slack in "slot" units so 0.7 * 10 == 6.9999999 still lands in slot 7.
_SLOT_EPS = 1e-6


@dataclass(frozen=True)
class DecodedFrame:
    index: int  # 0-based index among *sampled* frames of this open
    pts: float  # media time in seconds
    rgb: np.ndarray  # HxWx3 uint8
    epoch: int = 0  # times the media clock restarted before this frame in this open (concatenated recordings)


class SourceError(RuntimeError):
    """Cannot open the source, it has no video stream, nothing in it is decodable, or reading it
    failed for a reason other than bad data (read timeout, connection reset)."""


def is_live(url: str) -> bool:
    """True for network streams and capture devices; plain files (and http .mp4 downloads) are not."""
    lower = url.strip().lower()
    if lower.startswith(_LIVE_SCHEMES) or lower.startswith("v4l2:"):
        return True
    if lower.startswith("/dev/video"):
        return True
    return is_hls(url) or is_fifo(url)


def is_hls(url: str) -> bool:
    lower = url.strip().lower()
    return lower.startswith(("http://", "https://")) and lower.split("?", 1)[0].split("#", 1)[0].endswith(".m3u8")


def ended_playlist(url: str, timeout_s: float) -> bool:
    """Whether an HLS playlist ends (``#EXT-X-ENDLIST``: a VOD, or an event that is over), following a
    master playlist to its first variant. Such a source is a file: it ends once, where reopening a
    live one that "ended" replayed it from the start forever. False when it cannot be read (it is
    then opened as a live source, and the open says what is wrong)."""
    try:
        for _ in range(2):  # the playlist, or a master playlist and its first variant
            if not url.lower().startswith(("http://", "https://")):  # a playlist may name any URL
                return False
            with _OPENER.open(_request(url), timeout=timeout_s) as reply:
                text = reply.read(_MAX_PLAYLIST_BYTES).decode("utf-8", errors="replace")
            if "#EXT-X-ENDLIST" in text:
                return True
            variants = text.split("#EXT-X-STREAM-INF", 1)[1:]
            lines = [ln.strip() for ln in variants[0].splitlines()[1:]] if variants else []
            uri = next((ln for ln in lines if ln and not ln.startswith("#")), None)
            if uri is None:
                return False
            url = urllib.parse.urljoin(url, uri)
    except (OSError, ValueError):
        return False
    return False


class _CredentialsStayWithTheirOrigin(urllib.request.HTTPRedirectHandler):
    """urllib copies every header onto a redirected request: a playlist origin that answers 302 to
    a CDN edge, or to http:// from https://, had the camera's Basic credentials sent there."""

    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: Message, newurl: str
    ) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            new.remove_header("Authorization")
        return new


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), parts.hostname, parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())


_OPENER = urllib.request.build_opener(_CredentialsStayWithTheirOrigin)


def _request(url: str) -> urllib.request.Request:
    """urllib takes no credentials in a URL: they go into a Basic authorization header."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return urllib.request.Request(url)
    netloc = parts.netloc.rpartition("@")[2]  # host and port as written ([::1]:8080 too)
    login = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
    headers = {"Authorization": "Basic " + base64.b64encode(login.encode()).decode()}
    return urllib.request.Request(urllib.parse.urlunsplit(parts._replace(netloc=netloc)), headers=headers)


def open_container(
    url: str, *, open_timeout_s: float = 10.0, read_timeout_s: float = 10.0
) -> av.container.InputContainer:
    """Open ``url`` for reading with timeouts; raise SourceError (with url and reason) on failure."""
    target, fmt, options = _open_args(url, read_timeout_s)
    started = time.monotonic()
    held = _wait_for_a_writer(url, open_timeout_s) if is_fifo(url) else None
    try:
        container = av.open(
            target, mode="r", format=fmt, container_options=options, timeout=(open_timeout_s, read_timeout_s)
        )
    except (av.FFmpegError, OSError) as exc:
        raise SourceError(f"cannot open {url}: {_open_failure_reason(exc, started, open_timeout_s)}") from exc
    finally:
        if held is not None:
            os.close(held)
    if not container.streams.video:
        container.close()
        raise SourceError(f"cannot open {url}: no video stream")
    return container


def is_fifo(url: str) -> bool:
    """A named pipe: a bridge (`ffmpeg ... -f mpegts /run/cam.ts`), live as a camera is."""
    try:
        return stat.S_ISFIFO(os.stat(url).st_mode)
    except (OSError, ValueError):
        return False


def _wait_for_a_writer(path: str, open_timeout_s: float) -> int:
    """Wait, at most ``open_timeout_s``, for a named pipe's first bytes. FFmpeg's open(2) of a pipe
    with no writer blocks where neither the open timeout nor PyAV's interrupt reaches it: ingest hung
    for good, deaf to SIGTERM. The read end returned keeps the writer from a broken pipe until
    FFmpeg has opened its own: close it then."""
    try:
        held = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # returns at once, writer or not
    except OSError as e:
        raise SourceError(f"cannot open {path}: {e}") from e
    if not select.select([held], [], [], open_timeout_s)[0]:
        os.close(held)
        raise SourceError(f"cannot open {path}: no writer to the named pipe within {open_timeout_s:g} s")
    return held


def _open_args(url: str, read_timeout_s: float) -> tuple[str, str | None, dict[str, str]]:
    lower = url.lower()
    if lower.startswith(("rtsp://", "rtsps://")):
        # TCP interleaving: no UDP ports to open through NAT/firewalls, no lost packets.
        # FFmpeg >= 5 calls the socket I/O timeout "timeout" (µs); "stimeout" is rejected by FFmpeg 8.
        return url, None, {"rtsp_transport": "tcp", "timeout": str(int(read_timeout_s * 1_000_000))}
    if lower.startswith("v4l2:"):
        return url.split(":", 1)[1].removeprefix("//"), "v4l2", {}
    if lower.startswith("/dev/video"):
        return url, "v4l2", {}
    return url, None, {}


def _open_failure_reason(exc: BaseException, started: float, open_timeout_s: float) -> str:
    # When PyAV's interrupt callback fires, FFmpeg reports a generic error (for RTSP:
    # "Invalid data found when processing input"), so say "timed out" when the clock says so.
    elapsed = time.monotonic() - started
    if elapsed >= 0.9 * open_timeout_s:
        return f"no usable answer within {open_timeout_s:g} s (timed out; {exc})"
    return str(exc)


def sample_frames(
    container: av.container.InputContainer,
    fps: float,
    *,
    on_error: Callable[[str], None] | None = None,
    grid: Grid | None = None,
    on_decoded: Callable[[], None] | None = None,
) -> Iterator[DecodedFrame]:
    """Decode every packet of the first video stream and yield frames at ``fps`` by presentation time.

    A frame is kept when its pts reaches the next slot of a 1/fps grid anchored at the first kept
    pts (VFR-safe; never "every n-th frame"). Corrupt packets are reported to ``on_error`` and
    skipped. ``grid`` resizes to the stream's model grid (``grid.resize_to_grid``). Raises SourceError when nothing at
    all decodes. ``fps`` is validated now, not at the first ``next()``. ``on_decoded`` is called for
    every decoded frame, kept or not: the source's sign of life, even when ``fps`` keeps few.
    """
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    if not container.streams.video:
        raise SourceError(f"{_name(container)}: no video stream")
    return _sample(container, fps, on_error or _log_error, grid, on_decoded)


def _sample(
    container: av.container.InputContainer,
    fps: float,
    on_error: Callable[[str], None],
    grid: Grid | None,
    on_decoded: Callable[[], None] | None = None,
) -> Iterator[DecodedFrame]:
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"  # slice+frame threads; frame threading adds ~1 frame of latency
    sampler = _PtsSampler(fps)
    fallback_step = 1.0 / float(stream.guessed_rate or stream.average_rate or fps)
    errors = [0]  # mutable so the decode loop can count
    decoded, kept, last_t = 0, 0, None
    for frame in _decode_all(container, stream, on_error, errors):
        decoded += 1
        if on_decoded is not None:
            on_decoded()
        # Some raw/live streams leave pts unset: continue the clock at the nominal rate.
        t = frame.time if frame.time is not None else (last_t or 0.0) + fallback_step
        last_t = t
        if sampler.keep(t):
            yield DecodedFrame(kept, float(t), _to_rgb(frame, grid), sampler.restarts)
            kept += 1
    if decoded == 0:
        raise SourceError(f"{_name(container)}: nothing decodable ({errors[0]} errors)")


class _PtsSampler:
    """Keeps the first frame in each 1/fps slot of a grid anchored at the first kept pts.

    Slots are integers, so the grid never drifts and a gap in the stream skips slots instead of
    emitting a burst of catch-up frames.
    """

    def __init__(self, fps: float) -> None:
        self.fps = fps
        self.origin: float | None = None
        self.next_slot = 0
        self.last_seen = -math.inf
        self.restarts = 0  # clock restarts re-anchored so far: with pts, where a frame is in its source

    def keep(self, t: float) -> bool:
        if self.origin is None or t < self.last_seen - _REWIND_S:
            self.restarts += self.origin is not None
            self.origin, self.next_slot = t, 0
        self.last_seen = t
        slot = math.floor((t - self.origin) * self.fps + _SLOT_EPS)
        if slot < self.next_slot:
            return False
        self.next_slot = slot + 1
        return True


def _decode_all(
    container: av.container.InputContainer,
    stream: av.VideoStream,
    on_error: Callable[[str], None],
    errors: list[int],
) -> Iterator[av.VideoFrame]:
    """Every decodable frame in presentation order; data errors are reported and skipped.

    Network errors (read timeout, reset) are not data errors: they raise SourceError so the caller
    reconnects. A live stream whose server closes the connection just ends (EOF): reconnect too.
    """

    def report(kind: str, exc: BaseException) -> None:
        errors[0] += 1
        on_error(f"{_name(container)}: {kind} error #{errors[0]}: {exc}")

    demuxer = container.demux(stream)
    consecutive = 0
    while True:
        try:
            packet = next(demuxer)
        except StopIteration:
            return  # demux already sent the flush packet, the decoder is drained
        except (av.error.InvalidDataError, av.error.EOFError) as exc:
            report("demux", exc)
            consecutive += 1
            if consecutive >= _MAX_CONSECUTIVE_DEMUX_ERRORS or isinstance(exc, av.error.EOFError):
                break
            demuxer = container.demux(stream)  # a failed generator is finished; resume from here
            continue
        except av.FFmpegError as exc:
            # Not the data's fault: timeout (ExitError from PyAV's read timeout), reset, I/O error.
            # One exception type for "source broke" so callers simply reconnect on SourceError.
            raise SourceError(f"{_name(container)}: read failed ({type(exc).__name__}): {exc}") from exc
        consecutive = 0
        try:
            yield from packet.decode()
        except av.FFmpegError as exc:  # any decoder failure is about this packet's data
            report("decode", exc)
    yield from _drain(stream, report)


def _drain(stream: av.VideoStream, report: Callable[[str, BaseException], None]) -> Iterator[av.VideoFrame]:
    """Flush frames still held by the decoder (reordering / threading delay) after an aborted demux."""
    try:
        yield from stream.codec_context.decode(None)
    except av.FFmpegError as exc:
        report("flush", exc)


def _to_rgb(frame: av.VideoFrame, grid: Grid | None) -> np.ndarray:
    rgb = frame.to_ndarray(format="rgb24")
    turns = _quarter_turns(frame)
    if turns:  # upright, as players and the ffmpeg CLI show it
        rgb = np.ascontiguousarray(np.rot90(rgb, turns))
    return rgb if grid is None else resize_to_grid(rgb, grid)


def _quarter_turns(frame: av.VideoFrame) -> int:
    """Counter-clockwise quarter turns of the frame's display rotation: phones store a portrait
    clip as landscape pictures plus a display matrix that turns them."""
    return round(frame.rotation / 90) % 4


def display_quarter_turns(url: str, *, open_timeout_s: float = 10.0, read_timeout_s: float = 10.0) -> int:
    """The first frame's display rotation in quarter turns (0 when none decodes): the side data is
    on frames only, and the grid must be chosen for the frames as shown before decoding starts."""
    try:
        with open_container(url, open_timeout_s=open_timeout_s, read_timeout_s=read_timeout_s) as c:
            for frame in c.decode(c.streams.video[0]):
                return _quarter_turns(frame)
    except (SourceError, av.FFmpegError):
        pass
    return 0


def _name(container: av.container.InputContainer) -> str:
    return str(getattr(container, "name", "") or "video")


def _log_error(message: str) -> None:
    log.warning("%s", message)


def iter_file_frames(
    path: str,
    fps: float,
    *,
    on_error: Callable[[str], None] | None = None,
    grid: Grid | None = None,
    open_timeout_s: float = 10.0,
    read_timeout_s: float = 10.0,
) -> Iterator[DecodedFrame]:
    """Open ``path``, yield sampled frames, and always close the container (also on early exit)."""
    container = open_container(path, open_timeout_s=open_timeout_s, read_timeout_s=read_timeout_s)
    try:
        yield from sample_frames(container, fps, on_error=on_error, grid=grid)
    finally:
        container.close()
