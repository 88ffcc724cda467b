"""Strict WebVTT and SRT readers: the tests' independent check that what qa_worker/subtitles.py
writes is valid and round-trips (nothing in the service reads subtitle files back)."""

from __future__ import annotations

import html
import re

from qa_worker.subtitles import Cue

_VTT_TS = r"(?:(\d{2,}):)?([0-5]\d):([0-5]\d)\.(\d{3})"
_VTT_TIMING_RE = re.compile(rf"^{_VTT_TS}[ \t]+-->[ \t]+{_VTT_TS}(?:[ \t]+(.*))?$")
_VTT_SETTING_RE = re.compile(r"^(?:vertical|line|position|size|align|region):\S+$")
_VTT_TAG_RE = re.compile(r"</?(?:c|i|b|u|v|lang|ruby|rt)(?:[.\s][^<>]*)?>|<(?:\d{2,}:)?[0-5]\d:[0-5]\d\.\d{3}>")
_VTT_ENTITY_RE = re.compile(r"&(?:amp|lt|gt|nbsp|lrm|rlm|quot|apos|#\d{1,7}|#[xX][0-9a-fA-F]{1,6});")
_SRT_TS = r"(\d{2,}):([0-5]\d):([0-5]\d),(\d{3})"
_SRT_TIMING_RE = re.compile(rf"^{_SRT_TS} --> {_SRT_TS}$")


def _ts_seconds(h: str | None, m: str, s: str, ms: str) -> float:
    return int(h or 0) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000


def _blocks(text: str, what: str) -> list[list[str]]:
    blocks: list[list[str]] = []
    cur: list[str] = []
    for line in text.split("\n"):
        if line and not line.strip():
            raise ValueError(f"{what}: whitespace-only line (ambiguous block separator)")
        if line == "":
            if cur:
                blocks.append(cur)
                cur = []
        else:
            cur.append(line)
    if cur:
        blocks.append(cur)
    return blocks


def _prep_text(text: str, what: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{what}: not text")
    if text.startswith("\ufeff"):
        text = text[1:]
    if "\x00" in text:
        raise ValueError(f"{what}: NUL character")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _check_order(cues: list[Cue], start: float, end: float, where: str) -> None:
    if not start < end:
        raise ValueError(f"{where}: cue end is not after start")
    if cues and start < cues[-1].start:
        raise ValueError(f"{where}: cue starts before the previous cue")


def parse_webvtt(text: str) -> list[Cue]:
    """Parse a WebVTT file strictly (stricter than the spec) and return its cues (entities decoded).

    Checks: ``WEBVTT`` header line, blocks separated by blank lines, NOTE blocks anywhere and
    STYLE/REGION blocks before the first cue, optional cue identifier without ``-->``, timestamp syntax
    (``[HH+:]MM:SS.mmm``, minutes/seconds < 60), known cue settings, start < end, non-decreasing starts,
    non-empty text without ``-->``, every ``<`` part of a known tag and every ``&`` a character reference.
    Raises ValueError.
    """
    text = _prep_text(text, "WebVTT")
    first, _, rest = text.partition("\n")
    if not (first == "WEBVTT" or (first.startswith("WEBVTT") and first[6] in " \t")):
        raise ValueError("WebVTT: missing 'WEBVTT' header line")
    if "-->" in first:
        raise ValueError("WebVTT: '-->' in the header line")
    blocks = _blocks(rest, "WebVTT")
    if rest and not rest.startswith("\n") and blocks:
        # lines directly after the signature are header lines; they must not hold a cue timing
        header = blocks.pop(0)
        if any("-->" in line for line in header):
            raise ValueError("WebVTT: cue timing in the header block (missing blank line after WEBVTT)")
    cues: list[Cue] = []
    for n, block in enumerate(blocks, 1):
        where = f"WebVTT block {n}"
        head = block[0]
        if head == "NOTE" or head.startswith(("NOTE ", "NOTE\t")):
            if any("-->" in line for line in block):
                raise ValueError(f"{where}: '-->' in a NOTE block")
            continue
        if head in ("STYLE", "REGION") and "-->" not in "".join(block):
            if cues:
                raise ValueError(f"{where}: {head} block after the first cue")
            continue
        if "-->" not in head:
            block = block[1:]  # cue identifier
            if not block:
                raise ValueError(f"{where}: identifier without a cue timing line")
        m = _VTT_TIMING_RE.match(block[0])
        if not m:
            raise ValueError(f"{where}: bad cue timing line {block[0]!r}")
        g = m.groups()
        start, end = _ts_seconds(*g[0:4]), _ts_seconds(*g[4:8])
        for setting in (g[8] or "").split():
            if not _VTT_SETTING_RE.match(setting):
                raise ValueError(f"{where}: bad cue setting {setting!r}")
        _check_order(cues, start, end, where)
        body = block[1:]
        if not body:
            raise ValueError(f"{where}: empty cue text")
        for line in body:
            if "-->" in line:
                raise ValueError(f"{where}: '-->' in cue text")
            stripped = _VTT_TAG_RE.sub("", line)
            if "<" in stripped:
                raise ValueError(f"{where}: unescaped '<' in cue text")
            if "&" in _VTT_ENTITY_RE.sub("", stripped):
                raise ValueError(f"{where}: unescaped '&' in cue text")
        cues.append(Cue(start, end, html.unescape("\n".join(body))))
    return cues


def parse_srt(text: str) -> list[Cue]:
    """Parse a SubRip file strictly and return its cues.

    Checks: blocks separated by blank lines; each block = index (1, 2, 3, ... in order), timing line
    ``HH:MM:SS,mmm --> HH:MM:SS,mmm``, at least one text line without ``-->``; start < end,
    non-decreasing starts. An empty file is valid (no cues). Raises ValueError.
    """
    text = _prep_text(text, "SRT")
    cues: list[Cue] = []
    for n, block in enumerate(_blocks(text, "SRT"), 1):
        where = f"SRT block {n}"
        if block[0].strip() != str(n):
            raise ValueError(f"{where}: expected index {n}, got {block[0]!r}")
        if len(block) < 2:
            raise ValueError(f"{where}: missing timing line")
        m = _SRT_TIMING_RE.match(block[1].strip())
        if not m:
            raise ValueError(f"{where}: bad timing line {block[1]!r}")
        g = m.groups()
        start, end = _ts_seconds(*g[0:4]), _ts_seconds(*g[4:8])
        _check_order(cues, start, end, where)
        body = block[2:]
        if not body:
            raise ValueError(f"{where}: empty cue text")
        if any("-->" in line for line in body):
            raise ValueError(f"{where}: '-->' in cue text")
        cues.append(Cue(start, end, "\n".join(body)))
    return cues


def validate_webvtt(text: str) -> None:
    """Raise ValueError unless ``text`` is a WebVTT file that :func:`parse_webvtt` accepts."""
    parse_webvtt(text)


def validate_srt(text: str) -> None:
    """Raise ValueError unless ``text`` is a SubRip file that :func:`parse_srt` accepts."""
    parse_srt(text)
