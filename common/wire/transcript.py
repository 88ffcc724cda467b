"""A stream's transcript (`svqa:{cam}:transcript`) as subtitle files: cues -> WebVTT and SRT.

Written by the qa worker's subtitle job (`qa_worker.subtitles` decides the cues), read by clients and
the HTTP API. Writers never emit an invalid file: cue text is cleaned to non-empty lines, ``&``,
``<``, ``>`` escaped in WebVTT, ``-->`` never appears in cue text, times are rounded to milliseconds
and ``end > start`` is kept after rounding; cues ending at or before ``origin`` are dropped.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


def clean_chars(s: str) -> str:
    """Drop control characters (line breaks kept), lone surrogates and non-characters; tabs become spaces."""
    out = []
    for ch in s:
        cat = unicodedata.category(ch)
        if ch == "\t":
            out.append(" ")
        elif ch in "\n\r\x0b\x0c\x1c\x1d\x1e\x85":  # what str.splitlines() splits on
            out.append("\n")
        elif cat in ("Cc", "Cs") or ch in "\ufffe\uffff\ufeff\ufffd":
            continue
        else:
            out.append(ch)
    return "".join(out)


@dataclass(frozen=True)
class Cue:
    """One subtitle cue. Times are capture times in seconds (media time for files, unix time for live);
    writers format them relative to an ``origin``."""

    start: float
    end: float
    text: str

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start) and math.isfinite(self.end)):
            raise ValueError(f"cue times must be finite: {self.start!r}, {self.end!r}")
        if self.end <= self.start:
            raise ValueError(f"cue end {self.end!r} must be after start {self.start!r}")


def cues_of(entries: Iterable[Mapping[str, str]]) -> list[Cue]:
    """The cues of a transcript's entries (their fields as text). An entry that is no cue (a field
    missing, a time that is no number, an end not after its start) is left out: only QA workers
    write the stream, but one bad entry must not take the whole transcript down with it."""
    cues = []
    for entry in entries:
        try:
            cues.append(Cue(float(entry["start"]), float(entry["end"]), str(entry["text"])))
        except (KeyError, ValueError, TypeError):
            continue
    return cues


def by_start(entries: Iterable[Mapping[str, str]]) -> list[Mapping[str, str]]:
    """Transcript entries in the order of their cues' starts, as the subtitle files are: the stream
    holds them in the order they were written, which closing cues of different lengths does not
    keep. An entry with no usable start comes last; equal starts keep the stream's order."""

    def start(entry: Mapping[str, str]) -> float:
        try:
            value = float(entry["start"])
        except (KeyError, ValueError, TypeError):
            return math.inf
        return value if math.isfinite(value) else math.inf

    return sorted(entries, key=start)


def entry_json(entry: Mapping[str, str]) -> dict:
    """A transcript entry (its fields as Redis keeps them: text) as JSON values: `start` and `end`
    numbers (capture seconds), `version` the cache version whose answer closed the cue, an int, or
    None for a cue closed with no new version (the stream went quiet, or the worker stopped; such
    an entry holds no `version`, or "-1" as written before). A value that is no number is None."""
    out: dict = dict(entry)
    for name in ("start", "end"):
        out[name] = _number(entry.get(name))
    out["version"] = _version(entry.get("version"))
    return out


def output_json(entry: Mapping[str, str]) -> dict:
    """A caption/custom job's output entry (`svqa:{cam}:job:{name}`, its fields as Redis keeps them:
    text) as JSON values, as `entry_json` gives a cue: `version` the cache version answered, an int,
    `t_start` and `t_end` numbers (the capture seconds it covers); None where one is absent or no
    number (an entry an older or other writer left)."""
    out: dict = dict(entry)
    for name in ("t_start", "t_end"):
        out[name] = _number(entry.get(name))
    out["version"] = _version(entry.get("version"))
    return out


def _version(value: str | None) -> int | None:
    number = _number(value)
    return int(number) if number is not None and number >= 0 else None


def _number(value: str | None) -> float | None:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _cue_lines(text: str) -> list[str]:
    lines = []
    for raw in clean_chars(str(text)).splitlines():
        line = " ".join(raw.split())
        if line:
            lines.append(line)
    return lines


def _ms_range(cue: Cue, origin: float) -> tuple[int, int] | None:
    start = max(0, round((cue.start - origin) * 1000))
    end = round((cue.end - origin) * 1000)
    if end <= 0:
        return None
    return start, max(end, start + 1)


def _fmt(ms: int, sep: str) -> str:
    h, rem = divmod(ms, 3_600_000)
    m, rem = divmod(rem, 60_000)
    s, ms = divmod(rem, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def _prepared(cues: Sequence[Cue], origin: float) -> list[tuple[int, int, list[str]]]:
    if not math.isfinite(origin):
        raise ValueError(f"origin must be finite: {origin!r}")
    out = []
    for cue in cues:
        rng = _ms_range(cue, origin)
        lines = _cue_lines(cue.text)
        if rng is None or not lines:
            continue
        out.append((rng[0], rng[1], lines))
    out.sort(key=lambda x: (x[0], x[1]))  # stable: equal times keep input order
    return out


def _vtt_escape(line: str) -> str:
    return line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_webvtt(cues: Sequence[Cue], origin: float = 0.0) -> str:
    """A WebVTT file: ``WEBVTT`` header, cues sorted by start, times relative to ``origin`` (``HH:MM:SS.mmm``,
    hours may exceed 99). ``&``, ``<``, ``>`` are escaped, so ``-->`` never appears in cue text."""
    parts = ["WEBVTT\n\n"]
    for start, end, lines in _prepared(cues, origin):
        body = "\n".join(_vtt_escape(line) for line in lines)
        parts.append(f"{_fmt(start, '.')} --> {_fmt(end, '.')}\n{body}\n\n")
    return "".join(parts)


def to_srt(cues: Sequence[Cue], origin: float = 0.0) -> str:
    """A SubRip file: 1-based index, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``, text, blank line between cues.

    SRT has no escaping: text is written as is (``-->`` becomes ``→``); players may interpret
    ``<i>``-like tags. Empty string for no cues."""
    parts = []
    for i, (start, end, lines) in enumerate(_prepared(cues, origin), 1):
        body = "\n".join(line.replace("-->", "\u2192") for line in lines)
        parts.append(f"{i}\n{_fmt(start, ',')} --> {_fmt(end, ',')}\n{body}\n\n")
    return "".join(parts)


def render_transcript(cues: Sequence[Cue], fmt: str) -> str:
    """A stream's transcript as WebVTT (``vtt``) or SRT (``srt``). Live streams carry unix times:
    those are shown relative to the first cue, file streams keep their media times."""
    cues = sorted(cues, key=lambda c: c.start)
    origin = cues[0].start if cues and cues[0].start > 1e8 else 0.0
    return to_srt(cues, origin) if fmt == "srt" else to_webvtt(cues, origin)
