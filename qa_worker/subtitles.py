"""On-screen text / subtitle transcription: pure logic (no Redis, no model).

Pipeline used by the QA worker's subtitle job, per camera stream::

    answer = model(SUBTITLE_PROMPT, snapshot)               # capture-time range [t_start, t_end]
    lines = parse_model_output(answer)
    closed = tracker.observe(t_start, t_end, lines)           # cues that became final
    ...
    closed += tracker.flush()                                 # end of stream
    to_webvtt(cues, origin=stream_start) / to_srt(cues, origin=stream_start)

Decisions (see the docstrings for details):

* The tracker works line by line: every distinct line of on-screen text is its own cue. Lines seen
  together get cues with the same start, which players show stacked.
* Similarity is ``2 * LCS / (len(a) + len(b))`` on :func:`normalise` keys (normalised Indel
  similarity, as ``rapidfuzz.fuzz.ratio``; exact bit-parallel LCS, no dependency); ``>= similarity``
  (default 0.85) means "the same line" (``HELLO W0RLD`` vs ``HELLO WORLD``: 0.91).
* A new cue starts at the end of the previous observation window, clamped into the current window
  (the line was not reported then, so it appeared after it); the very first observation has nothing
  better than its own ``t_start``, or, for a job restarted, the end of the last cue it wrote before.
  A cue ends at the ``t_end`` of the last observation that reported it.
* Recent-history dedupe: a line that fuzzily matches one of the last ``history`` closed cues is NOT
  emitted again, however long the gap (the history is counted in cues, not seconds).
* Writers never emit an invalid file: cue text is cleaned to non-empty lines, ``&``, ``<``, ``>``
  escaped in WebVTT, ``-->`` never appears in cue text, times are rounded to milliseconds and
  ``end > start`` is kept after rounding; cues ending at or before ``origin`` are dropped.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.wire.transcript import Cue, to_srt, to_webvtt  # re-exported: the writers moved to wire
from common.wire.transcript import clean_chars as _clean_chars

__all__ = [
    "SUBTITLE_PROMPT",
    "Cue",
    "SubtitleTracker",
    "is_none_answer",
    "normalise",
    "parse_model_output",
    "similarity",
    "to_srt",
    "to_webvtt",
]

SUBTITLE_PROMPT = (
    "Read all text that is currently visible on screen in the video: subtitles, captions, titles, signs and "
    "any other written words. Transcribe it verbatim, keeping the original spelling, capitalisation, "
    "punctuation and language; do not translate, summarise, describe or explain. Write one line of output "
    "for each line of on-screen text, top to bottom, with nothing else: no numbering, no bullets, no quotes, "
    "no commentary. If there is no readable text on screen, answer exactly NONE."
)

MAX_LINE_CHARS = 500
MAX_LINES = 20
MAX_OBSERVED_LINES = 100  # SubtitleTracker.observe looks at no more lines than this per observation
_MAX_INPUT_CHARS = 100_000  # anything beyond this is garbage for a 20x500 answer; bounds the work

# --------------------------------------------------------------------------------------------
# Parsing the model's answer
# --------------------------------------------------------------------------------------------

_FENCE_RE = re.compile(r"^\s*(?:```|~~~)[\w+-]*\s*$")
_INLINE_FENCE_RE = re.compile(r"^(?:```|~~~)\s*|\s*(?:```|~~~)$")
# bullets / numbering / blockquote / markdown heading at the start of a line
_BULLET_RE = re.compile(r"^(?:(?:[-*+•·▪◦‣–—>]|#{1,6}|\(?\d{1,3}[.)])\s+|[•▪◦‣]+)")
# prefixes such as "Text:", "On-screen text:", "Subtitle 2:", "Line 1 -", "Caption:"
_PREFIX_RE = re.compile(
    r"^(?:the\s+)?(?:(?:visible|on[- ]?screen|displayed|detected|recognized|recognised|extracted)\s+)?"
    r"(?:text|subtitles?|captions?|lines?|transcription|ocr|answer|output)(?:\s*\d{1,3})?\s*[:：]\s*",
    re.IGNORECASE,
)
# a whole line that only introduces the text, e.g. "The text on screen reads:" / "Here is the text:"
_PREAMBLE_RE = re.compile(
    r"^(?:(?:here\s+is|here's|here\s+are)\s+)?(?:the\s+)?(?:(?:visible|on[- ]?screen|displayed)\s+)?"
    r"(?:text|subtitles?|captions?|transcription)(?:\s+(?:visible\s+)?(?:on|in)\s+(?:the\s+)?"
    r"(?:screen|image|frame|video|scene))?(?:\s+(?:reads|says|is|are|shows?))?\s*[:：]$",
    re.IGNORECASE,
)
# "no text" style answers, matched against normalise(line)
_NONE_RE = re.compile(
    r"^(?:none|n/a|(?:i\s+(?:do\s+not|don['’]t|cannot|can['’]t|can\s+not)\s+see\s+any\s+"
    r"(?:(?:visible|readable|legible|on-?\s?screen)\s+)*(?:text|subtitles?|captions?|writing)"
    r"(?:\s+(?:on\s+(?:the\s+)?screen|in\s+(?:the|this)\s+(?:image|frame|video|scene)))?)|"
    r"(?:there\s+(?:is|are)\s+)?no\s+(?:(?:visible|readable|legible|on-?\s?screen|discernible|other)\s+)*"
    r"(?:text|subtitles?|captions?|writing|words?)"
    r"(?:\s+(?:is|are|was|were|can\s+be))?"
    r"(?:\s+(?:visible|present|shown|displayed|detected|found|seen|readable|"
    r"on\s+(?:the\s+)?screen|in\s+(?:the|this)\s+(?:image|frame|video|scene|screen)))*)$"
)
_QUOTE_PAIRS = {'"': '"', "'": "'", "“": "”", "‘": "’", "«": "»", "„": "“", "「": "」", "『": "』", "`": "`"}


def _strip_quotes(s: str) -> str:
    while len(s) >= 2 and _QUOTE_PAIRS.get(s[0]) == s[-1]:
        s = s[1:-1].strip()
    return s


def _strip_markup(s: str) -> str:
    """One line of the answer, without list markers, known prefixes, emphasis and quotes."""
    prev = None
    while s != prev:
        prev = s
        s = s.strip()
        s = _INLINE_FENCE_RE.sub("", s).strip()
        for mark in ("**", "__", "*"):  # markdown emphasis around the whole line
            if len(s) > 2 * len(mark) and s.startswith(mark) and s.endswith(mark):
                s = s[len(mark) : -len(mark)].strip()
                break
        s = _BULLET_RE.sub("", s, count=1)
        s = _PREFIX_RE.sub("", s, count=1)
        s = _strip_quotes(s.strip())
    return s


def _truncate(s: str, limit: int = MAX_LINE_CHARS) -> str:
    if len(s) <= limit:
        return s
    cut = s[:limit]
    space = cut.rfind(" ")
    if space >= limit // 2:
        cut = cut[:space]
    return cut.rstrip()


def is_none_answer(line: str) -> bool:
    """True for NONE / "no text" / "There is no text on screen." style replies."""
    return bool(_NONE_RE.match(normalise(line)))


def parse_model_output(text: str) -> list[str]:
    """Lines of on-screen text from the model's answer to :data:`SUBTITLE_PROMPT`.

    Strips code fences, bullets/numbering, surrounding quotes, "Text:" style prefixes, intro lines
    ("The text reads:") and whitespace (runs collapsed); drops empty lines, lines that are only
    punctuation (``---``) and NONE / "no text" replies (:func:`is_none_answer`); dedupes within the
    answer on :func:`normalise`; keeps the casing and punctuation of kept lines. Robust to garbage:
    control characters are removed, lines are capped at :data:`MAX_LINE_CHARS` characters and the
    result at :data:`MAX_LINES` lines.
    """
    if not isinstance(text, str) or not text:
        return []
    text = _clean_chars(text[:_MAX_INPUT_CHARS])
    out: list[str] = []
    seen: set[str] = set()
    for raw in text.splitlines():
        if _FENCE_RE.match(raw) or _PREAMBLE_RE.match(raw.strip()):
            continue
        line = " ".join(_strip_markup(raw).split())
        line = _truncate(line)
        key = normalise(line)
        if not key or _NONE_RE.match(key) or key in seen:
            continue
        seen.add(key)
        out.append(line)
        if len(out) >= MAX_LINES:
            break
    return out


def normalise(line: str) -> str:
    """Comparison key: NFKC, casefold, whitespace collapsed, punctuation stripped at both ends."""
    s = " ".join(unicodedata.normalize("NFKC", line).casefold().split())
    start, end = 0, len(s)
    while start < end and (s[start].isspace() or unicodedata.category(s[start]).startswith("P")):
        start += 1
    while end > start and (s[end - 1].isspace() or unicodedata.category(s[end - 1]).startswith("P")):
        end -= 1
    return s[start:end]


def _lcs_len(a: str, b: str) -> int:
    """Length of the longest common subsequence: bit-parallel (Allison-Dix / Hyyrö), O(len(a)*len(b)/wordsize)."""
    if len(a) < len(b):
        a, b = b, a
    masks: dict[str, int] = {}
    for i, ch in enumerate(a):
        masks[ch] = masks.get(ch, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for ch in b:
        u = v & masks.get(ch, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - v.bit_count()


def similarity(a: str, b: str) -> float:
    """Similarity in [0, 1] of two strings (pass :func:`normalise` keys): ``2 * LCS / (len(a) + len(b))``.

    The normalised Indel similarity (what ``difflib.SequenceMatcher.ratio`` approximates and
    ``rapidfuzz.fuzz.ratio`` computes), exact and fast even for 500-character lines.
    """
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    return 2 * _lcs_len(a, b) / (len(a) + len(b))


def _at_least(a: str, b: str, threshold: float) -> bool:
    if a == b:
        return True
    total = len(a) + len(b)
    if not a or not b or 2 * min(len(a), len(b)) < threshold * total:  # length bound first
        return False
    return 2 * _lcs_len(a, b) >= threshold * total


# --------------------------------------------------------------------------------------------
# Cues and the tracker
# --------------------------------------------------------------------------------------------


@dataclass
class _Open:
    start: float
    end: float
    text: str
    key: str
    misses: int = 0


class SubtitleTracker:
    """Turns successive observations (capture-time range of the cache version, parsed lines) into cues.

    A line already shown and still on screen extends its cue instead of emitting a new one; a line that
    is a fuzzy duplicate (``similarity(normalise(a), normalise(b)) >= similarity``) of an open cue or of
    one of the last ``history`` closed cues is not emitted again (even after a long gap).

    Timing:

    * start of a new cue = end of the previous observation window clamped into ``[t_start, t_end]``
      (it was not reported then, so it appeared after it; clamping covers gaps between windows and
      cumulative windows); for the first observation (and after a time discontinuity) ``t_start``,
      unless :meth:`resume` gave the end of the cues written before.
    * end = ``t_end`` of the last observation that reported it, at least ``start + min_duration``.
    * a cue closes (becomes final) once it has been missing from ``close_after_misses`` consecutive
      observations (default 1: the first observation without it), or at :meth:`flush`.
    * observations are expected in capture-time order; if ``t_end`` goes backwards by more than
      ``min_duration`` (seek / stream restart) all open cues are closed first.

    The text of a cue is the first spelling seen. ``observe`` returns closed cues sorted by start.
    """

    def __init__(
        self,
        *,
        similarity: float = 0.85,
        history: int = 50,
        min_duration: float = 0.5,
        close_after_misses: int = 1,
    ) -> None:
        if not 0.0 < similarity <= 1.0:
            raise ValueError("similarity must be in (0, 1]")
        if history < 0:
            raise ValueError("history must be >= 0")
        if not min_duration > 0.0:
            raise ValueError("min_duration must be > 0")
        if close_after_misses < 1:
            raise ValueError("close_after_misses must be >= 1")
        self.similarity = similarity
        self.history = history
        self.min_duration = min_duration
        self.close_after_misses = close_after_misses
        self._open: list[_Open] = []
        self._recent: deque[str] = deque(maxlen=history)  # keys of the last `history` closed cues
        self._prev_end: float | None = None

    def resume(self, cues: Sequence[Cue]) -> None:
        """Go on from cues emitted before (by this job before a restart), oldest first: their lines
        are not emitted again, and a new cue starts no earlier than the last of them ended, as if
        that observation had just been made here. Without the end, the first observation after a
        restart started its cues at the cache's oldest chunk, over every cue written before it."""
        for cue in cues:
            self._recent.append(normalise(cue.text))
        if cues:
            self._prev_end = max(cue.end for cue in cues)

    def _make_cue(self, o: _Open) -> Cue:
        return Cue(o.start, max(o.end, o.start + self.min_duration), o.text)

    def _close(self, opened: Iterable[_Open]) -> list[Cue]:
        cues = []
        for o in opened:
            self._recent.append(o.key)
            cues.append(self._make_cue(o))
        cues.sort(key=lambda c: (c.start, c.end))
        return cues

    def observe(self, t_start: float, t_end: float, lines: Sequence[str]) -> list[Cue]:
        """Feed one observation; returns the cues that became final with it (sorted by start).

        ``lines`` are normally :func:`parse_model_output`'s result; at most :data:`MAX_OBSERVED_LINES`
        of them are looked at, each cut to :data:`MAX_LINE_CHARS` characters (bounds the fuzzy matching).
        Raises ValueError for non-finite times or ``t_end < t_start``.
        """
        if not (math.isfinite(t_start) and math.isfinite(t_end)):
            raise ValueError(f"observation times must be finite: {t_start!r}, {t_end!r}")
        if t_end < t_start:
            raise ValueError(f"observation ends before it starts: {t_start!r} > {t_end!r}")
        done: list[Cue] = []
        if self._prev_end is not None and t_end < self._prev_end - self.min_duration:
            done = self.flush()  # time went backwards: discontinuity; the closed cues join the history
            self._prev_end = None
        start = t_start if self._prev_end is None else min(max(self._prev_end, t_start), t_end)

        seen: set[int] = set()  # ids of open cues reported in this observation
        batch: list[str] = []  # keys of lines handled in this observation
        for line in list(lines)[:MAX_OBSERVED_LINES]:
            if not isinstance(line, str):
                continue
            text = _truncate(" ".join(_clean_chars(line).split()))
            key = normalise(text)
            if not key or any(_at_least(key, k, self.similarity) for k in batch):
                continue
            batch.append(key)
            match = self._match_open(key)
            if match is not None:
                match.end = max(match.end, t_end)
                match.misses = 0
                seen.add(id(match))
            elif any(_at_least(key, k, self.similarity) for k in self._recent):
                continue  # recent-history duplicate: never emitted again
            else:
                new = _Open(start=start, end=t_end, text=text, key=key)
                self._open.append(new)
                seen.add(id(new))

        closed: list[_Open] = []
        still: list[_Open] = []
        for o in self._open:
            if id(o) not in seen:
                o.misses += 1
                if o.misses >= self.close_after_misses:
                    closed.append(o)
                    continue
            still.append(o)
        self._open = still
        self._prev_end = t_end if self._prev_end is None else max(self._prev_end, t_end)
        return sorted(done + self._close(closed), key=lambda c: (c.start, c.end))

    def _match_open(self, key: str) -> _Open | None:
        best, best_score = None, 0.0
        for o in self._open:
            if o.key == key:
                return o
            if _at_least(key, o.key, self.similarity):
                score = similarity(key, o.key)
                if score > best_score:
                    best, best_score = o, score
        return best

    def flush(self) -> list[Cue]:
        """Close all open cues (end of stream); returns them sorted by start. The tracker stays usable."""
        opened, self._open = self._open, []
        return self._close(opened)


# --------------------------------------------------------------------------------------------
# Strict readers / validators
# --------------------------------------------------------------------------------------------
