"""Evidence from the frames log (common/framelog.py): MP4 clips and JPEG snapshots of what a camera
captured, and the URLs that cite them beside final answers and alerts.

The frames are the ones the encoder saw (the log keeps ingest's payloads), each at its capture
time: a clip's timestamps are the frames' own, so a gap in the capture is a gap in the clip.
Encoding runs in a worker thread: the event loop keeps serving answers meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any, TypeVar

import av
import numpy as np
import structlog
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from PIL import Image

from api import errors
from api.answers import Busy
from api.guard import require_token
from common.framelog import FrameLog, FrameLogError, Record, decode
from common.wire.schemas import SchemaError, check_stream_name

log = structlog.get_logger(__name__)
T = TypeVar("T")
router = APIRouter(prefix="/api", tags=["evidence"], dependencies=[Depends(require_token)])

DEFAULT_CLIP_S = 30.0  # `to` when only `from` is given
MAX_CLIP_S = 600.0  # longer spans are refused (400): a clip is encoded whole, in memory
SNAPSHOT_WINDOWS_S = (2.0, 60.0)  # the nearest frame is looked for within these distances of `at`, in turn
TIME_BASE = Fraction(1, 1000)  # pts in milliseconds from the clip's first frame
CODEC = "libx264" if "libx264" in av.codecs_available else "mpeg4"
# a clip is made while someone waits: x264's fast presets are a few times quicker than its default
X264_OPTIONS = {"preset": "veryfast"}
# fragmented MP4: written in one pass to memory, and browsers play it as it arrives
MP4_OPTIONS = {"movflags": "frag_keyframe+empty_moov+default_base_moof"}


def clip_path(stream: str, t0: float, t1: float) -> str:
    """Where the API serves the MP4 of ``stream`` from ``t0`` to ``t1`` (capture times, unix seconds)."""
    return f"/api/streams/{stream}/clip?from={t0:.3f}&to={t1:.3f}"


def clip_around(stream: str, start: float, end: float, at: float) -> str:
    """The clip of [start, end], or, when that is longer than a clip may be, of the MAX_CLIP_S of
    it around `at` (a search result's best chunk). A hundredth of a second short: both ends are
    written to the millisecond, and their difference must not round past MAX_CLIP_S."""
    span = MAX_CLIP_S - 0.01
    if end - start > span:
        start = min(max(start, at - span / 2), end - span)
        end = start + span
    return clip_path(stream, start, end)


def snapshot_path(stream: str, at: float) -> str:
    return f"/api/streams/{stream}/snapshot?at={at:.3f}"


def evidence(stream: str, ranges: Sequence[Sequence[float]]) -> dict[str, Any] | None:
    """What an answer or alert saw: its capture ranges, a clip covering them (their newest
    MAX_CLIP_S when they stretch further) and a snapshot at their end; None without ranges."""
    if not ranges:
        return None
    start, end = min(r[0] for r in ranges), max(r[1] for r in ranges)
    return {
        "ranges": [[float(s), float(e)] for s, e in ranges],
        "clip": clip_path(stream, max(start, end - MAX_CLIP_S), end),
        "snapshot": snapshot_path(stream, end),
    }


def parse_time(value: str, param: str) -> float:
    """Epoch seconds or ISO 8601 (UTC when it names no zone) -> epoch seconds; 400 naming ``param``."""
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise errors.ApiError(400, f"{param}: not a finite time: {value!r}", param)
        return seconds
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise errors.ApiError(
            400, f"{param}: expected epoch seconds or an ISO 8601 time, got {value!r}", param
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def _frames_log(request: Request, stream: str) -> FrameLog:
    try:
        check_stream_name("stream", stream)
    except SchemaError as e:
        raise errors.schema_error(e) from None
    frames = request.app.state.framelog
    if frames is None:
        raise errors.ApiError(404, "no frames log: this API has no framelog_dir set", code="no_frames_log")
    return frames


def pictures(records: Iterable[Record]) -> Iterator[tuple[Record, np.ndarray]]:
    """Each record with its frame's pixels; a record whose pixels do not decode (the recorder checks
    headers, not pixels) is skipped with a warning, not the whole clip refused."""
    for rec in records:
        try:
            yield rec, decode(rec.raw).rgb()
        except (SchemaError, ValueError) as e:
            log.warning("frames log record undecodable; left out", seq=rec.seq, ts=rec.ts, error=str(e))


def encode_mp4(records: Iterable[Record], codec: str = CODEC) -> tuple[bytes, int, float, float] | None:
    """The records' frames as an MP4 at their capture times: (bytes, frames, first ts, last ts);
    None when there are none. Every frame is scaled to the first one's size (even: 4:2:0 needs it)."""
    frames = pictures(records)
    first = next(frames, None)
    if first is None:
        return None
    buf, t0 = io.BytesIO(), first[0].ts
    with av.open(buf, mode="w", format="mp4", options=MP4_OPTIONS) as out:
        stream = _video_stream(out, codec, first[1].shape)
        pts, count, last = -1, 0, t0
        for rec, rgb in itertools.chain([first], frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame = frame.reformat(width=stream.width, height=stream.height, format="yuv420p")
            # strictly increasing, as the muxer needs, even for frames captured within one millisecond
            pts = max(pts + 1, round((rec.ts - t0) * 1000))
            frame.pts, frame.time_base = pts, TIME_BASE
            out.mux(stream.encode(frame))
            count, last = count + 1, rec.ts
        out.mux(stream.encode())
    return buf.getvalue(), count, t0, last


def _video_stream(out: Any, codec: str, shape: tuple[int, ...]) -> Any:
    # the rate is a hint for rate control; pts carry the timing
    stream = out.add_stream(codec, rate=2, options=X264_OPTIONS if codec == "libx264" else {})
    height, width = shape[0], shape[1]
    stream.width, stream.height = max(2, width - width % 2), max(2, height - height % 2)  # a 1-pixel side: 2
    stream.pix_fmt = "yuv420p"
    stream.codec_context.time_base = stream.time_base = TIME_BASE
    return stream


def nearest_jpeg(frames: FrameLog, stream: str, at: float | None) -> tuple[bytes, Record] | None:
    """A JPEG of the frame captured nearest ``at`` (the newest without one), within the widest
    SNAPSHOT_WINDOWS_S; None when there is none."""
    if at is None:
        span = frames.span(stream)
        if span is None:
            return None
        at = span.last_ts
    for window in SNAPSHOT_WINDOWS_S:
        near = sorted(frames.stamps(stream, at - window, at + window), key=lambda s: abs(s[1] - at))
        found = next(pictures(_records(frames, stream, near)), None)
        if found is not None:
            jpeg = io.BytesIO()
            Image.fromarray(found[1]).save(jpeg, format="JPEG", quality=90)
            return jpeg.getvalue(), found[0]
    return None


def _records(frames: FrameLog, stream: str, stamps: Iterable[tuple[int, float]]) -> Iterator[Record]:
    """The records of ``stamps`` (seq, ts), in that order, each read when asked for: a snapshot
    reads the frames nearest its time until one decodes, not the whole window (up to 60 s of
    frames, tens of MB, held at once)."""
    for seq, ts in stamps:
        record = next((r for r in frames.frames(stream, seq, seq) if r.ts == ts), None)
        if record is not None:  # a numbering that started over may reuse the seq: its ts tells
            yield record


def _headers(**values: Any) -> dict[str, str]:
    return {"Cache-Control": "private, max-age=60"} | {k: str(v) for k, v in values.items()}


async def _reading(read: Callable[[], T]) -> T:
    """`read()` of the frames log, off the event loop; a log that cannot be read (its mount gone,
    not the API user's to read) is a JSON 503 naming that, not a 500 of plain text."""
    try:
        return await asyncio.to_thread(read)
    except (OSError, FrameLogError) as e:
        log.error("frames log unreadable", error=f"{type(e).__name__}: {e}")
        raise errors.ApiError(
            503, f"the frames log cannot be read ({type(e).__name__}): see the API's log", code="frames_log_unreadable"
        ) from None


@contextlib.contextmanager
def _encoding_slot(request: Request) -> Iterator[None]:
    """One of the process's `max_clips` encodes, or 503 busy: unbounded, a few requests for long
    clips of busy video took every core and hundreds of MB each (encoding cannot be cancelled, a
    client gone included), answers and the page slowed with them."""
    state = request.app.state
    if state.clips_encoding >= state.cfg.max_clips:
        raise Busy(f"busy: this API process encodes {state.cfg.max_clips} clips already (max_clips)", retry_after_s=5)
    state.clips_encoding += 1
    try:
        yield
    finally:
        state.clips_encoding -= 1


@router.get(
    "/streams/{name}/clip",
    responses={200: {"content": {"video/mp4": {}}}},
    summary="An MP4 of the frames captured from `from` to `to` (frames log)",
)
async def clip(
    name: str,
    request: Request,
    from_: str = Query(..., alias="from", description="epoch seconds or ISO 8601 (UTC without a zone)"),
    to: str | None = Query(None, description=f"default: from + {DEFAULT_CLIP_S:g} s; at most {MAX_CLIP_S:g} s on"),
) -> Response:
    frames = _frames_log(request, name)
    t0 = parse_time(from_, "from")
    t1 = parse_time(to, "to") if to is not None else t0 + DEFAULT_CLIP_S
    if t1 < t0:
        raise errors.ApiError(400, "to: before from", "to")
    if t1 - t0 > MAX_CLIP_S:
        raise errors.ApiError(400, f"to: a clip spans at most {MAX_CLIP_S:g} s, asked {t1 - t0:g} s", "to")
    with _encoding_slot(request):
        made = await _reading(lambda: encode_mp4(frames.between(name, t0, t1)))
    if made is None:
        raise errors.ApiError(404, f"no frames of {name!r} kept from {t0:.3f} to {t1:.3f}", code="no_frames")
    data, count, first, last = made
    headers = _headers(**{"X-Clip-Frames": count, "X-Clip-From": f"{first:.3f}", "X-Clip-To": f"{last:.3f}"})
    return Response(data, media_type="video/mp4", headers=headers)


@router.get(
    "/streams/{name}/snapshot",
    responses={200: {"content": {"image/jpeg": {}}}},
    summary="A JPEG of the kept frame captured nearest `at` (default: the newest)",
)
async def snapshot(
    name: str,
    request: Request,
    at: str | None = Query(None, description="epoch seconds or ISO 8601; default: the newest frame kept"),
) -> Response:
    frames = _frames_log(request, name)
    when = parse_time(at, "at") if at is not None else None
    found = await _reading(lambda: nearest_jpeg(frames, name, when))
    if found is None:
        where = "" if when is None else f" within {SNAPSHOT_WINDOWS_S[-1]:g} s of {when:.3f}"
        raise errors.ApiError(404, f"no frame of {name!r} kept{where}", code="no_frames")
    jpeg, rec = found
    return Response(jpeg, media_type="image/jpeg", headers=_headers(**{"X-Frame-Seq": rec.seq, "X-Frame-Ts": rec.ts}))
