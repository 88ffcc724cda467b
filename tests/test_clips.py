"""Clips, snapshots and evidence URLs from the frames log (api/clips.py): a real frames log of
rendered frames packed as ingest packs them, the API app over a real redis-server, and the MP4s
and JPEGs it returns decoded with PyAV and Pillow."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import threading
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
import redis
from PIL import Image

from api import clips
from api.app import create_app
from api.config import ApiConfig
from apps.samplevideo import render_frame
from common.framelog import FrameLog, Record
from common.wire import keys
from common.wire.alert_record import Alert
from common.wire.schemas import FIELD, FinalAnswer, FrameMsg, encode_final, encode_frame
from tests.pipeline import wait_for
from tests.test_api import CHROMIUM, CHROMIUM_ARGS, TOKEN, _parse_sse, assert_error, served

CAM = "cam1"
T0 = 1_800_000_000.0  # capture times: unix seconds, like a live camera's
FRAMES = 20  # at 2 fps: T0 .. T0 + 9.5
W, H = 96, 64  # not square: a transposed frame shows
MAX_MAE = 12.0  # mean absolute error, 0..255, of a lossy-coded frame against its source


def source(seq: int, width: int = W, height: int = H) -> np.ndarray:
    return render_frame(seq / 2, width=width, height=height)


def packed(seq: int, width: int = W, height: int = H) -> bytes:
    """Frame ``seq`` (captured at T0 + seq / 2) as the frames log keeps it: ingest's payload."""
    msg = FrameMsg.from_rgb(seq, T0 + seq / 2, seq / 2, source(seq, width, height))
    return encode_frame(msg, codec="webp")[FIELD]


@pytest.fixture
def frames_dir(tmp_path: Path) -> Path:
    """A frames log of FRAMES frames of CAM, captured every 0.5 s from T0, as the recorder keeps them."""
    w = FrameLog(tmp_path).writer(CAM, roll_s=600.0)
    for seq in range(FRAMES):
        assert w.append(seq, T0 + seq / 2, packed(seq))
    w.commit()
    w.close()
    return tmp_path


@contextlib.asynccontextmanager
async def api(cfg: ApiConfig) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app, run from start to shutdown: its Redis connections are closed after
    (other tests count connections)."""
    app = create_app(cfg)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api", timeout=30) as client,
    ):
        yield client


def get(cfg: ApiConfig, *paths: str) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with api(cfg) as client:
            return [await client.get(p) for p in paths]

    return asyncio.run(run())


def decoded(mp4: bytes) -> list[av.VideoFrame]:
    with av.open(io.BytesIO(mp4)) as container:
        return list(container.decode(video=0))


def mae(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def test_a_clip_holds_the_spans_frames_at_their_capture_times(redis_url, frames_dir):
    """From T0+2 to T0+6: frames 4..12, each its source frame (lossy), 0.5 s apart as captured;
    `from` as ISO 8601 gives the same clip, and `to` defaults to from + 30 s (every frame)."""
    iso = datetime.fromtimestamp(T0 + 2, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cfg = ApiConfig(redis_url=redis_url, framelog_dir=str(frames_dir))
    epoch, by_iso, default_to = get(
        cfg,
        f"/api/streams/{CAM}/clip?from={T0 + 2}&to={T0 + 6}",
        f"/api/streams/{CAM}/clip?from={iso}&to={T0 + 6}",
        f"/api/streams/{CAM}/clip?from={T0}",
    )
    assert epoch.status_code == 200, epoch.text
    assert epoch.headers["content-type"] == "video/mp4"
    assert epoch.headers["x-clip-frames"] == "9"
    frames = decoded(epoch.content)
    assert len(frames) == 9
    assert {(f.width, f.height) for f in frames} == {(W, H)}
    errors = [mae(f.to_ndarray(format="rgb24"), source(seq)) for f, seq in zip(frames, range(4, 13), strict=True)]
    assert max(errors) < MAX_MAE, errors
    times = [f.time for f in frames]
    assert np.allclose(np.diff(times), 0.5, atol=0.002), times
    assert by_iso.status_code == 200 and len(decoded(by_iso.content)) == 9
    assert default_to.status_code == 200 and len(decoded(default_to.content)) == FRAMES


def test_a_running_api_sees_frames_committed_since_its_last_clip(redis_url, frames_dir):
    """The API keeps one frames log reader (its file indexes cached): frames the recorder commits
    later are in the next clip and snapshot."""
    cfg = ApiConfig(redis_url=redis_url, framelog_dir=str(frames_dir))
    span = f"/api/streams/{CAM}/clip?from={T0 + 9}&to={T0 + 13}"

    async def run() -> list[httpx.Response]:
        async with api(cfg) as client:
            before = await client.get(span)
            w = FrameLog(frames_dir).writer(CAM, roll_s=600.0)
            for seq in range(FRAMES, FRAMES + 4):
                assert w.append(seq, T0 + seq / 2, packed(seq))
            w.commit()
            w.close()
            return [before, await client.get(span), await client.get(f"/api/streams/{CAM}/snapshot")]

    before, after, newest = asyncio.run(run())
    assert before.headers["x-clip-frames"] == "2"  # 18, 19
    assert after.headers["x-clip-frames"] == "6" and len(decoded(after.content)) == 6  # 18 .. 23
    assert newest.headers["x-frame-seq"] == str(FRAMES + 3)


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
def test_odd_sized_frames_and_an_undecodable_one_still_make_a_clip(codec):
    """Either codec (mpeg4 where PyAV lacks libx264); a 57x43 camera's clip is 56x42 (4:2:0 needs
    even sizes); a record whose payload is no frame is left out, the others kept."""
    records = [Record(seq, T0 + seq / 2, packed(seq, 57, 43)) for seq in range(6)]
    records.insert(3, Record(99, T0 + 1.2, b"\x81\xa1m\x01"))  # msgpack, but no frame
    made = clips.encode_mp4(records, codec)
    assert made is not None
    data, count, first, last = made
    assert (count, first, last) == (6, T0, T0 + 2.5)
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.video[0].codec_context.name == {"libx264": "h264"}.get(codec, codec)
        frames = list(container.decode(video=0))
    assert len(frames) == 6 and {(f.width, f.height) for f in frames} == {(56, 42)}
    assert clips.encode_mp4([], codec) is None


@pytest.mark.parametrize(("width", "height"), [(43, 1), (1, 43)])
def test_frames_one_pixel_thin_still_make_a_clip(width, height):
    """A side of one pixel is scaled to two (4:2:0 needs even sizes; rounding down made it 0 and
    the encoder failed: a 500)."""
    rgb = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    records = [
        Record(seq, T0 + seq / 2, encode_frame(FrameMsg.from_rgb(seq, T0 + seq / 2, seq / 2, rgb))[FIELD])
        for seq in range(2)
    ]
    made = clips.encode_mp4(records)
    assert made is not None
    frames = decoded(made[0])
    assert len(frames) == 2 and {(f.width, f.height) for f in frames} == {(max(2, width - 1), max(2, height - 1))}


def test_a_search_results_clip_is_one_the_api_serves_however_long_the_moment():
    """A moment longer than a clip may be (adjacent matching chunks: an event of 800 s) links the
    MAX_CLIP_S around its best chunk, inside the moment; a shorter one, all of it."""
    from api.search import _result
    from common.wire.schemas import SearchHit

    def clip_of(start: float, end: float, best: float) -> tuple[float, float]:
        hit = SearchHit(CAM, start, end, 0.5, 0, 1599, 1600, 400, best - 1, best + 1, 0, 3)
        query = dict(kv.split("=") for kv in _result(hit)["clip"].split("?")[1].split("&"))
        return clips.parse_time(query["from"], "from"), clips.parse_time(query["to"], "to")

    for best in (T0 + 1.0, T0 + 400.3, T0 + 799.0):
        t0, t1 = clip_of(T0 + 0.0004, T0 + 800.5, best)
        assert t1 - t0 <= clips.MAX_CLIP_S and t0 >= T0 and t1 <= T0 + 800.5 and t0 <= best <= t1, (best, t0, t1)
    assert clip_of(T0, T0 + 30.0, T0 + 10.0) == (T0, T0 + 30.0)


def test_a_snapshot_is_the_frame_nearest_the_time_asked(redis_url, frames_dir):
    cfg = ApiConfig(redis_url=redis_url, framelog_dir=str(frames_dir))
    near, newest = get(cfg, f"/api/streams/{CAM}/snapshot?at={T0 + 3.1}", f"/api/streams/{CAM}/snapshot")
    for response, seq in ((near, 6), (newest, FRAMES - 1)):
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "image/jpeg"
        assert response.headers["x-frame-seq"] == str(seq)
        picture = np.asarray(Image.open(io.BytesIO(response.content)).convert("RGB"))
        assert picture.shape == (H, W, 3)
        assert mae(picture, source(seq)) < MAX_MAE


def test_a_snapshot_reads_the_frames_nearest_its_time_not_its_whole_window(tmp_path: Path):
    """With no frame within 2 s of `at`, a snapshot read every frame of the 60 s window into memory
    before it decoded the nearest: at 2 fps 120 frames held at once (tens of MB at 448²). It reads
    the window's index, then the nearest frames one at a time; the frame is the same."""
    import tracemalloc

    side = 160  # raw frames of 77 KB: the size of a noisy 448² camera's WebP, cheaply made
    payload = side * side * 3
    w = FrameLog(tmp_path).writer(CAM, roll_s=600.0)
    for seq in range(240):  # 120 s at 2 fps, with no frame in 40-50 s
        if not 80 <= seq < 100:
            msg = FrameMsg.from_rgb(seq, T0 + seq / 2, seq / 2, source(seq, side, side))
            assert w.append(seq, T0 + seq / 2, encode_frame(msg)[FIELD])
    w.commit()
    w.close()
    frames = FrameLog(tmp_path)
    frames.stamps(CAM, T0, T0 + 120)  # the indexes read, as a running API has them
    tracemalloc.start()
    try:
        jpeg, record = clips.nearest_jpeg(frames, CAM, T0 + 44.6)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert record.seq == 79 and jpeg.startswith(b"\xff\xd8")  # 39.5 s: the nearest, 5.1 s before
    assert peak < 8 * payload, peak  # a few frames' worth, not the window's 120


def test_bad_or_empty_spans_get_the_apis_errors(redis_url, frames_dir):
    cfg = ApiConfig(redis_url=redis_url, framelog_dir=str(frames_dir))
    empty, other_cam, bad_from, bad_to, too_long, backwards, far = get(
        cfg,
        f"/api/streams/{CAM}/clip?from={T0 + 100}&to={T0 + 110}",
        f"/api/streams/cam2/clip?from={T0}",
        f"/api/streams/{CAM}/clip?from=yesterday",
        f"/api/streams/{CAM}/clip?from={T0}&to=nan",
        f"/api/streams/{CAM}/clip?from={T0}&to={T0 + 601}",
        f"/api/streams/{CAM}/clip?from={T0 + 5}&to={T0}",
        f"/api/streams/{CAM}/snapshot?at={T0 + 1000}",
    )
    assert_error(empty, 404, code="no_frames")
    assert_error(other_cam, 404, code="no_frames")
    assert "from" in assert_error(bad_from, 400, param="from")["message"]
    assert_error(bad_to, 400, param="to")
    assert_error(too_long, 400, param="to")
    assert_error(backwards, 400, param="to")
    assert_error(far, 404, code="no_frames")
    (unset,) = get(ApiConfig(redis_url=redis_url), f"/api/streams/{CAM}/clip?from={T0}")
    assert_error(unset, 404, code="no_frames_log")


def _answer(r: redis.Redis, ranges: tuple[tuple[float, float], ...], count: int = 1) -> None:
    """Play the worker: answer each of the first ``count`` questions, as they come, with a final
    over ``ranges``."""
    span = {"t_start": ranges[0][0], "t_end": ranges[-1][1], "version": 3, "total_s": 0.2}
    done: set[str] = set()
    while len(done) < count:
        wait_for(lambda: r.xlen(keys.QUESTIONS) > len(done), 30, "a question")
        for _, fields in r.xrange(keys.QUESTIONS):
            if (qid := fields[b"id"].decode()) not in done:
                done.add(qid)
                r.xadd(
                    keys.answer(qid), encode_final(FinalAnswer(id=qid, stream=CAM, text="a van", ranges=ranges, **span))
                )


def test_final_answers_and_alerts_carry_their_evidence(redis_url, frames_dir, request):
    """A final's ranges (two, with a gap) come back with a clip covering both and a snapshot at
    their end, in the native JSON answer, its SSE `final` and the OpenAI endpoint's `streamvqa`;
    the clip URL serves the frames of that span. Alerts carry the same for their span. Without a
    frames log, no evidence (no URL it cannot serve)."""
    r = redis.Redis.from_url(redis_url)
    request.addfinalizer(r.close)
    r.hset(keys.meta(CAM), mapping={"fps": "2", "height": str(H), "width": str(W), "live": "1"})
    alert = Alert("a1", CAM, "door", "Is the door open?", 0.9, 0.5, 3, T0 + 5, T0 + 7, T0 + 8, None)
    r.xadd(keys.alerts(CAM), alert.fields())
    ranges = ((T0 + 1, T0 + 2), (T0 + 4, T0 + 5))
    worker = threading.Thread(target=_answer, args=(r, ranges, 4), daemon=True)
    worker.start()
    with_log = ApiConfig(redis_url=redis_url, framelog_dir=str(frames_dir), block_ms=200)
    question = {"question": "what came?", "stream": False}
    chat = {"model": CAM, "messages": [{"role": "user", "content": "what came?"}]}

    async def run() -> tuple[list[dict], list[httpx.Response], dict, dict]:
        async with api(with_log) as client, api(ApiConfig(redis_url=redis_url, block_ms=200)) as bare:
            native = (await client.post(f"/api/streams/{CAM}/ask", json=question, timeout=30)).json()
            streamed = _parse_sse(
                (await client.post(f"/api/streams/{CAM}/ask", json=question | {"stream": True}, timeout=30)).text
            )
            openai = (await client.post("/v1/chat/completions", json=chat, timeout=30)).json()["streamvqa"]
            without = (await bare.post(f"/api/streams/{CAM}/ask", json=question, timeout=30)).json()
            ev = native["evidence"]
            alerts = (await client.get(f"/api/streams/{CAM}/alerts")).json()["alerts"]
            served = [await client.get(ev["clip"]), await client.get(ev["snapshot"])]
            return [native, streamed[-1][1], openai], served, alerts[0]["evidence"], without

    finals, (clip, snap), alert_ev, without = asyncio.run(run())
    worker.join(10)
    ev = finals[0]["evidence"]
    assert [f["evidence"] for f in finals] == [ev] * 3
    assert ev["ranges"] == [list(x) for x in ranges]
    assert clip.status_code == 200 and len(decoded(clip.content)) == 9  # frames 2..10: T0+1 .. T0+5
    assert snap.status_code == 200 and snap.headers["x-frame-seq"] == "10"
    assert alert_ev["ranges"] == [[T0 + 5, T0 + 7]]
    (alert_clip,) = get(with_log, alert_ev["clip"])
    assert alert_clip.status_code == 200 and alert_clip.headers["x-clip-frames"] == "5"
    assert without["text"] == "a van" and "evidence" not in without


# The clip a page's <video> (under ``box``) holds once it can play: [width, height, duration], or null.
_PLAYABLE = """(box) => { const v = document.querySelector(box + ' .evidence video');
  return v && !v.hidden && v.readyState >= 1 && v.videoWidth > 0
    ? [v.videoWidth, v.videoHeight, v.duration] : null; }"""


def test_the_page_plays_an_answers_and_an_alerts_evidence_clip(redis_url, frames_dir, request):
    """In headless Chromium: an answer with evidence shows a clip button; clicking it fetches the
    clip with the token and the <video> plays it at the frames' size. An opened alert does the same."""
    playwright = pytest.importorskip("playwright.sync_api")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"chromium not found at {CHROMIUM}")
    r = redis.Redis.from_url(redis_url)
    request.addfinalizer(r.close)
    r.hset(keys.meta(CAM), mapping={"fps": "2", "height": str(H), "width": str(W), "live": "1"})
    alert = Alert("a1", CAM, "door", "Is the door open?", 0.9, 0.5, 3, T0 + 5, T0 + 7, T0 + 8, None)
    r.xadd(keys.alerts(CAM), alert.fields())
    threading.Thread(target=_answer, args=(r, ((T0 + 1, T0 + 5),)), daemon=True).start()
    cfg = ApiConfig(redis_url=redis_url, framelog_dir=str(frames_dir), block_ms=100, token=TOKEN)
    with served(cfg) as base, playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            page.add_init_script(f"localStorage.setItem('svqa-token', {TOKEN!r})")
            page.goto(base + "/")
            card = page.locator(f'article.camera[data-stream="{CAM}"]')
            card.locator("input[name=question]").fill("What came?")
            card.locator("button[type=submit]").click()
            page.wait_for_function("document.querySelector('article.camera .answer:not(.streaming)')")
            assert card.locator(".answer").inner_text() == "a van"
            card.locator(".evidence button.clip").click()
            width, height, duration = page.wait_for_function(_PLAYABLE, arg="article.camera").json_value()
            assert [width, height] == [W, H]
            assert 4.0 <= duration <= 5.5, duration  # frames T0+1 .. T0+5, and the last one shown a while

            page.locator('#alerts li[data-alert="a1"]').click()
            page.locator("#evidence-dialog .evidence button.clip").click()
            width, height, duration = page.wait_for_function(_PLAYABLE, arg="#evidence-dialog").json_value()
            assert [width, height] == [W, H] and 2.0 <= duration <= 3.5, duration  # T0+5 .. T0+7
        finally:
            browser.close()


def test_clips_encoded_at_once_are_bounded_past_it_busy(redis_url, tmp_path):
    """Clip encoding was unbounded: a few requests for ten minutes of busy video took every core
    and hundreds of MB each, and a client that gave up did not stop its encode. One API process
    encodes at most max_clips at once; the next is a 503 busy with Retry-After, served once one ends."""
    w = FrameLog(tmp_path).writer(CAM, roll_s=600.0)
    for seq in range(120):  # a minute at 2 fps, big enough that an encode outlasts the second request
        assert w.append(seq, T0 + seq / 2, packed(seq, 448, 448))
    w.commit()
    w.close()
    cfg = ApiConfig(redis_url=redis_url, framelog_dir=str(tmp_path), max_clips=1)
    path = f"/api/streams/{CAM}/clip?from={T0}&to={T0 + 60}"

    async def run() -> list[httpx.Response]:
        async with api(cfg) as client:
            first, second = await asyncio.gather(client.get(path), client.get(path))
            return [first, second, await client.get(path)]

    first, second, after = asyncio.run(run())
    assert first.status_code == 200 and int(first.headers["X-Clip-Frames"]) == 120
    assert_error(second, 503, code="busy")
    assert "max_clips" in second.json()["error"]["message"] and second.headers["Retry-After"] == "5"
    assert after.status_code == 200
