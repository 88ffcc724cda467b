"""Wire schemas: frames, cache manifests, questions and answers.

Frames and manifests are msgpack maps (schema version ``v``) in a single stream field ``m``.
Questions and answers are plain string fields so that redis-cli alone can ask and read.

Every decoder validates every field (type, range, size) and raises ``SchemaError`` naming the
field; nothing from the wire reaches a worker unchecked. Unknown keys inside a msgpack map are
ignored (additive changes need no version bump); unknown question fields are rejected, because
there they are almost always a client's typo (``max_token``) that would otherwise pass silently.
"""

from __future__ import annotations

import io
import json
import math
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from dataclasses import fields as dataclass_fields
from typing import Any

import msgpack
import numpy as np
from PIL import Image

from common.engine.params import DEFAULT_MAX_TOKENS, MAX_NEW_TOKENS, MAX_TEMPERATURE, MIN_TEMPERATURE, MIN_TOP_P
from common.engine.spans import capture_ranges
from common.wire.timeref import TimeRef, parse_time_ref

SCHEMA_VERSION = 1
FIELD = "m"  # the one stream field that carries a msgpack payload

# Default limits; services override them through their config (see ``Limits``).
MAX_FRAME_PIXELS = 4096 * 4096
MAX_QUESTION_CHARS = 4000
MIN_CHOICES = 2
MAX_CHOICES = 16
MAX_CHOICE_CHARS = 200
MAX_REPLY_TTL_S = 7 * 24 * 3600
MAX_MANIFEST_SEGMENTS = 1 << 20

INT64_MAX = 2**63 - 1
# No leading dot: a name becomes a directory and file names ('.', '..', hidden files).
STREAM_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
# Question ids end up in key names (svqa:answer:{id}); no braces (hash tags), spaces or colons.
QUESTION_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")
# Segment ids end up in file names of the directory store: no leading dot, no separators.
SEGMENT_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
MAX_FRAME_EPOCH = 2**32 - 1  # a frame's media clock restarts: the frames log keeps them in 32 bits (framelog.py)
EPOCH_RE = re.compile(r"[A-Za-z0-9_-]{0,64}")  # "": a manifest written before epochs


class SchemaError(ValueError):
    """A message failed validation; ``field`` names the offending field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem

    def __reduce__(self) -> tuple[type[SchemaError], tuple[str, str]]:  # raised in a decoder process, re-raised here
        return SchemaError, (self.field, self.problem)


@dataclass(frozen=True)
class Limits:
    """Size limits applied when decoding; build one from a service config to override."""

    max_frame_pixels: int = MAX_FRAME_PIXELS
    max_question_chars: int = MAX_QUESTION_CHARS
    max_choices: int = MAX_CHOICES
    max_choice_chars: int = MAX_CHOICE_CHARS
    max_new_tokens: int = MAX_NEW_TOKENS


DEFAULT_LIMITS = Limits()


# --------------------------------------------------------------------------- field checks


def _int(name: str, v: Any, lo: int | None = None, hi: int | None = INT64_MAX) -> int:
    # bool is an int subclass in Python; on the wire it is a different type.
    if isinstance(v, bool) or not isinstance(v, int):
        raise SchemaError(name, f"expected int, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise SchemaError(name, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise SchemaError(name, f"must be <= {hi}, got {v}")
    return v


def _float(name: str, v: Any, lo: float | None = None, hi: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SchemaError(name, f"expected float, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v):
        raise SchemaError(name, f"must be finite, got {v}")
    if lo is not None and v < lo:
        raise SchemaError(name, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise SchemaError(name, f"must be <= {hi}, got {v}")
    return v


def _opt_float(name: str, v: Any) -> float | None:
    return None if v is None else _float(name, v)


def _str(name: str, v: Any, max_len: int, pattern: re.Pattern[str] | None = None) -> str:
    if not isinstance(v, str):
        raise SchemaError(name, f"expected str, got {type(v).__name__}")
    if len(v) > max_len:
        raise SchemaError(name, f"longer than {max_len} chars ({len(v)})")
    if pattern is not None and not pattern.fullmatch(v):
        raise SchemaError(name, f"invalid value {v[:80]!r} (must match {pattern.pattern})")
    if pattern is None and not _is_utf8(v):  # JSON's "\ud800" decodes to a lone surrogate
        raise SchemaError(name, "not valid Unicode text (lone surrogate)")
    return v


def _is_utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_stream_name(name: str, v: Any) -> str:
    """A camera stream name: 1-64 of [A-Za-z0-9_.-], not starting with '.' (names become paths).

    The one check for every place a name enters: flags, environment, cameras file, questions.
    """
    return _str(name, v, 64, STREAM_NAME_RE)


def _require(m: Mapping[str, Any], name: str) -> Any:
    if name not in m:
        raise SchemaError(name, "missing")
    return m[name]


def _get_field(fields: Mapping[Any, Any], name: str) -> Any:
    """Look up a stream field whether the client decoded responses (str keys) or not (bytes)."""
    if not isinstance(fields, Mapping):
        raise SchemaError(name, f"expected a field mapping, got {type(fields).__name__}")
    v = fields.get(name.encode())
    return fields.get(name) if v is None else v


def _unpack(raw: Any, max_bytes: int) -> dict[str, Any]:
    """Unpack the ``m`` payload and check the schema version."""
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise SchemaError(FIELD, "missing" if raw is None else f"expected bytes, got {type(raw).__name__}")
    if len(raw) > max_bytes:
        raise SchemaError(FIELD, f"payload too large ({len(raw)} > {max_bytes} bytes)")
    try:
        m = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types (ExtraData, FormatError, UnicodeDecodeError...)
        raise SchemaError(FIELD, f"invalid msgpack: {type(e).__name__}") from None
    if not isinstance(m, dict):
        raise SchemaError(FIELD, f"expected a msgpack map, got {type(m).__name__}")
    v = _int("v", _require(m, "v"))
    if v != SCHEMA_VERSION:
        raise SchemaError("v", f"unsupported schema version {v} (expected {SCHEMA_VERSION})")
    return m


def _pack(m: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": SCHEMA_VERSION, **m}, use_bin_type=True)


# --------------------------------------------------------------------------- frames


@dataclass(frozen=True)
class FrameMsg:
    """One RGB frame, already resized to the stream's model grid."""

    seq: int  # per-stream frame counter, from 0
    ts: float  # capture time: unix seconds for live sources, media seconds for files
    pts: float  # media time
    h: int
    w: int
    data: bytes  # h*w*3 bytes, row-major RGB
    fmt: str = "rgb24"
    # files: times the media clock restarted before this frame (concatenated recordings); with pts,
    # where the frame is in its file, which is what a restarted ingest resumes after
    epoch: int = 0

    def __post_init__(self) -> None:
        _int("seq", self.seq, 0)
        _int("epoch", self.epoch, 0, MAX_FRAME_EPOCH)
        _float("ts", self.ts)
        _float("pts", self.pts)
        _int("h", self.h, 1)
        _int("w", self.w, 1)
        if self.fmt != "rgb24":
            raise SchemaError("fmt", f"unsupported format {self.fmt!r} (in memory only 'rgb24')")
        if not isinstance(self.data, bytes):
            raise SchemaError("data", f"expected bytes, got {type(self.data).__name__}")
        if len(self.data) != self.h * self.w * 3:
            raise SchemaError("data", f"size {len(self.data)} != h*w*3 = {self.h * self.w * 3}")

    def rgb(self) -> np.ndarray:
        """(h, w, 3) uint8 view of ``data`` (no copy; read-only because bytes are immutable)."""
        return np.frombuffer(self.data, dtype=np.uint8).reshape(self.h, self.w, 3)

    @classmethod
    def from_rgb(cls, seq: int, ts: float, pts: float, rgb: np.ndarray, epoch: int = 0) -> FrameMsg:
        if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
            raise SchemaError("data", f"expected (h, w, 3) uint8, got {rgb.shape} {rgb.dtype}")
        h, w, _ = rgb.shape
        data = np.ascontiguousarray(rgb).tobytes()
        return cls(seq=seq, ts=float(ts), pts=float(pts), h=h, w=w, data=data, epoch=epoch)


@dataclass(frozen=True)
class EndOfStream:
    """The source ended (file finished or ingest stopped for good); ``seq`` is the last frame's."""

    seq: int  # -1 when no frame was ever sent

    def __post_init__(self) -> None:
        _int("seq", self.seq, -1)


# Frame codecs on the wire (``fmt``): a frame is ~600 KB raw at 448x448, and Redis holds every
# camera's recent frames. WebP lossless (fastest method) is exact; JPEG at quality 95 without
# chroma subsampling is near-lossless and ~5x smaller again. Measured: README "Redis sizing".
FRAME_CODECS = ("webp", "jpeg", "png", "rgb24")
_SAVE_OPTIONS: dict[str, dict[str, Any]] = {
    "webp": {"format": "WEBP", "lossless": True, "method": 0, "quality": 0},
    "jpeg": {"format": "JPEG", "quality": 95, "subsampling": 0},
    "png": {"format": "PNG", "compress_level": 1},
}


def encode_frame(
    msg: FrameMsg | EndOfStream, limits: Limits = DEFAULT_LIMITS, codec: str = "rgb24"
) -> dict[str, bytes]:
    """Stream fields for XADD to ``keys.frames(cam)``; ``codec`` compresses the pixels."""
    if isinstance(msg, EndOfStream):
        return {FIELD: _pack({"eos": True, "seq": msg.seq})}
    _check_pixels(msg.h, msg.w, limits)
    fmt, data = msg.fmt, msg.data
    if codec != "rgb24":
        if codec not in _SAVE_OPTIONS:
            raise SchemaError("fmt", f"unknown codec {codec!r} (one of {', '.join(FRAME_CODECS)})")
        buf = io.BytesIO()
        Image.fromarray(msg.rgb()).save(buf, **_SAVE_OPTIONS[codec])
        if buf.tell() < len(data):  # noise can defeat a lossless codec: then raw is smaller
            fmt, data = codec, buf.getvalue()
    payload = {"seq": msg.seq, "ts": msg.ts, "pts": msg.pts, "h": msg.h, "w": msg.w, "fmt": fmt}
    if msg.epoch:  # only after a clock restart: every other frame stays as it was on the wire
        payload["epoch"] = msg.epoch
    return {FIELD: _pack({**payload, "data": data})}


ImageDecoder = Callable[[str, bytes, int, int], bytes]


def decode_image(fmt: str, data: bytes, h: int, w: int) -> bytes:
    """Compressed pixels -> raw RGB bytes; the header is checked before any pixel is decoded."""
    try:
        with Image.open(io.BytesIO(data), formats=[_SAVE_OPTIONS[fmt]["format"]]) as im:
            if im.size != (w, h):
                raise SchemaError("data", f"{fmt} image is {im.size[0]}x{im.size[1]}, header says {w}x{h}")
            # straight to bytes: through convert() and numpy the pixels were copied twice more
            return (im if im.mode == "RGB" else im.convert("RGB")).tobytes()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise SchemaError("data", f"undecodable {fmt} image: {e}") from None


# What a frames entry may cost: a codec that would make a frame larger sends it raw, so an entry
# of an h x w grid holds at most h*w*3 pixel bytes and a small header. Ingest writes under this
# cap and the encoder refuses a larger entry before unpacking it (README "Redis sizing").
FRAME_ENTRY_HEADER_BYTES = 4096


def frame_entry_cap(h: int, w: int) -> int:
    """The most bytes (field names and values) a frames entry of an h x w grid may hold."""
    return h * w * 3 + FRAME_ENTRY_HEADER_BYTES


def check_frame_entry(fields: Mapping[Any, Any], cap: int) -> None:
    """SchemaError when a frames entry, its fields still packed, holds more than ``cap`` bytes."""
    if not isinstance(fields, Mapping):
        raise SchemaError("fields", f"expected a field mapping, got {type(fields).__name__}")
    size = sum(_nbytes(k) + _nbytes(v) for k, v in fields.items())
    if size > cap:
        raise SchemaError(FIELD, f"entry of {size} bytes exceeds the stream's cap of {cap} bytes")


def _nbytes(v: Any) -> int:
    if isinstance(v, bytes | bytearray | memoryview):
        return len(v)
    return len(str(v).encode("utf-8", "surrogatepass"))


def unpack_frame(fields: Mapping[Any, Any], limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """A frames-stream entry's map, its pixels still encoded (msgpack only); raises SchemaError."""
    return _unpack(_get_field(fields, FIELD), limits.max_frame_pixels * 3 + FRAME_ENTRY_HEADER_BYTES)


def capture_time(m: Mapping[str, Any]) -> float | None:
    """An unpacked entry's capture time, its pixels not decoded; None for an end-of-stream marker
    or an entry without a valid one (frame_from_map then says why)."""
    if m.get("eos", False):
        return None
    try:
        return _float("ts", _require(m, "ts"))
    except SchemaError:
        return None


def frame_header(m: Mapping[str, Any]) -> tuple[int, float, int]:
    """An unpacked frame entry's (seq, ts, epoch), its pixels not decoded; SchemaError naming the field."""
    epoch = _int("epoch", m.get("epoch", 0), 0, MAX_FRAME_EPOCH)
    return _int("seq", _require(m, "seq"), 0), _float("ts", _require(m, "ts")), epoch


def frame_grid(m: Mapping[str, Any]) -> tuple[int, int] | None:
    """An unpacked entry's declared (h, w), its pixels not decoded; None for an end-of-stream
    marker; SchemaError naming the field."""
    if m.get("eos", False):
        return None
    return _int("h", _require(m, "h"), 1), _int("w", _require(m, "w"), 1)


def decode_frame(fields: Mapping[Any, Any], limits: Limits = DEFAULT_LIMITS) -> FrameMsg | EndOfStream:
    """Validate and decode one frames-stream entry; raises SchemaError naming the field."""
    return frame_from_map(unpack_frame(fields, limits), limits)


def frame_from_map(
    m: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS, decode: ImageDecoder = decode_image
) -> FrameMsg | EndOfStream:
    """Validate an unpacked entry and decode its pixels (with `decode`, `decode_image` elsewhere
    than in this thread); raises SchemaError naming the field."""
    eos = m.get("eos", False)
    if not isinstance(eos, bool):
        raise SchemaError("eos", f"expected bool, got {type(eos).__name__}")
    if eos:
        return EndOfStream(seq=_int("seq", _require(m, "seq"), -1))
    h = _int("h", _require(m, "h"), 1)
    w = _int("w", _require(m, "w"), 1)
    _check_pixels(h, w, limits)  # before touching data: the size check below trusts h*w
    fmt = _str("fmt", _require(m, "fmt"), 16)
    data = _require(m, "data")
    if not isinstance(data, bytes):
        raise SchemaError("data", f"expected bytes, got {type(data).__name__}")
    if fmt in _SAVE_OPTIONS:  # compressed on the wire, raw in memory
        data, fmt = decode(fmt, data, h, w), "rgb24"
    return FrameMsg(
        seq=_int("seq", _require(m, "seq"), 0),
        ts=_float("ts", _require(m, "ts")),
        pts=_float("pts", _require(m, "pts")),
        h=h,
        w=w,
        data=data,
        fmt=fmt,
        epoch=_int("epoch", m.get("epoch", 0), 0, MAX_FRAME_EPOCH),
    )


# How far a frame's seq may run ahead of the stream's last one with no capture time between them.
# Ingest numbers frames without gaps; a stream skips seqs only when entries were trimmed unread
# (or dropped as late), and then capture time passed too: the allowed gap grows by 1.5 x fps per
# second. On a live stream that second is counted up to now on Redis's clock (common/clock.py), never past it.
MAX_SEQ_GAP = 64
# Default of the encoder's `max_clock_skew_s`: a live frame stamped further ahead of Redis's clock,
# which ingest stamps frames with (common/clock.py), is forged: an honest stamp can be ahead only by
# how much Redis's clock moved between two measurements of its offset (milliseconds).
MAX_CLOCK_SKEW_S = 2.0


def frame_follow_problem(
    prev_seq: int,
    prev_ts: float | None,
    msg: FrameMsg,
    fps: float,
    live: bool,
    *,
    now: float | None = None,
    max_skew_s: float = MAX_CLOCK_SKEW_S,
) -> str | None:
    """Why ``msg`` cannot be the next frame after (prev_seq, prev_ts) on its stream, or None if it can.

    Guards the stream's history against one forged entry: a frame numbered far ahead accepted as
    the newest would turn every later real frame into a "duplicate". A live frame's gap is bounded
    by the time passed up to ``now`` (callers pass Redis's clock, `common.clock`, which ingest
    stamps with; default: this host's), so a stamp in the future widens
    nothing; a file's capture times are media time, with no clock to hold them to.
    """
    until = msg.ts
    if live:
        now = time.time() if now is None else now
        if msg.ts > now + max_skew_s:
            return f"ts {msg.ts:.3f} is {msg.ts - now:.1f} s ahead of Redis's clock (more than {max_skew_s:g} s)"
        until = min(until, now)
    if prev_seq < 0 or prev_ts is None or msg.seq <= prev_seq:
        return None  # nothing to compare with, or a duplicate (handled by the caller)
    allowed = MAX_SEQ_GAP + math.ceil(1.5 * fps * max(0.0, until - prev_ts))
    if msg.seq - prev_seq > allowed:
        return f"seq {msg.seq} jumps {msg.seq - prev_seq} past {prev_seq} (at most {allowed} for the time passed)"
    return None


def _check_pixels(h: int, w: int, limits: Limits) -> None:
    if h * w > limits.max_frame_pixels:
        raise SchemaError("h", f"h*w = {h}*{w} exceeds the limit of {limits.max_frame_pixels} pixels")


def check_grid(field: str, h: int, w: int, limits: Limits = DEFAULT_LIMITS) -> None:
    """SchemaError for a stored grid (a stream's meta, a manifest's) over the frame limit: no frame
    of it would be taken off the wire, and its chunks would cost tokens no cache holds."""
    if h * w > limits.max_frame_pixels:
        raise SchemaError(field, f"grid {h}x{w} exceeds the frame limit of {limits.max_frame_pixels} pixels")


# --------------------------------------------------------------------------- cache manifest


@dataclass(frozen=True)
class SegmentRecord:
    """One segment of a version: what it is (ids, frames, times) and where it sits now.

    With the segment's original K/V from the segment store this rebuilds its exact cache:
    ``offset`` is its first token, ``patch_now`` its logical temporal-patch index now and
    ``t_delta`` (one value per temporal patch) how far its keys were turned since it was encoded
    at ``first_patch``. The prefix has no patches and no deltas.
    """

    id: str
    tokens: int
    offset: int
    first_patch: int
    patch_now: int
    n_patches: int
    t_delta: tuple[int, ...]
    frame_seqs: tuple[int, int] = (-1, -1)
    capture_range: tuple[float, float] = (0.0, 0.0)
    padded_frames: int = 0
    salience: float = 0.0  # how much the chunk differs from the one before it (salient-chunk eviction)

    def __post_init__(self) -> None:
        _str("id", self.id, 128, SEGMENT_ID_RE)
        _float("salience", self.salience, 0.0)
        for name in ("tokens", "offset", "first_patch", "patch_now", "n_patches", "padded_frames"):
            _int(name, getattr(self, name), 0)
        deltas = _seq("t_delta", self.t_delta)
        if len(deltas) != self.n_patches:
            raise SchemaError("t_delta", f"{len(deltas)} deltas for {self.n_patches} patches")
        object.__setattr__(self, "t_delta", tuple(_int(f"t_delta[{i}]", d, -INT64_MAX) for i, d in enumerate(deltas)))
        object.__setattr__(self, "frame_seqs", _pair("frame_seqs", self.frame_seqs, lambda n, v: _int(n, v, -1)))
        object.__setattr__(self, "capture_range", _pair("capture_range", self.capture_range, _float))

    @classmethod
    def from_wire(cls, i: int, d: Any) -> SegmentRecord:
        if not isinstance(d, dict):
            raise SchemaError(f"segments[{i}]", f"expected a map, got {type(d).__name__}")
        try:
            return cls(**{f.name: d[f.name] for f in dataclass_fields(cls) if f.name in d})
        except SchemaError as e:
            raise SchemaError(f"segments[{i}].{e.field}", e.problem) from None
        except TypeError as e:  # a required field missing
            raise SchemaError(f"segments[{i}]", str(e)) from None

    def to_wire(self) -> dict[str, Any]:
        return {name: list(v) if isinstance(v := getattr(self, name), tuple) else v for name in _SEGMENT_FIELDS}


_SEGMENT_FIELDS = tuple(f.name for f in dataclass_fields(SegmentRecord))


def _seq(name: str, v: Any) -> list[Any] | tuple[Any, ...]:
    if not isinstance(v, list | tuple):
        raise SchemaError(name, f"expected a list, got {type(v).__name__}")
    return v


def _pair(name: str, v: Any, check: Any) -> tuple[Any, Any]:
    items = _seq(name, v)
    if len(items) != 2:
        raise SchemaError(name, f"expected 2 values, got {len(items)}")
    return check(f"{name}[0]", items[0]), check(f"{name}[1]", items[1])


@dataclass(frozen=True)
class Manifest:
    """One published cache version of a stream (``keys.head`` value, ``keys.versions`` entries).

    Self-contained: the stream's fps, grid and chunk size, where the video starts, and one typed
    record per segment (the prefix first), so a QA mirror or a restarted encoder rebuilds the
    exact cache from this and the segment store alone. The summary fields (frames, times,
    tokens, evictions) are what `streamvqa status` and clients read.
    """

    version: int  # strictly increasing within an epoch (below)
    stream: str
    fps: float
    grid: tuple[int, int]  # (height, width) in pixels
    chunk_frames: int
    video_start: int  # position right after <|vision_start|>
    next_patch: int  # next logical temporal patch index (after re-basing)
    segments: tuple[SegmentRecord, ...]
    last_frame_seq: int  # -1 before the first frame
    first_ts: float | None  # capture time of the oldest frame still in the cache; None if none
    last_ts: float | None  # capture time of the newest frame
    cache_tokens: int
    evictions: int = 0  # totals since the stream started
    evicted_segments: int = 0
    evicted_tokens: int = 0
    created_at: float = 0.0  # unix seconds
    # The stream's life: a random id chosen when its cache started empty. Version ids count within
    # one epoch; a new epoch means the stream started over (its Redis came back empty, say).
    epoch: str = ""

    def __post_init__(self) -> None:
        segments = _seq("segments", self.segments)
        if not segments or len(segments) > MAX_MANIFEST_SEGMENTS:
            raise SchemaError("segments", f"expected 1..{MAX_MANIFEST_SEGMENTS} segments, got {len(segments)}")
        records = tuple(
            s if isinstance(s, SegmentRecord) else SegmentRecord.from_wire(i, s) for i, s in enumerate(segments)
        )
        object.__setattr__(self, "segments", records)
        object.__setattr__(self, "grid", _pair("grid", self.grid, lambda n, v: _int(n, v, 1, 1 << 16)))
        check_grid("grid", *self.grid)
        _validate_manifest(self)

    @property
    def segment_ids(self) -> tuple[str, ...]:
        return tuple(s.id for s in self.segments)

    def ranges(self) -> list[tuple[float, float]]:
        """The capture-time ranges this version covers (several once salient chunks are kept)."""
        return capture_ranges((s.frame_seqs, s.capture_range) for s in self.segments if s.n_patches)


def _validate_manifest(m: Manifest) -> None:
    _int("version", m.version, 0)
    check_stream_name("stream", m.stream)
    _float("fps", m.fps, 1e-6)
    _int("chunk_frames", m.chunk_frames, 1)
    _int("video_start", m.video_start, 0)
    _int("next_patch", m.next_patch, 0)
    _int("last_frame_seq", m.last_frame_seq, -1)
    _opt_float("first_ts", m.first_ts)
    _opt_float("last_ts", m.last_ts)
    _int("cache_tokens", m.cache_tokens, 0)
    for name in ("evictions", "evicted_segments", "evicted_tokens"):
        _int(name, getattr(m, name), 0)
    _float("created_at", m.created_at, 0.0)
    _str("epoch", m.epoch, 64, EPOCH_RE)


_MANIFEST_OPTIONAL = {"evictions", "evicted_segments", "evicted_tokens", "created_at", "epoch"}


def manifest_to_bytes(m: Manifest) -> bytes:
    """Payload for the ``head`` string key (SET)."""
    d = {f.name: getattr(m, f.name) for f in dataclass_fields(Manifest)}
    d["grid"] = list(m.grid)
    d["segments"] = [s.to_wire() for s in m.segments]
    return _pack(d)


def manifest_from_bytes(raw: Any) -> Manifest:
    """Decode a ``head`` value (GET); raises SchemaError naming the field."""
    m = _unpack(raw, 1 << 30)
    names = [f.name for f in dataclass_fields(Manifest)]
    for k in names:
        if k not in _MANIFEST_OPTIONAL:
            _require(m, k)
    return Manifest(**{k: m[k] for k in names if k in m})  # absent optional ones take the defaults


def encode_manifest(m: Manifest) -> dict[str, bytes]:
    """Stream fields for XADD to ``keys.versions(cam)``."""
    return {FIELD: manifest_to_bytes(m)}


def decode_manifest(fields: Mapping[Any, Any]) -> Manifest:
    return manifest_from_bytes(_get_field(fields, FIELD))


# --------------------------------------------------------------------------- questions

_QUESTION_FIELDS = {
    "id",
    "stream",
    "question",
    "max_tokens",
    "temperature",
    "top_p",
    "choices",
    "at",
    "reply_ttl",
    "since",
    "until",
    "scope",
    "asked",  # written by the forwarder: the question's entry id in svqa:questions (when it was asked)
}
_INT_RE = re.compile(r"[+-]?[0-9]{1,19}")
_FLOAT_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


@dataclass(frozen=True)
class Question:
    id: str
    stream: str
    question: str
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    choices: tuple[str, ...] | None = None  # multiple choice: answer is one of these
    at: int | None = None  # cache version to answer against; None = the latest (head)
    reply_ttl: int | None = None  # seconds; None = the worker's default
    # a past span, answered from the frames log instead of the live cache (timeref.py); until
    # None = when the question was asked
    since: TimeRef | None = None
    until: TimeRef | None = None
    # "history": answered over the chunks of the camera's past (within since/until, if given) that
    # rank best for the question (search, common/engine/features.py), not the live cache
    scope: str = "live"

    @property
    def about_past(self) -> bool:
        """Answered from the frames log, not the live cache: it waits for a turn at a history cache."""
        return self.since is not None or self.scope == "history"


SCOPES = ("live", "history")


def _text_fields(fields: Mapping[Any, Any], max_bytes: int, known: set[str] = _QUESTION_FIELDS) -> dict[str, str]:
    """Decode a question entry's fields to str, rejecting names not ``known`` and oversized values."""
    if not isinstance(fields, Mapping):
        raise SchemaError("fields", f"expected a field mapping, got {type(fields).__name__}")
    out: dict[str, str] = {}
    for k, v in fields.items():
        name = k.decode("utf-8", "backslashreplace") if isinstance(k, bytes) else str(k)
        if name not in known:
            raise SchemaError(name[:64], "unknown field")
        if isinstance(v, bytes):
            if len(v) > max_bytes:
                raise SchemaError(name, f"value too large ({len(v)} bytes)")
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                raise SchemaError(name, "not valid UTF-8") from None
        if not isinstance(v, str):
            raise SchemaError(name, f"expected str, got {type(v).__name__}")
        out[name] = v
    return out


def _parse_int(name: str, s: str, lo: int, hi: int) -> int:
    if not _INT_RE.fullmatch(s.strip()):
        raise SchemaError(name, f"expected an integer, got {s[:40]!r}")
    return _int(name, int(s), lo, hi)


def _parse_float(name: str, s: str, lo: float, hi: float) -> float:
    if not _FLOAT_RE.fullmatch(s.strip()):  # float() would also take 'nan', 'inf', '1_0'
        raise SchemaError(name, f"expected a number, got {s[:40]!r}")
    return _float(name, float(s), lo, hi)


def _parse_choices(s: str, limits: Limits) -> tuple[str, ...]:
    try:
        v = json.loads(s)
    except (ValueError, RecursionError):  # RecursionError: '[[[[…' nested a thousand deep
        raise SchemaError("choices", "not valid JSON (expected a JSON list of strings)") from None
    if not isinstance(v, list):
        raise SchemaError("choices", f"expected a JSON list, got {type(v).__name__}")
    if not MIN_CHOICES <= len(v) <= limits.max_choices:
        raise SchemaError("choices", f"need {MIN_CHOICES}..{limits.max_choices} choices, got {len(v)}")
    for i, c in enumerate(v):
        _str(f"choices[{i}]", c, limits.max_choice_chars)
        if not c.strip():
            raise SchemaError(f"choices[{i}]", "empty")
    if len(set(v)) != len(v):  # duplicates would make the per-choice scores ambiguous
        raise SchemaError("choices", "duplicate choices")
    return tuple(v)


def _parse_at(s: str) -> int | None:
    if s.strip() == "latest":
        return None
    return _parse_int("at", s, 0, INT64_MAX)


def question_id_of(fields: Mapping[Any, Any], entry_id: str | bytes | None = None) -> str | None:
    """The id to reply to, recovered even from an invalid question; None if there is no safe one.

    With no ``id`` field, the question's stream entry id: where the refusal of a question without
    an id goes (see ``parse_question``), and nothing else.
    """
    try:
        raw = _get_field(fields, "id")
    except SchemaError:
        return None
    if raw is None:
        raw = entry_id
    if isinstance(raw, bytes) and len(raw) <= 128:
        raw = raw.decode("ascii", "replace")
    if isinstance(raw, str) and QUESTION_ID_RE.fullmatch(raw):
        return raw
    return None


def parse_question(fields: Mapping[Any, Any], *, limits: Limits = DEFAULT_LIMITS) -> Question:
    """Validate a ``svqa:questions`` entry.

    ``id`` is required: the answer stream's name is all that keeps other clients from reading the
    answer (the client role reads any ``svqa:answer:*`` it can name), so it must be unguessable,
    and only the asker can choose it before asking. A stream entry id (a millisecond clock) is not.
    """
    f = _text_fields(fields, max_bytes=max(limits.max_question_chars * 4, 64 * 1024))
    if "id" not in f:
        raise SchemaError("id", "missing: send a random one (openssl rand -hex 16): whoever knows it reads the answer")
    qid = _str("id", f["id"], 128, QUESTION_ID_RE)
    stream = check_stream_name("stream", _require(f, "stream"))
    question = _str("question", _require(f, "question"), limits.max_question_chars)
    if not question.strip():
        raise SchemaError("question", "empty")
    kw: dict[str, Any] = {"id": qid, "stream": stream, "question": question}
    if "max_tokens" in f:
        kw["max_tokens"] = _parse_int("max_tokens", f["max_tokens"], 1, limits.max_new_tokens)
    if "temperature" in f:
        kw["temperature"] = _parse_float("temperature", f["temperature"], 0.0, MAX_TEMPERATURE)
        if 0.0 < kw["temperature"] < MIN_TEMPERATURE:
            raise SchemaError("temperature", f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {kw['temperature']:g}")
    if "top_p" in f:
        kw["top_p"] = _parse_float("top_p", f["top_p"], 0.0, 1.0)
        if kw["top_p"] < MIN_TOP_P:
            raise SchemaError("top_p", f"must be >= {MIN_TOP_P:g}, got {kw['top_p']:g}")
    if "choices" in f:
        kw["choices"] = _parse_choices(f["choices"], limits)
    if "at" in f:
        kw["at"] = _parse_at(f["at"])
    if "reply_ttl" in f:
        kw["reply_ttl"] = _parse_int("reply_ttl", f["reply_ttl"], 1, MAX_REPLY_TTL_S)
    for name in ("since", "until"):
        if name in f:
            kw[name] = _parse_time_ref(name, f[name])
    _check_span(kw.get("since"), kw.get("until"), kw.get("at"))
    if "scope" in f:
        kw["scope"] = f["scope"].strip()
        if kw["scope"] not in SCOPES:
            raise SchemaError("scope", f"expected one of {', '.join(SCOPES)}, got {f['scope'][:40]!r}")
        if kw["scope"] == "history" and "at" in kw and kw["at"] is not None:
            raise SchemaError("at", "names a cache version, and scope history the past: not both")
    return Question(**kw)


def _parse_time_ref(name: str, s: str) -> TimeRef:
    try:
        return parse_time_ref(s)
    except ValueError as e:
        raise SchemaError(name, str(e)) from None


def _check_span(since: TimeRef | None, until: TimeRef | None, at: int | None) -> None:
    """What a span's edges contradict without a clock; the rest (since in the future, an until
    before a since of the other form) is the worker's to say, once it knows when it was asked."""
    if since is None:
        if until is not None:
            raise SchemaError("until", "needs since: a span starts at since")
        return
    if at is not None:
        raise SchemaError("at", "names a cache version, and since a past span (from the frames log): not both")
    if until is None:
        return
    if (until.ago_s is not None and since.ago_s is not None and until.ago_s >= since.ago_s) or (
        until.at is not None and since.at is not None and until.at <= since.at
    ):
        raise SchemaError("until", "must be later than since: the span is empty")


def checked_question(stream: str, question: str, **options: Any) -> Question:
    """A new question (a random id unless ``id`` is given) as a worker will read it: what a worker
    would refuse raises SchemaError here, before anything is sent (the CLI and the API ask so)."""
    q = Question(id=options.pop("id", None) or new_question_id(), stream=stream, question=question, **options)
    return parse_question(encode_question(q))


def new_question_id() -> str:
    """An unguessable question id (128 random bits): whoever knows it can read the answer."""
    return secrets.token_urlsafe(16)


def encode_question(q: Question) -> dict[str, str]:
    """Fields for XADD to ``keys.QUESTIONS`` (python clients; redis-cli users write them by hand)."""
    out = {"id": q.id, "stream": q.stream, "question": q.question, "max_tokens": str(q.max_tokens)}
    out |= {"temperature": repr(q.temperature), "top_p": repr(q.top_p)}
    if q.choices is not None:
        out["choices"] = json.dumps(list(q.choices))
    out["at"] = "latest" if q.at is None else str(q.at)
    if q.reply_ttl is not None:
        out["reply_ttl"] = str(q.reply_ttl)
    out |= {name: str(ref) for name, ref in (("since", q.since), ("until", q.until)) if ref is not None}
    if q.scope != "live":
        out["scope"] = q.scope
    return out


# --------------------------------------------------------------------------- answers

DELTA = "delta"
FINAL = "final"


@dataclass(frozen=True)
class AnswerDelta:
    """Text as it is decoded. ``attempt`` counts how often the question was taken up: a worker
    that died mid-answer leaves deltas of attempt n, its successor writes attempt n+1 from the
    start, so a reader drops what it kept of earlier attempts (``qa_worker.client``).

    A question that waits for the GPU gets deltas with empty ``text`` and its ``position`` (1:
    next to start), first and whenever it changes (at most every second), with ``wait_s``, the
    estimated wait, when the worker has measured how fast it answers. Readers that know nothing of
    them see empty text."""

    text: str
    attempt: int = 1
    position: int | None = None
    wait_s: float | None = None


@dataclass(frozen=True)
class FinalAnswer:
    """The last entry of ``svqa:answer:{id}`` (also appended to ``svqa:answers`` for audit).

    Exactly one of ``text`` (may be empty) and ``error`` is set. ``stream`` may be None in an
    error reply to a question whose stream was missing or invalid.
    """

    id: str
    stream: str | None
    text: str | None = None
    error: str | None = None
    choice: str | None = None
    scores: Mapping[str, float] | None = None  # per choice (JSON object on the wire)
    version: int | None = None  # cache version answered against
    epoch: str | None = None  # that version's stream life (Manifest.epoch): ids count within one
    t_start: float | None = None  # capture-time span of that version: oldest to newest frame
    t_end: float | None = None
    ranges: tuple[tuple[float, float], ...] | None = None  # the [start, end] ranges it holds (JSON list)
    cache_tokens: int | None = None
    first_token_s: float | None = None
    total_s: float | None = None
    tokens: int | None = None  # generated tokens
    # from the question's asking (its entry id in `svqa:questions`) to a worker taking it, and to
    # this final entry: first_token_s and total_s count from the taking, compute only
    queue_s: float | None = None
    elapsed_s: float | None = None
    param: str | None = None  # with an error: the question field it is about ("at", "stream"), if one
    hits: tuple[SearchHit, ...] | None = (
        None  # a search's ranked moments, best first (JSON list; common/wire/search_request.py)
    )
    # the entry id in `svqa:questions` of the question this answers: an asker whose own entry id
    # differs reads another question's answer, that reused the id
    asked: str | None = None

    def __post_init__(self) -> None:
        _str("id", self.id, 128, QUESTION_ID_RE)
        if (self.text is None) == (self.error is None):
            raise SchemaError("text", "exactly one of text and error must be set")
        if self.epoch is not None:
            _str("epoch", self.epoch, 64, EPOCH_RE)


@dataclass(frozen=True)
class SearchHit:
    """One moment a search found (qa_worker/moments.py): a camera's run of adjacent matching
    chunks, its capture-time range and frame seqs (the first chunk's first to the last chunk's
    last) and frame count over all its chunks; its score is its best chunk's (the cosine of
    question and chunk, common/engine/features.py), and `best_*` say where that chunk is (the
    thumbnail's frame). A single chunk is a moment of 1: its best is itself.

    On the wire the `chunks` and `best_*` fields may be absent (a worker from before moments):
    a hit is then one chunk."""

    stream: str
    start: float
    end: float
    score: float
    first_seq: int
    last_seq: int
    frames: int
    chunks: int
    best_start: float
    best_end: float
    best_first_seq: int
    best_last_seq: int

    @classmethod
    def chunk(
        cls, stream: str, start: float, end: float, score: float, first_seq: int, last_seq: int, frames: int
    ) -> SearchHit:
        """One chunk, as a moment of its own."""
        return cls(stream, start, end, score, first_seq, last_seq, frames, 1, start, end, first_seq, last_seq)

    @classmethod
    def from_wire(cls, i: int, d: Any) -> SearchHit:
        if not isinstance(d, dict) or not _HIT_FIELDS <= set(d) <= _HIT_FIELDS | _MOMENT_FIELDS:
            raise SchemaError(
                f"hits[{i}]", f"expected an object of {sorted(_HIT_FIELDS)} (and {sorted(_MOMENT_FIELDS)})"
            )
        hit = cls.chunk(
            check_stream_name(f"hits[{i}].stream", d["stream"]),
            *(_float(f"hits[{i}].{k}", d[k]) for k in ("start", "end", "score")),
            *(_int(f"hits[{i}].{k}", d[k], 0) for k in ("first_seq", "last_seq", "frames")),
        )
        moment = {k: _float(f"hits[{i}].{k}", d[k]) for k in ("best_start", "best_end") if k in d}
        moment |= {k: _int(f"hits[{i}].{k}", d[k], 0) for k in ("best_first_seq", "best_last_seq") if k in d}
        if "chunks" in d:
            moment["chunks"] = _int(f"hits[{i}].chunks", d["chunks"], 1)
        return replace(hit, **moment)


_HIT_FIELDS = {"stream", "start", "end", "score", "first_seq", "last_seq", "frames"}
_MOMENT_FIELDS = {"chunks", "best_start", "best_end", "best_first_seq", "best_last_seq"}
_FINAL_INTS = ("version", "cache_tokens", "tokens")
_FINAL_FLOATS = ("t_start", "t_end", "first_token_s", "total_s", "queue_s", "elapsed_s")
_FINAL_STRS = ("stream", "text", "error", "choice", "epoch", "param", "asked")


def encode_delta(text: str, attempt: int = 1) -> dict[str, str]:
    return {"type": DELTA, "text": text, "attempt": str(attempt)}


def encode_queued(position: int, wait_s: float | None, attempt: int = 1) -> dict[str, str]:
    """The delta that tells a question waiting for the GPU its place (AnswerDelta): no text."""
    out = encode_delta("", attempt) | {"position": str(position)}
    return out | ({"wait_s": repr(round(float(wait_s), 1))} if wait_s is not None else {})


def encode_final(a: FinalAnswer) -> dict[str, str]:
    """String fields of the final entry; absent (None) values are left out."""
    out = {"type": FINAL, "id": a.id}
    for k in _FINAL_STRS + _FINAL_INTS:
        v = getattr(a, k)
        if v is not None:
            out[k] = str(v)
    for k in _FINAL_FLOATS:
        v = getattr(a, k)
        if v is not None:
            out[k] = repr(float(v))  # repr round-trips exactly
    if a.hits is not None:
        out["hits"] = json.dumps([vars(h) for h in a.hits], allow_nan=False)
    if a.ranges is not None:
        out["ranges"] = json.dumps([[float(s), float(e)] for s, e in a.ranges], allow_nan=False)
    if a.scores is not None:
        try:  # allow_nan=False: the wire is standard JSON; clamp -inf log-probs before this
            out["scores"] = json.dumps(dict(a.scores), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise SchemaError("scores", f"not JSON-serialisable: {e}") from None
    return out


def decode_final(fields: Mapping[Any, Any]) -> FinalAnswer:
    f = _answer_fields(fields)
    if f.get("type") != FINAL:
        raise SchemaError("type", f"expected {FINAL!r}, got {f.get('type')!r}")
    kw: dict[str, Any] = {"id": _require(f, "id"), "stream": f.get("stream")}
    for k in ("text", "error", "choice", "epoch", "param", "asked"):
        kw[k] = f.get(k)
    for k in _FINAL_INTS:
        if k in f:
            kw[k] = _parse_int(k, f[k], -INT64_MAX, INT64_MAX)
    for k in _FINAL_FLOATS:
        if k in f:
            kw[k] = _parse_float(k, f[k], -math.inf, math.inf)
    if "scores" in f:
        kw["scores"] = _parse_scores(f["scores"])
    if "hits" in f:
        kw["hits"] = _parse_hits(f["hits"])
    if "ranges" in f:
        kw["ranges"] = _parse_ranges(f["ranges"])
    return FinalAnswer(**kw)


def decode_answer(fields: Mapping[Any, Any]) -> AnswerDelta | FinalAnswer:
    """Decode any entry of an answer stream."""
    f = _answer_fields(fields)
    if f.get("type") == DELTA:
        attempt = _parse_int("attempt", f["attempt"], 1, INT64_MAX) if "attempt" in f else 1
        position = _parse_int("position", f["position"], 1, INT64_MAX) if "position" in f else None
        wait_s = _parse_float("wait_s", f["wait_s"], 0.0, math.inf) if "wait_s" in f else None
        return AnswerDelta(text=_require(f, "text"), attempt=attempt, position=position, wait_s=wait_s)
    return decode_final(fields)


def _answer_fields(fields: Mapping[Any, Any]) -> dict[str, str]:
    if not isinstance(fields, Mapping):
        raise SchemaError("fields", f"expected a field mapping, got {type(fields).__name__}")
    out = {}
    for k, v in fields.items():
        name = k.decode("utf-8", "backslashreplace") if isinstance(k, bytes) else str(k)
        try:
            out[name] = v.decode("utf-8") if isinstance(v, bytes) else _str(name, v, 1 << 24)
        except UnicodeDecodeError:
            raise SchemaError(name, "not valid UTF-8") from None
    return out


def _parse_ranges(s: str) -> tuple[tuple[float, float], ...]:
    try:
        v = json.loads(s)
    except ValueError:
        raise SchemaError("ranges", "not valid JSON") from None
    if not isinstance(v, list) or not all(isinstance(r, list) and len(r) == 2 for r in v):
        raise SchemaError("ranges", "expected a JSON list of [start, end] pairs")
    ranges = tuple((_float(f"ranges[{i}][0]", r[0]), _float(f"ranges[{i}][1]", r[1])) for i, r in enumerate(v))
    if any(start > end for start, end in ranges):
        raise SchemaError("ranges", "a range ends before it starts")
    return ranges


def _parse_hits(s: str) -> tuple[SearchHit, ...]:
    try:
        v = json.loads(s)
    except (ValueError, RecursionError):
        raise SchemaError("hits", "not valid JSON") from None
    if not isinstance(v, list):
        raise SchemaError("hits", f"expected a JSON list, got {type(v).__name__}")
    return tuple(SearchHit.from_wire(i, d) for i, d in enumerate(v))


def _parse_scores(s: str) -> dict[str, float]:
    try:
        v = json.loads(s)
    except (ValueError, RecursionError):
        raise SchemaError("scores", "not valid JSON") from None
    if not isinstance(v, dict):
        raise SchemaError("scores", f"expected a JSON object, got {type(v).__name__}")
    return {k: _float(f"scores[{k[:40]!r}]", x) for k, x in v.items()}
