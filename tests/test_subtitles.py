"""qa_worker.subtitles: model-answer parsing, cue tracking, WebVTT/SRT writers and strict validators.

The writers are checked by our own strict validators AND by ffmpeg's parsers, as independent oracles:
the ffmpeg CLI (vtt -> srt, srt -> webvtt; skipped only when the binary is missing) and libavformat
through PyAV (a project dependency: demux + decode, always run).
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from qa_worker.subtitles import (
    MAX_LINE_CHARS,
    MAX_LINES,
    MAX_OBSERVED_LINES,
    SUBTITLE_PROMPT,
    Cue,
    SubtitleTracker,
    is_none_answer,
    normalise,
    parse_model_output,
    similarity,
    to_srt,
    to_webvtt,
)
from tests.subtitle_readers import parse_srt, parse_webvtt, validate_srt, validate_webvtt

FFMPEG = shutil.which("ffmpeg")

# --------------------------------------------------------------------------------------------
# parse_model_output / normalise
# --------------------------------------------------------------------------------------------


def test_prompt_asks_for_verbatim_lines_and_none():
    assert "exactly NONE" in SUBTITLE_PROMPT
    assert "verbatim" in SUBTITLE_PROMPT and "one line" in SUBTITLE_PROMPT


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("HELLO WORLD", ["HELLO WORLD"]),
        ("  HELLO   WORLD  \n", ["HELLO WORLD"]),
        ("```\nBREAKING NEWS\nMarkets fall 3%\n```", ["BREAKING NEWS", "Markets fall 3%"]),
        ("```text\nLine A\n```", ["Line A"]),
        ("```Inline fence```", ["Inline fence"]),
        ("- first\n* second\n• third\n+ fourth", ["first", "second", "third", "fourth"]),
        ("1. one\n2) two\n(3) three", ["one", "two", "three"]),
        ("\"Quoted line\"\n'single'\n“curly”\n«guillemets»", ["Quoted line", "single", "curly", "guillemets"]),
        ('Text: "EXIT"', ["EXIT"]),
        ("On-screen text: Welcome home\nSubtitle 2: See you", ["Welcome home", "See you"]),
        ("The text on the screen reads:\nOPEN 24 HOURS", ["OPEN 24 HOURS"]),
        ("Here is the text:\n**SALE**\n* 50% OFF *", ["SALE", "50% OFF"]),
        ("NONE", []),
        ("none.", []),
        ("`NONE`", []),
        ("There is no text on screen.", []),
        ("There is no visible text in the image.", []),
        ("No text is visible.", []),
        ("I don't see any text.", []),
        ("N/A", []),
        ("STOP\nNONE", ["STOP"]),
        ("Dup line\nDup line\ndup line.\n  DUP   LINE ", ["Dup line"]),
        ("", []),
        ("\n\n   \n", []),
        ("---\n***\n...", []),
        # kept: ordinary subtitles that merely look like refusals, casing/punctuation preserved
        ("No.\nNothing.", ["No.", "Nothing."]),
        ("No text messages, please!", ["No text messages, please!"]),
        ("Where's the café, Zoë?", ["Where's the café, Zoë?"]),
        ("CAFÉ\r\nBAR\x00\x07!", ["CAFÉ", "BAR!"]),
    ],
)
def test_parse_model_output(answer, expected):
    assert parse_model_output(answer) == expected


def test_parse_model_output_non_string():
    assert parse_model_output(None) == []  # type: ignore[arg-type]
    assert parse_model_output(b"NONE") == []  # type: ignore[arg-type]


def _assert_sane(lines: list[str]) -> None:
    assert isinstance(lines, list) and len(lines) <= MAX_LINES
    for line in lines:
        assert isinstance(line, str) and line == line.strip() and line
        assert len(line) <= MAX_LINE_CHARS
        assert "\n" not in line and "\r" not in line
        line.encode("utf-8")  # no lone surrogates
        assert normalise(line)
    assert len({normalise(x) for x in lines}) == len(lines)


def test_parse_model_output_garbage():
    rng = random.Random(1234)
    # 10k random code points over the whole range (surrogates, controls, combining marks, ...)
    junk = "".join(chr(rng.randrange(0x110000)) for _ in range(10_000))
    _assert_sane(parse_model_output(junk))
    # 10k random printable ASCII + newlines: many lines, capped at MAX_LINES
    ascii_junk = "".join(rng.choice("abcdefghij KLMNOP0123!?.,-*\"'\n") for _ in range(10_000))
    lines = parse_model_output(ascii_junk)
    _assert_sane(lines)
    assert len(lines) == MAX_LINES
    # one huge line, and a huge answer
    assert [len(x) for x in parse_model_output("A" * 100_000)] == [MAX_LINE_CHARS]
    long_words = " ".join(["word"] * 1000)
    (line,) = parse_model_output(long_words)
    assert len(line) <= MAX_LINE_CHARS and line.endswith("word")  # cut at a word boundary
    _assert_sane(parse_model_output("\n".join(f"line {i}" for i in range(1000))))
    bytes_junk = bytes(rng.randrange(256) for _ in range(10_000)).decode("utf-8", "surrogateescape")
    _assert_sane(parse_model_output(bytes_junk))


def test_normalise():
    assert normalise("  Hello,   WORLD!! ") == "hello, world"
    assert normalise("«Straße»") == "strasse"  # casefold
    assert normalise("ＦＵＬＬ　ｗｉｄｔｈ") == "full width"  # NFKC
    assert normalise("...") == ""
    assert normalise("'quoted'") == "quoted"
    assert is_none_answer("NONE") and is_none_answer("There are no subtitles.")
    assert not is_none_answer("None of your business")


def _lcs_dp(a: str, b: str) -> int:
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def test_similarity_is_exact_indel_ratio():
    rng = random.Random(7)
    for _ in range(300):
        a = "".join(rng.choice("abc ") for _ in range(rng.randrange(0, 90)))
        b = "".join(rng.choice("abc ") for _ in range(rng.randrange(0, 90)))
        want = 1.0 if a == b else (2 * _lcs_dp(a, b) / (len(a) + len(b)) if a and b else 0.0)
        assert similarity(a, b) == pytest.approx(want)
    assert similarity(normalise("HELLO W0RLD"), normalise("HELLO WORLD")) >= 0.85
    assert similarity(normalise("BLUE B0X"), normalise("BLUE BOX")) >= 0.85
    assert similarity(normalise("RED BALL"), normalise("BLUE BOX")) < 0.85


# --------------------------------------------------------------------------------------------
# SubtitleTracker
# --------------------------------------------------------------------------------------------


def _screen(t: float) -> str:
    """The scripted model answer for the frames around time t: RED BALL 0-3 s, BLUE BOX 3-6 s, then nothing."""
    if t <= 3.0:
        return "RED BALL" if int(t * 2) % 3 else '```\n- "RED BALL"\nRED BALL\n```'
    if t <= 6.0:
        return ["BLUE BOX", "BLUE B0X", "Text: blue box.", "BLUE BOX\nBLUE BOX"][int(t * 2) % 4]
    return "There is no text on screen."


def test_tracker_two_cues_sliding_windows():
    tr = SubtitleTracker()
    closed: list[tuple[float, list[Cue]]] = []
    for k in range(16):  # windows [0, 0.5], [0.5, 1.0], ..., [7.5, 8.0]
        t0, t1 = k * 0.5, (k + 1) * 0.5
        got = tr.observe(t0, t1, parse_model_output(_screen(t1)))
        if got:
            closed.append((t1, got))
    closed.append((float("inf"), tr.flush()))
    assert closed == [
        (3.5, [Cue(0.0, 3.0, "RED BALL")]),  # final at the first observation without it
        (6.5, [Cue(3.0, 6.0, "BLUE BOX")]),
        (float("inf"), []),
    ]


def test_tracker_cumulative_windows_start_after_previous_window():
    """When every window starts at 0 (whole cache), a new line starts at the previous window's end."""
    tr = SubtitleTracker()
    cues: list[Cue] = []
    for k in range(1, 15):
        cues += tr.observe(0.0, k * 0.5, parse_model_output(_screen(k * 0.5)))
    cues += tr.flush()
    assert cues == [Cue(0.0, 3.0, "RED BALL"), Cue(3.0, 6.0, "BLUE BOX")]


def test_tracker_gap_between_windows_uses_window_start():
    tr = SubtitleTracker()
    assert tr.observe(0.0, 1.0, ["A sign"]) == []
    assert tr.observe(5.0, 6.0, ["Another sign"]) == [Cue(0.0, 1.0, "A sign")]
    assert tr.flush() == [Cue(5.0, 6.0, "Another sign")]  # not 1.0: the line is in the window


def test_tracker_history_dedupe_after_long_gap():
    """Decision: a line that reappears after its cue was closed is NOT emitted again while a fuzzy
    duplicate is among the last `history` closed cues, however long the gap."""
    tr = SubtitleTracker(history=2)
    out = tr.observe(0, 1, ["RED BALL"]) + tr.observe(1, 2, []) + tr.observe(100, 101, ["RED BAL1"])
    assert out == [Cue(0, 1, "RED BALL")]
    assert tr.flush() == []
    # two other cues push RED BALL out of a 2-cue history: then it is new again
    for i, text in enumerate(["GREEN", "YELLOW"]):
        out += tr.observe(200 + 2 * i, 201 + 2 * i, [text]) + tr.observe(201 + 2 * i, 202 + 2 * i, [])
    out += tr.observe(300, 301, ["RED BALL"]) + tr.flush()
    assert [c.text for c in out] == ["RED BALL", "GREEN", "YELLOW", "RED BALL"]
    assert out[-1] == Cue(300, 301, "RED BALL")

    tr0 = SubtitleTracker(history=0)  # no history: every reappearance is a new cue
    got = tr0.observe(0, 1, ["X Y"]) + tr0.observe(1, 2, []) + tr0.observe(2, 3, ["X Y"]) + tr0.flush()
    assert got == [Cue(0, 1, "X Y"), Cue(2, 3, "X Y")]


def test_tracker_multiple_lines_and_partial_change():
    tr = SubtitleTracker()
    out = tr.observe(0, 1, ["Top line", "Bottom line"])
    out += tr.observe(1, 2, ["Top line", "Bottom line"])
    out += tr.observe(2, 3, ["Top line", "Something else entirely"])
    assert out == [Cue(0, 2, "Bottom line")]
    assert tr.flush() == [Cue(0, 3, "Top line"), Cue(2, 3, "Something else entirely")]


def test_tracker_close_after_misses_tolerates_a_flaky_answer():
    tr = SubtitleTracker(close_after_misses=2)
    out = tr.observe(0, 1, ["HELLO"]) + tr.observe(1, 2, []) + tr.observe(2, 3, ["HELLO"])
    assert out == []
    out += tr.observe(3, 4, []) + tr.observe(4, 5, [])
    assert out == [Cue(0, 3, "HELLO")]


def test_tracker_min_duration_and_validation():
    tr = SubtitleTracker(min_duration=0.5)
    assert tr.observe(5.0, 5.0, ["flash"]) == []
    (cue,) = tr.flush()
    assert cue == Cue(5.0, 5.5, "flash") and cue.end > cue.start
    with pytest.raises(ValueError):
        tr.observe(2.0, 1.0, ["x"])
    with pytest.raises(ValueError):
        tr.observe(float("nan"), 1.0, ["x"])
    with pytest.raises(ValueError):
        SubtitleTracker(similarity=0.0)
    with pytest.raises(ValueError):
        Cue(1.0, 1.0, "zero length")


def test_tracker_time_going_backwards_closes_open_cues():
    tr = SubtitleTracker()
    assert tr.observe(100, 101, ["before seek"]) == []
    assert tr.observe(10, 11, ["before seek", "after seek"]) == [Cue(100, 101, "before seek")]
    # "before seek" is now a recent-history duplicate: only "after seek" is open
    assert tr.flush() == [Cue(10, 11, "after seek")]


def test_tracker_ignores_junk_lines_and_is_fast_on_garbage():
    tr = SubtitleTracker()
    assert tr.observe(0, 1, ["", "   ", "...", None]) == []  # type: ignore[list-item]
    rng = random.Random(3)
    t = time.perf_counter()
    for i in range(5):
        answer = "\n".join("".join(rng.choice("abcdefgh ") for _ in range(600)) for _ in range(25))
        tr.observe(i, i + 1, parse_model_output(answer))
    # ~1 s here; a plain dynamic-programming LCS over these 500-character lines would take minutes.
    # The bound sits between the two, far enough above the first for a loaded machine.
    assert time.perf_counter() - t < 30.0
    cues = tr.flush()
    assert all(c.end > c.start for c in cues)
    # a caller bypassing parse_model_output: bounded work, lines cleaned
    many = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(30)) for _ in range(1000)]
    tr.observe(10, 11, [f" {many[0]}\x00 ", *many[1:]])
    still_open = tr.flush()
    assert len(still_open) == MAX_OBSERVED_LINES
    assert still_open[0].text == many[0]


# --------------------------------------------------------------------------------------------
# Writers + validators + ffmpeg as an independent oracle
# --------------------------------------------------------------------------------------------

ORIGIN = 1_700_000_000.0  # live streams: unix capture times, written relative to the stream start

SPECIAL_CUES = [
    Cue(ORIGIN + 0.0, ORIGIN + 1.5, "Tom & Jerry"),
    Cue(ORIGIN + 1.0, ORIGIN + 3.25, "a <b>not bold</b> & 1 < 2 > 0"),
    Cue(ORIGIN + 3.25, ORIGIN + 5.0, "next --> arrow and ---> more"),
    Cue(ORIGIN + 5.0, ORIGIN + 6.0, "Über straße 你好 🙂 ½"),
    Cue(ORIGIN + 5.0, ORIGIN + 6.0, "second line, same time"),
    Cue(ORIGIN + 6.0004, ORIGIN + 6.0006, "rounds to zero length"),
    Cue(ORIGIN + 3723.456, ORIGIN + 3725.0, "after an hour: NOTE WEBVTT 1"),
    Cue(ORIGIN + 2.0, ORIGIN + 2.5, "out of order input"),
]


def _timings(text: str) -> list[tuple[int, int]]:
    """Cue times (ms) of a WebVTT or SRT file, read leniently (for ffmpeg's output)."""
    ts = r"(?:(\d+):)?(\d\d):(\d\d)[.,](\d{3})"
    out = []
    for m in re.finditer(rf"^{ts} --> {ts}", text, re.MULTILINE):
        g = [int(x or 0) for x in m.groups()]
        out.append(
            (
                ((g[0] * 60 + g[1]) * 60 + g[2]) * 1000 + g[3],
                ((g[4] * 60 + g[5]) * 60 + g[6]) * 1000 + g[7],
            )
        )
    return out


def _ms(cues: list[Cue]) -> list[tuple[int, int]]:
    return [(round(c.start * 1000), round(c.end * 1000)) for c in cues]


def test_to_webvtt_format_and_roundtrip():
    vtt = to_webvtt(SPECIAL_CUES, origin=ORIGIN)
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nTom &amp; Jerry\n\n")
    assert "01:02:03.456 --> 01:02:05.000\n" in vtt
    assert "00:00:06.000 --> 00:00:06.001\nrounds to zero length" in vtt
    assert vtt.endswith("\n\n")
    body = vtt.split("\n\n", 1)[1]
    assert "<" not in body and ">" not in body.replace(" --> ", "")
    validate_webvtt(vtt)
    cues = parse_webvtt(vtt)
    assert [c.text for c in cues] == [
        "Tom & Jerry",
        "a <b>not bold</b> & 1 < 2 > 0",
        "out of order input",
        "next --> arrow and ---> more",
        "Über straße 你好 🙂 ½",
        "second line, same time",
        "rounds to zero length",
        "after an hour: NOTE WEBVTT 1",
    ]
    assert [c.start for c in cues] == sorted(c.start for c in cues)


def test_to_srt_format_and_roundtrip():
    srt = to_srt(SPECIAL_CUES, origin=ORIGIN)
    assert srt.startswith("1\n00:00:00,000 --> 00:00:01,500\nTom & Jerry\n\n2\n00:00:01,000 --> 00:00:03,250\n")
    assert "-->" not in "".join(line for line in srt.splitlines() if not re.match(r"^\d\d:", line))
    validate_srt(srt)
    cues = parse_srt(srt)
    assert len(cues) == len(SPECIAL_CUES)
    assert cues[3].text == "next → arrow and -→ more"
    assert _ms(cues) == _ms(parse_webvtt(to_webvtt(SPECIAL_CUES, origin=ORIGIN)))


def test_writers_edge_cases():
    assert to_webvtt([]) == "WEBVTT\n\n"
    validate_webvtt(to_webvtt([]))
    assert to_srt([]) == ""
    validate_srt("")
    # cues before the origin are dropped, cues straddling it are clipped to 0
    cues = [Cue(5.0, 9.0, "before"), Cue(9.0, 11.0, "straddles"), Cue(12.0, 13.0, "after")]
    assert _ms(parse_webvtt(to_webvtt(cues, origin=10.0))) == [(0, 1000), (2000, 3000)]
    # multi-line / blank / control characters in text never break the block structure
    vtt = to_webvtt([Cue(0, 1, "one\n\n  two  \r\nthree\x00"), Cue(1, 2, " \n ")])
    assert parse_webvtt(vtt) == [Cue(0, 1, "one\ntwo\nthree")]
    # hours beyond 99 (e.g. unix time written with origin 0) still parse
    far = to_webvtt([Cue(ORIGIN, ORIGIN + 1, "far")])
    assert parse_webvtt(far)[0].start == ORIGIN
    assert parse_srt(to_srt([Cue(ORIGIN, ORIGIN + 1, "far")]))[0].start == ORIGIN


def _ffmpeg_convert(src: Path, fmt: str) -> str:
    proc = subprocess.run(
        [FFMPEG, "-nostdin", "-v", "error", "-i", str(src), "-f", fmt, "-"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc.stdout.decode("utf-8")


def _sample_cues() -> list[Cue]:
    """Tracker output for the scripted screen (0-6 s) plus the special-character cues from 10 s on."""
    tr = SubtitleTracker()
    cues: list[Cue] = []
    for k in range(16):
        cues += tr.observe(k * 0.5, (k + 1) * 0.5, parse_model_output(_screen((k + 1) * 0.5)))
    shift = 10.0 - ORIGIN
    return cues + tr.flush() + [Cue(c.start + shift, c.end + shift, c.text) for c in SPECIAL_CUES]


@pytest.mark.skipif(FFMPEG is None, reason="ffmpeg binary not installed")
def test_ffmpeg_cli_accepts_webvtt(tmp_path):
    cues = _sample_cues()
    vtt = to_webvtt(cues)
    validate_webvtt(vtt)
    path = tmp_path / "subs.vtt"
    path.write_text(vtt, encoding="utf-8")
    srt = _ffmpeg_convert(path, "srt")
    assert _timings(srt) == _timings(vtt) == _ms(parse_webvtt(vtt))
    assert len(_timings(vtt)) == len(cues)
    assert "Tom & Jerry" in srt and "a <b>not bold</b> & 1 < 2 > 0" in srt  # entities decoded by ffmpeg
    assert "Über straße 你好 🙂 ½" in srt


@pytest.mark.skipif(FFMPEG is None, reason="ffmpeg binary not installed")
def test_ffmpeg_cli_accepts_srt(tmp_path):
    cues = _sample_cues()
    srt = to_srt(cues)
    validate_srt(srt)
    path = tmp_path / "subs.srt"
    path.write_text(srt, encoding="utf-8")
    vtt = _ffmpeg_convert(path, "webvtt")
    assert vtt.startswith("WEBVTT")
    assert _timings(vtt) == _timings(srt) == _ms(parse_srt(srt))
    assert len(_timings(srt)) == len(cues)
    assert "RED BALL" in vtt and "BLUE BOX" in vtt and "Über straße 你好 🙂 ½" in vtt


@pytest.mark.parametrize("fmt", ["webvtt", "srt"])
def test_libavformat_demuxes_and_decodes(tmp_path, fmt):
    """PyAV's libavformat/libavcodec (always present) parse every cue with the same times and text."""
    av = pytest.importorskip("av")
    cues = _sample_cues()
    text = to_webvtt(cues) if fmt == "webvtt" else to_srt(cues)
    ours = parse_webvtt(text) if fmt == "webvtt" else parse_srt(text)
    path = tmp_path / ("subs.vtt" if fmt == "webvtt" else "subs.srt")
    path.write_text(text, encoding="utf-8")
    got = []
    with av.open(str(path)) as container:
        assert container.format.name == fmt
        stream = container.streams.subtitles[0]
        for packet in container.demux(stream):
            if packet.pts is None or not packet.size:
                continue
            start = float(packet.pts * packet.time_base)
            end = float((packet.pts + packet.duration) * packet.time_base)
            texts = [sub.dialogue.decode("utf-8") for sub in packet.decode()]
            got.append((round(start * 1000), round(end * 1000), "\n".join(texts)))
    assert [(s, e) for s, e, _ in got] == _ms(ours)
    for (_, _, decoded), cue in zip(got, ours, strict=True):
        if fmt == "webvtt" or "<" not in cue.text:  # SRT has no escaping: ffmpeg drops tag-like text
            assert decoded == cue.text


# --------------------------------------------------------------------------------------------
# Validators reject broken files
# --------------------------------------------------------------------------------------------

GOOD_VTT = "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nhello\n\n00:00:01.000 --> 00:00:02.000\nworld\n\n"
GOOD_SRT = "1\n00:00:00,000 --> 00:00:01,000\nhello\n\n2\n00:00:01,000 --> 00:00:02,000\nworld\n\n"


def test_validators_accept_valid_variants():
    validate_webvtt(GOOD_VTT)
    validate_srt(GOOD_SRT)
    validate_webvtt(
        "\ufeffWEBVTT - title\r\nKind: captions\r\n\r\nNOTE a comment\r\n\r\n"
        "id-1\r\n00:01.000 --> 00:02.000 align:start line:0\r\n<i>hi</i> &amp; <c.x>bye</c>\r\n"
    )
    validate_srt("\ufeff1\r\n00:00:00,000 --> 00:00:01,000\r\nhello\r\nsecond line\r\n")
    assert parse_webvtt(GOOD_VTT) == [Cue(0, 1, "hello"), Cue(1, 2, "world")]
    assert parse_srt(GOOD_SRT) == [Cue(0, 1, "hello"), Cue(1, 2, "world")]


@pytest.mark.parametrize(
    "bad",
    [
        "",  # no header
        "00:00:00.000 --> 00:00:01.000\nhello\n",  # missing header
        "WEBVTTX\n\n00:00:00.000 --> 00:00:01.000\nhello\n",
        "webvtt\n\n00:00:00.000 --> 00:00:01.000\nhello\n",
        "WEBVTT\n00:00:00.000 --> 00:00:01.000\nhello\n",  # no blank line after the header
        "WEBVTT\n\n00:00:00,000 --> 00:00:01.000\nhello\n",  # SRT comma
        "WEBVTT\n\n00:00:00.00 --> 00:00:01.000\nhello\n",  # 2-digit millis
        "WEBVTT\n\n0:00:00.000 --> 00:00:01.000\nhello\n",  # 1-digit hours
        "WEBVTT\n\n00:60:00.000 --> 01:00:01.000\nhello\n",  # minutes >= 60
        "WEBVTT\n\n00:00:61.000 --> 00:01:01.000\nhello\n",
        "WEBVTT\n\n00:00:02.000 --> 00:00:01.000\nhello\n",  # end < start
        "WEBVTT\n\n00:00:01.000 --> 00:00:01.000\nhello\n",  # end == start
        "WEBVTT\n\n00:00:05.000 --> 00:00:06.000\na\n\n00:00:01.000 --> 00:00:02.000\nb\n",  # decreasing
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\n",  # empty text
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\na --> b\n",  # arrow in text
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\n1 < 2\n",  # unescaped <
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nTom & Jerry\n",  # unescaped &
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.000 bogus\nhello\n",  # bad setting
        "WEBVTT\n\nan identifier\n",  # identifier without timing
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nhello\n \nworld\n",  # whitespace-only line
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nhello\n\nSTYLE\n::cue {}\n",  # STYLE after a cue
    ],
)
def test_validate_webvtt_rejects(bad):
    with pytest.raises(ValueError):
        validate_webvtt(bad)


@pytest.mark.parametrize(
    "bad",
    [
        "00:00:00,000 --> 00:00:01,000\nhello\n",  # missing index
        "2\n00:00:00,000 --> 00:00:01,000\nhello\n",  # index not starting at 1
        "1\n00:00:00,000 --> 00:00:01,000\na\n\n3\n00:00:01,000 --> 00:00:02,000\nb\n",  # skipped index
        "1\n00:00:00.000 --> 00:00:01,000\nhello\n",  # dot instead of comma
        "1\n00:00:00,000 -> 00:00:01,000\nhello\n",
        "1\n0:00:00,000 --> 00:00:01,000\nhello\n",
        "1\n00:00:00,000 --> 00:00:01,0000\nhello\n",
        "1\n00:00:02,000 --> 00:00:01,000\nhello\n",  # end < start
        "1\n00:00:05,000 --> 00:00:06,000\na\n\n2\n00:00:01,000 --> 00:00:02,000\nb\n",  # decreasing
        "1\n00:00:00,000 --> 00:00:01,000\n",  # empty text
        "1\n00:00:00,000 --> 00:00:01,000\na --> b\n",  # arrow in text
        "1\n",  # no timing
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nhello\n",  # a WebVTT file
    ],
)
def test_validate_srt_rejects(bad):
    with pytest.raises(ValueError):
        validate_srt(bad)


@pytest.mark.skipif(FFMPEG is None, reason="ffmpeg binary not installed")
def test_validator_agrees_with_ffmpeg_on_good_files(tmp_path):
    """Our validator's accepted samples are accepted by ffmpeg with the same times."""
    for name, text, fmt in [("a.vtt", GOOD_VTT, "srt"), ("a.srt", GOOD_SRT, "webvtt")]:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        assert _timings(_ffmpeg_convert(path, fmt)) == [(0, 1000), (1000, 2000)]


@pytest.mark.skipif(FFMPEG is None, reason="ffmpeg binary not installed")
@pytest.mark.parametrize(
    "bad",
    [
        "WEBVTT\n00:00:00.000 --> 00:00:01.000\nhello\n",  # no blank line after the header
        "WEBVTT\n\n00:00:00,000 --> 00:00:01.000\nhello\n",  # SRT comma
    ],
)
def test_ffmpeg_loses_cues_in_files_the_validator_rejects(tmp_path, bad):
    """Why strict: ffmpeg silently drops the cue in these files (exit 0, no cue), so only our validator tells."""
    with pytest.raises(ValueError):
        validate_webvtt(bad)
    path = tmp_path / "bad.vtt"
    path.write_text(bad, encoding="utf-8")
    assert _timings(_ffmpeg_convert(path, "srt")) == []
