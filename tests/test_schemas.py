"""Wire schemas: round trips, and every hostile input rejected with the field named."""

from __future__ import annotations

import json
import subprocess

import msgpack
import numpy as np
import pytest
import redis

from common.wire import keys
from common.wire.manifest import from_manifest
from common.wire.schemas import (
    QUESTION_ID_RE,
    AnswerDelta,
    EndOfStream,
    FinalAnswer,
    FrameMsg,
    Limits,
    Manifest,
    Question,
    SchemaError,
    check_frame_entry,
    checked_question,
    decode_answer,
    decode_final,
    decode_frame,
    decode_manifest,
    encode_delta,
    encode_final,
    encode_frame,
    encode_manifest,
    encode_question,
    frame_entry_cap,
    frame_follow_problem,
    manifest_from_bytes,
    manifest_to_bytes,
    parse_question,
    question_id_of,
)


def _frame(h: int = 4, w: int = 6, seq: int = 3) -> FrameMsg:
    rgb = np.arange(h * w * 3, dtype=np.uint8).reshape(h, w, 3)
    return FrameMsg.from_rgb(seq, 1700000000.25, 12.5, rgb)


def _raw(m: dict) -> dict[bytes, bytes]:
    return {b"m": msgpack.packb(m, use_bin_type=True)}


def _good_frame_map() -> dict:
    return {"v": 1, "seq": 0, "ts": 1.0, "pts": 0.0, "h": 2, "w": 2, "fmt": "rgb24", "data": bytes(12)}


def _raises(field: str, fn, *args, **kw) -> SchemaError:
    with pytest.raises(SchemaError) as ei:
        fn(*args, **kw)
    assert ei.value.field == field, str(ei.value)
    assert str(ei.value).startswith(field)
    return ei.value


# --------------------------------------------------------------------------- frames


def test_frame_round_trip_and_rgb_view():
    f = _frame()
    enc = encode_frame(f)
    back = decode_frame({k.encode(): v for k, v in enc.items()})  # as redis-py returns it
    assert back == f
    rgb = back.rgb()
    assert rgb.shape == (4, 6, 3) and rgb.dtype == np.uint8
    assert np.array_equal(rgb, np.arange(72, dtype=np.uint8).reshape(4, 6, 3))
    assert np.shares_memory(rgb, np.frombuffer(back.data, np.uint8))  # a view, no copy


def test_frame_through_redis(redis_url):
    r = redis.Redis.from_url(redis_url)
    f = _frame(28, 56, seq=7)
    r.xadd(keys.frames("cam1"), encode_frame(f))
    r.xadd(keys.frames("cam1"), encode_frame(EndOfStream(seq=7)))
    (_, a), (_, b) = r.xrange(keys.frames("cam1"))
    assert decode_frame(a) == f
    assert decode_frame(b) == EndOfStream(seq=7)


def test_eos_without_frames():
    assert decode_frame(encode_frame(EndOfStream(-1))) == EndOfStream(-1)
    _raises("seq", decode_frame, _raw({"v": 1, "eos": True, "seq": -2}))
    _raises("seq", decode_frame, _raw({"v": 1, "eos": True}))
    _raises("eos", decode_frame, _raw({"v": 1, "eos": "yes", "seq": 1}))


@pytest.mark.parametrize(
    "fields",
    [{}, {b"x": b"1"}, {b"m": b"\xc1\xc1garbage"}, {b"m": b""}, {b"m": msgpack.packb([1, 2])}, {b"m": 5}],
)
def test_frame_garbage_names_m(fields):
    _raises("m", decode_frame, fields)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"v": 2}, "v"),
        ({"v": "1"}, "v"),
        ({"v": None}, "v"),
        ({"seq": -1}, "seq"),
        ({"seq": "0"}, "seq"),
        ({"seq": True}, "seq"),
        ({"seq": 1.0}, "seq"),
        ({"ts": "now"}, "ts"),
        ({"ts": float("nan")}, "ts"),
        ({"pts": None}, "pts"),
        ({"h": 0}, "h"),
        ({"w": -2}, "w"),
        ({"h": 2.0}, "h"),
        ({"fmt": "bgr24"}, "fmt"),
        ({"fmt": 3}, "fmt"),
        ({"data": bytes(11)}, "data"),  # size mismatch
        ({"data": bytes(13)}, "data"),
        ({"data": "x" * 12}, "data"),  # str, not bin
        ({"data": [0] * 12}, "data"),
        ({"h": 4097, "w": 4097, "data": b""}, "h"),  # over the pixel limit, checked before data
    ],
)
def test_frame_bad_fields(change, field):
    _raises(field, decode_frame, _raw({**_good_frame_map(), **change}))


@pytest.mark.parametrize("missing", ["v", "seq", "ts", "pts", "h", "w", "fmt", "data"])
def test_frame_missing_field(missing):
    m = _good_frame_map()
    del m[missing]
    err = _raises(missing, decode_frame, _raw(m))
    assert "missing" in str(err)


def test_frame_limits_overridable_and_int_times_accepted():
    assert decode_frame(_raw({**_good_frame_map(), "ts": 5, "pts": 0})).ts == 5.0
    _raises("h", decode_frame, _raw(_good_frame_map()), Limits(max_frame_pixels=3))
    _raises("m", decode_frame, {b"m": bytes(100)}, Limits(max_frame_pixels=3))  # payload size
    _raises("h", encode_frame, _frame(4, 6), Limits(max_frame_pixels=23))


def test_frame_constructor_validates():
    _raises("data", FrameMsg, seq=0, ts=0.0, pts=0.0, h=2, w=2, data=bytes(5))
    _raises("data", FrameMsg.from_rgb, 0, 0.0, 0.0, np.zeros((2, 2, 3), np.float32))
    f = FrameMsg.from_rgb(0, 0.0, 0.0, np.zeros((4, 4, 3), np.uint8)[:, ::2])  # non-contiguous
    assert f.w == 2 and len(f.data) == 24


def test_unknown_frame_keys_are_ignored():
    assert decode_frame(_raw({**_good_frame_map(), "future": 1})).seq == 0


def _follows(seq: int, ts: float, live: bool = True, **kw) -> str | None:
    """Can a frame (seq, ts) follow seq 10 captured at 1000.0, at 1010.0 on the clock it is judged by?"""
    msg = FrameMsg(seq=seq, ts=ts, pts=0.0, h=1, w=1, data=bytes(3))
    return frame_follow_problem(10, 1000.0, msg, 2.0, live, now=1010.0, **kw)


def test_a_live_frames_seq_gap_is_bounded_by_the_time_passed_until_now():
    """Issue 37.1: the gap a frame may claim grew with its own stamp, so a stamp in the future
    bought a seq far ahead. 10 s have passed since the last frame at 2 fps: 64 + 30 seqs."""
    assert _follows(104, 1010.0) is None
    assert "jumps 95" in _follows(105, 1010.0)
    assert "jumps 97" in _follows(107, 1011.0), "stamped 1 s ahead (inside the skew): no wider gap"
    assert "ahead of Redis's clock" in _follows(11, 1012.5)
    assert _follows(11, 1012.5, max_skew_s=5.0) is None
    assert _follows(107, 1011.0, live=False) is None, "a file's capture times are media time: no clock bounds them"


def test_a_frames_entry_is_capped_by_its_grid():
    """Whatever the codec and the picture, an entry of a grid fits its cap (a codec that would
    make a frame larger sends it raw); one larger is refused, extra fields counted too."""
    noise = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    cap = frame_entry_cap(56, 84)
    for codec in ("rgb24", "webp", "png", "jpeg"):
        check_frame_entry(encode_frame(FrameMsg.from_rgb(2**40, 1e12, 1e12, noise, epoch=9), codec=codec), cap)
    check_frame_entry(encode_frame(EndOfStream(2**40)), cap)
    _raises("m", check_frame_entry, {b"m": bytes(cap)}, cap)
    _raises("m", check_frame_entry, {b"m": b"1", **{b"x%d" % i: bytes(1000) for i in range(cap // 1000 + 1)}}, cap)
    _raises("fields", check_frame_entry, [(b"m", b"1")], cap)


# --------------------------------------------------------------------------- manifest


def _segments(n_chunks: int = 2) -> list[dict]:
    prefix = {
        "id": "prefix",
        "tokens": 20,
        "offset": 0,
        "first_patch": 0,
        "patch_now": 0,
        "n_patches": 0,
        "t_delta": [],
    }
    chunks = [
        {
            "id": f"f{i:012d}",
            "tokens": 32,
            "offset": 20 + 32 * i,
            "first_patch": 2 * i + 4,
            "patch_now": 2 * i,
            "n_patches": 2,
            "t_delta": [-4, -4],
            "frame_seqs": [4 * i, 4 * i + 3],
            "capture_range": [100.0 + 2 * i, 101.5 + 2 * i],
        }
        for i in range(n_chunks)
    ]
    return [prefix, *chunks]


def _manifest(**kw) -> Manifest:
    base = dict(
        version=5,
        stream="cam1",
        fps=2.0,
        grid=[56, 84],
        chunk_frames=4,
        video_start=20,
        next_patch=4,
        segments=_segments(),
        last_frame_seq=7,
        first_ts=100.0,
        last_ts=103.5,
        cache_tokens=84,
        evictions=1,
        evicted_segments=1,
        evicted_tokens=512,
        created_at=1700000000.5,
        epoch="3f2a9c41d07b6e58",
    )
    return Manifest(**{**base, **kw})


def test_manifest_round_trip(redis_url):
    m = _manifest()
    assert manifest_from_bytes(manifest_to_bytes(m)) == m
    assert m.segment_ids == ("prefix", "f000000000000", "f000000000001")
    assert m.segments[2].t_delta == (-4, -4) and m.segments[2].frame_seqs == (4, 7) and m.grid == (56, 84)
    r = redis.Redis.from_url(redis_url)
    r.set(keys.head("cam1"), manifest_to_bytes(m))
    assert manifest_from_bytes(r.get(keys.head("cam1"))) == m
    r.xadd(keys.versions("cam1"), encode_manifest(m))
    assert decode_manifest(r.xrange(keys.versions("cam1"))[0][1]) == m


def test_manifest_empty_stream_and_defaults():
    m = _manifest(segments=_segments(0), last_frame_seq=-1, first_ts=None, last_ts=None)
    assert manifest_from_bytes(manifest_to_bytes(m)) == m
    d = msgpack.unpackb(manifest_to_bytes(m))
    for k in ("evictions", "evicted_segments", "evicted_tokens", "created_at"):
        del d[k]
    assert manifest_from_bytes(msgpack.packb(d)).evicted_tokens == 0


def test_a_manifest_from_before_epochs_still_decodes():
    """Issue 37.4: `epoch` is an additive field (no schema version bump): a head or versions entry
    written before it decodes, with the epoch "" (a stream's life before epochs)."""
    d = msgpack.unpackb(manifest_to_bytes(_manifest()))
    del d["epoch"]
    old = manifest_from_bytes(msgpack.packb(d))
    assert old.epoch == "" and old == _manifest(epoch="")
    assert from_manifest(old).cache.epoch == ""


def _with_segment(i: int, **change) -> list[dict]:
    segments = _segments()
    segments[i] = {**segments[i], **change}
    return segments


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"v": 0}, "v"),
        ({"version": -1}, "version"),
        ({"version": "5"}, "version"),
        ({"stream": "bad name"}, "stream"),
        ({"stream": ".."}, "stream"),
        ({"fps": 0}, "fps"),
        ({"grid": [56]}, "grid"),
        ({"grid": [56, "84"]}, "grid[1]"),
        ({"grid": [4200, 4200]}, "grid"),  # each side in range, the frame over the limit
        ({"segments": "prefix"}, "segments"),
        ({"segments": []}, "segments"),
        ({"segments": [1]}, "segments[0]"),
        ({"segments": _with_segment(0, id="../etc")}, "segments[0].id"),
        ({"segments": _with_segment(1, id="a/b")}, "segments[1].id"),
        ({"segments": _with_segment(1, id=1)}, "segments[1].id"),
        ({"segments": _with_segment(1, t_delta=[0])}, "segments[1].t_delta"),
        ({"segments": _with_segment(1, t_delta=[0, 0.5])}, "segments[1].t_delta[1]"),
        ({"segments": _with_segment(1, t_delta=3)}, "segments[1].t_delta"),
        ({"segments": _with_segment(2, frame_seqs=[1])}, "segments[2].frame_seqs"),
        ({"segments": _with_segment(2, capture_range=[1.0, "x"])}, "segments[2].capture_range[1]"),
        ({"segments": _with_segment(2, tokens=-1)}, "segments[2].tokens"),
        ({"segments": [{"id": "prefix"}]}, "segments[0]"),
        ({"last_frame_seq": -2}, "last_frame_seq"),
        ({"first_ts": "x"}, "first_ts"),
        ({"cache_tokens": -1}, "cache_tokens"),
        ({"next_patch": None}, "next_patch"),
        ({"epoch": 7}, "epoch"),
        ({"epoch": "a:b"}, "epoch"),
        ({"epoch": "e" * 65}, "epoch"),
    ],
)
def test_manifest_bad_fields(change, field):
    d = msgpack.unpackb(manifest_to_bytes(_manifest()))
    _raises(field, manifest_from_bytes, msgpack.packb({**d, **change}))


def test_a_stream_description_with_a_grid_over_the_frame_limit_is_refused_at_read():
    """Ingest never chooses such a grid, but one forged or damaged in Redis was taken as it was:
    the encoder opened the stream on it, and ingest resized every frame to it."""
    from common.wire.meta import StreamMeta

    meta = {b"fps": b"2", b"height": b"4200", b"width": b"4200", b"live": b"1"}
    _raises("meta.grid", StreamMeta.from_hash, meta)
    assert StreamMeta.from_hash(meta | {b"height": b"3920"}).grid.height == 3920  # 3920 x 4200 is within it


def test_manifest_missing_and_garbage():
    d = msgpack.unpackb(manifest_to_bytes(_manifest()))
    del d["next_patch"]
    _raises("next_patch", manifest_from_bytes, msgpack.packb(d))
    _raises("m", manifest_from_bytes, b"\x00\xff")
    _raises("m", manifest_from_bytes, None)


# --------------------------------------------------------------------------- questions


def _q(**kw: str) -> dict[bytes, bytes]:
    base = {"id": "q0", "stream": "cam1", "question": "what is red?"}
    return {k.encode(): v.encode() for k, v in {**base, **kw}.items()}


def test_question_defaults_and_ids():
    q = parse_question(_q())
    assert (q.id, q.stream, q.question, q.max_tokens, q.temperature, q.top_p) == (
        "q0",
        "cam1",
        "what is red?",
        128,
        0.0,
        1.0,
    )
    assert q.choices is None and q.at is None and q.reply_ttl is None


def test_a_question_needs_an_id_and_the_default_one_is_unguessable():
    """No id: refused (a stream entry id is a millisecond clock, and the id is all that guards the
    answer). The clients' default id is 128 random bits, a new one each time."""
    no_id = {k: v for k, v in _q().items() if k != b"id"}
    with pytest.raises(SchemaError, match="id: missing"):
        parse_question(no_id)
    assert question_id_of(no_id, "1700000000000-0") == "1700000000000-0"  # where the refusal goes
    ids = {checked_question("cam1", "hi").id for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 22 and QUESTION_ID_RE.fullmatch(i) for i in ids)
    assert checked_question("cam1", "hi", id="mine").id == "mine"


def test_question_all_fields_round_trip():
    fields = _q(
        id="q-1",
        max_tokens="64",
        temperature="0.7",
        top_p="0.9",
        choices='["red", "blue", "green"]',
        at="42",
        reply_ttl="600",
    )
    q = parse_question(fields)
    assert q == Question("q-1", "cam1", "what is red?", 64, 0.7, 0.9, ("red", "blue", "green"), 42, 600)
    assert parse_question({k.encode(): v.encode() for k, v in encode_question(q).items()}) == q
    assert parse_question(_q(at="latest")).at is None
    assert parse_question({"id": "s", "stream": "cam1", "question": "str keys"}).question == "str keys"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"stream": ""}, "stream"),
        ({"stream": "cam 1"}, "stream"),
        ({"stream": "{cam1}"}, "stream"),
        ({"stream": "x" * 65}, "stream"),
        ({"stream": "."}, "stream"),
        ({"question": ""}, "question"),
        ({"question": "  \n "}, "question"),
        ({"question": "x" * 4001}, "question"),
        ({"question": "x" * 100_000}, "question"),
        ({"id": "a b"}, "id"),
        ({"id": "x" * 129}, "id"),
        ({"id": "q:{cam}"}, "id"),
        ({"max_tokens": "0"}, "max_tokens"),
        ({"max_tokens": "2049"}, "max_tokens"),
        ({"max_tokens": "1.5"}, "max_tokens"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"temperature": "-0.1"}, "temperature"),
        ({"temperature": "2.5"}, "temperature"),
        ({"temperature": "nan"}, "temperature"),
        ({"temperature": "inf"}, "temperature"),
        ({"top_p": "0"}, "top_p"),
        ({"temperature": "1e-300"}, "temperature"),  # 0 in float32: NaN probabilities
        ({"temperature": "1e-40"}, "temperature"),  # logits / t overflow in float32
        ({"top_p": "1e-300"}, "top_p"),  # 0 in float32: no token kept
        ({"top_p": "1.01"}, "top_p"),
        ({"choices": "red,blue"}, "choices"),
        ({"choices": '"red"'}, "choices"),
        ({"choices": '["red"]'}, "choices"),
        ({"choices": json.dumps([f"c{i}" for i in range(17)])}, "choices"),
        ({"choices": '["red", ""]'}, "choices[1]"),
        ({"choices": '["red", 3]'}, "choices[1]"),
        ({"choices": json.dumps(["red", "x" * 201])}, "choices[1]"),
        ({"choices": '["red", "red"]'}, "choices"),
        ({"at": "-1"}, "at"),
        ({"at": "head"}, "at"),
        ({"reply_ttl": "0"}, "reply_ttl"),
        ({"reply_ttl": "soon"}, "reply_ttl"),
        ({"max_token": "5"}, "max_token"),  # typo: unknown field
    ],
)
def test_question_hostile(change, field):
    _raises(field, parse_question, _q(**change))


def test_question_missing_and_binary():
    _raises("stream", parse_question, {b"id": b"q", b"question": b"hi"})
    _raises("question", parse_question, {b"id": b"q", b"stream": b"cam1"})
    _raises("question", parse_question, {b"id": b"q", b"stream": b"cam1", b"question": b"\xff\xfe"})
    _raises("fields", parse_question, [b"stream", b"cam1"])


def test_question_limits_overridable():
    _raises("question", parse_question, _q(question="x" * 11), limits=Limits(max_question_chars=10))
    _raises("choices", parse_question, _q(choices='["a","b","c"]'), limits=Limits(max_choices=2))
    _raises("max_tokens", parse_question, _q(max_tokens="9"), limits=Limits(max_new_tokens=8))


def test_question_id_recovered_from_bad_question():
    bad = _q(id="q7", question="", max_tokens="-3")
    with pytest.raises(SchemaError):
        parse_question(bad)
    assert question_id_of(bad, "5-0") == "q7"
    assert question_id_of({b"question": b""}, "5-0") == "5-0"
    assert question_id_of({b"question": b""}) is None
    assert question_id_of({b"id": b"bad id{}"}, "5-0") is None  # unsafe as a key: no reply
    assert question_id_of("garbage") is None


def test_redis_cli_question_accepted(redis_url, redis_cli):
    cli = [redis_cli, "-u", redis_url]
    subprocess.run(
        [*cli, "XADD", keys.QUESTIONS, "*", "id", "q-1", "stream", "cam1", "question", "what is red?"],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            *cli,
            "XADD",
            keys.QUESTIONS,
            "*",
            "id",
            "mc1",
            "stream",
            "cam1",
            "question",
            "which colour?",
            "choices",
            '["red","blue"]',
            "max_tokens",
            "16",
            "temperature",
            "0",
        ],
        check=True,
        capture_output=True,
    )
    r = redis.Redis.from_url(redis_url)
    (_, f1), (_, f2) = r.xrange(keys.QUESTIONS)
    q1 = parse_question(f1)
    assert (q1.id, q1.stream, q1.question) == ("q-1", "cam1", "what is red?")
    q2 = parse_question(f2)
    assert (q2.id, q2.choices, q2.max_tokens, q2.temperature) == ("mc1", ("red", "blue"), 16, 0.0)


# --------------------------------------------------------------------------- answers


def test_answer_round_trip(redis_url):
    r = redis.Redis.from_url(redis_url)
    final = FinalAnswer(
        id="q1",
        stream="cam1",
        text="red",
        choice="red",
        scores={"red": -0.1, "blue": -2.5},
        version=9,
        epoch="3f2a9c41d07b6e58",
        t_start=100.0,
        t_end=130.25,
        ranges=((100.0, 104.5), (120.0, 130.25)),
        cache_tokens=4096,
        first_token_s=0.047,
        total_s=0.31,
        tokens=3,
    )
    r.xadd(keys.answer("q1"), encode_delta("re"))
    r.xadd(keys.answer("q1"), encode_delta("d"))
    r.xadd(keys.answer("q1"), encode_final(final))
    entries = [decode_answer(f) for _, f in r.xrange(keys.answer("q1"))]
    assert entries == [AnswerDelta("re"), AnswerDelta("d"), final]
    assert all(isinstance(v, str) for v in encode_final(final).values())


def test_error_final_and_bad_finals():
    err = FinalAnswer(id="q2", stream=None, error="stream: missing")
    enc = encode_final(err)
    assert enc == {"type": "final", "id": "q2", "error": "stream: missing"}
    assert decode_final(enc) == err
    _raises("text", FinalAnswer, id="q3", stream="cam1")  # neither text nor error
    _raises("text", FinalAnswer, id="q3", stream="cam1", text="a", error="b")
    _raises("scores", encode_final, FinalAnswer(id="q3", stream="c", text="a", scores={"a": float("-inf")}))
    _raises("type", decode_final, encode_delta("x"))
    _raises("version", decode_final, {**enc, "version": "v9"})
    _raises("epoch", decode_final, {**enc, "epoch": "{cam}"})
    _raises("scores", decode_final, {**enc, "scores": "[1]"})
    for bad in ("[[1]]", "[[2, 1]]", "{}", "[1"):
        _raises("ranges", decode_final, {**enc, "ranges": bad})
    _raises("ranges[0][0]", decode_final, {**enc, "ranges": '[["a", 1]]'})
    _raises("id", decode_final, {"type": "final", "error": "x"})
