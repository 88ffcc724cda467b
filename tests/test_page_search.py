"""The page's search and its questions about the past, in headless Chromium against the real API
(on uvicorn, with a token): two cameras' frames encoded and indexed beside their frames logs, and a
worker with a tiny random-weight model answering searches and questions (tests/test_search.py's
world). Oracles: the page's results come in the order, with the scores, computed independently from
transformers' own forward (tests/retrieval_oracle.py), made into moments (tests/test_search.py's
`moments_oracle`), each thumbnail is its best chunk's middle frame;
an answer shows as ranges exactly the chunks the worker must have chosen; refusals are the API's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import datetime
from zoneinfo import ZoneInfo

import httpx
import numpy as np
import pytest

from api.config import ApiConfig
from common.engine.spans import capture_ranges
from tests import test_search
from tests.test_api import CHROMIUM, CHROMIUM_ARGS, TOKEN, served
from tests.test_search import CAMS, FRAMES, QUERY, T0, answering, moments_oracle, oracle
from tests.test_search_index import CHUNK, FPS, GRID

rt, world = test_search.rt, test_search.world  # its fixtures, made again for this module

ZONE = "Asia/Kolkata"  # the browser's: UTC+05:30, so a time typed without an offset must get one
PHONE = {"width": 390, "height": 844}
SEARCH_LIMIT = 24  # the page's (api/web/app.js)

# Each search result's thumbnail as RGBA pixels, in the page's order (drawn from the loaded <img>).
_THUMBNAILS = """() => [...document.querySelectorAll('#search .results img')].map((img) => {
  const c = Object.assign(document.createElement('canvas'), {width: img.naturalWidth, height: img.naturalHeight});
  const g = c.getContext('2d');
  g.drawImage(img, 0, 0);
  return Array.from(g.getImageData(0, 0, c.width, c.height).data);
})"""
# The dialog's clip once it has played: [width, duration], or null.
_PLAYED = """() => { const v = document.querySelector('#evidence-dialog video');
  return v && !v.hidden && v.videoWidth > 0 && v.played.length > 0 && v.currentTime > 0
    ? [v.videoWidth, v.duration] : null; }"""
# The clip of a card's evidence once it can play: its duration, or null.
_PLAYABLE = """(card) => { const v = document.querySelector(card + ' .evidence video');
  return v && !v.hidden && v.readyState >= 1 && v.videoWidth > 0 ? v.duration : null; }"""


@pytest.fixture
def page(world) -> Iterator:
    """The page of an API over the world (a token set, the page given it), at a phone's width."""
    playwright = pytest.importorskip("playwright.sync_api")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"chromium not found at {CHROMIUM}")
    cfg = ApiConfig(redis_url=world["url"], framelog_dir=str(world["log"]), block_ms=100, token=TOKEN)
    with served(cfg) as base, playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport=PHONE, timezone_id=ZONE)
            page.set_default_timeout(60_000)
            page.add_init_script(f"localStorage.setItem('svqa-token', {TOKEN!r})")
            page.goto(base + "/")
            for cam in CAMS:
                page.locator(f'form.search select[name=stream] option[value="{cam}"]').wait_for(state="attached")
            yield page
        finally:
            browser.close()


def no_sideways_overflow(page) -> None:
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"], "sideways overflow at 390 px"


def search(page, q: str, **fields: str) -> str:
    """What the search says of itself: its results' count, or its error."""
    form = page.locator("form.search")
    form.locator("input[name=q]").fill(q)
    form.locator("select[name=stream]").select_option(fields.pop("stream", ""))
    form.locator("select[name=preset]").select_option(fields.pop("preset", ""))
    for name, value in fields.items():
        form.locator(f"input[name={name}]").fill(value)
    form.locator("button[type=submit]").click()
    page.wait_for_function("!document.querySelector('form.search button[type=submit]').disabled")
    return page.locator("#search .search-status").inner_text()


def shown(page) -> list[tuple[str, float, str]]:
    """(camera, score, time range text) of each result, in the page's order."""
    return page.evaluate(
        """() => [...document.querySelectorAll('#search .results .result')].map((b) =>
             [b.dataset.stream, Number(b.dataset.score), b.querySelector('.time').textContent])"""
    )


def fmt_range(page, start: float, end: float) -> str:
    return page.evaluate("([s, e]) => fmtRange(s, e)", [start, end])


def test_a_search_shows_thumbnails_in_score_order_and_a_result_plays_its_clip(rt, world, page):
    with answering(rt, world):
        status = search(page, QUERY)
        assert "best first" in status, status
        expected = moments_oracle(oracle(rt, world, QUERY), SEARCH_LIMIT)
        results = shown(page)
        assert [cam for cam, _, _ in results] == [cam for _, cam, _, _, _ in expected], "the oracle's order"
        np.testing.assert_allclose([s for _, s, _ in results], [s for s, _, _, _, _ in expected], atol=2e-3)
        assert [s for _, s, _ in results] == sorted((s for _, s, _ in results), reverse=True)
        times = [fmt_range(page, T0 + first / FPS, T0 + last / FPS) for _, _, _, first, last in expected]
        assert [t for _, _, t in results] == times

        page.wait_for_function("[...document.querySelectorAll('#search .results img')].every((i) => i.naturalWidth)")
        for thumb, (_, cam, best, _, _) in zip(page.evaluate(_THUMBNAILS), expected, strict=True):
            pixels = np.array(thumb, np.uint8).reshape(GRID.height, GRID.width, 4)[..., :3].astype(np.int16)
            error = [np.abs(pixels - f).mean() for f in world["frames"][cam]]
            middle = best + (CHUNK - 1) / 2  # the best chunk's middle, between two frames: the snapshot is either
            assert np.argmin(error) in (int(middle), int(middle) + 1), (cam, best, error)
        no_sideways_overflow(page)

        page.locator("#search .results .result").first.click()  # the best: its clip plays
        width, duration = page.wait_for_function(_PLAYED).json_value()
        seconds = (expected[0][4] + 1 - expected[0][3]) / FPS  # the moment's frames, 0.5 s apart
        assert width == GRID.width and seconds - 0.6 <= duration <= seconds + 0.6, (duration, seconds)
        dialog = page.locator("#evidence-dialog")
        assert dialog.locator("#evidence-title").inner_text() == f"{expected[0][1]} · {times[0]}"
        assert dialog.locator("button.ack").is_hidden()
        page.wait_for_function("document.querySelector('#evidence-dialog img.picture').naturalWidth > 0")
        page.keyboard.press("Escape")
        page.wait_for_function("(d) => !d.open", arg=dialog.element_handle())

        page.locator("#search .results .result").nth(1).focus()  # by keyboard
        page.keyboard.press("Enter")
        page.wait_for_function(_PLAYED)
        assert dialog.locator("#evidence-title").inner_text() == f"{expected[1][1]} · {times[1]}"
        page.keyboard.press("Escape")

        # one camera, a span typed as local times without an offset (the browser's zone's)
        local = [datetime.fromtimestamp(t, ZoneInfo(ZONE)).replace(tzinfo=None) for t in (T0 + 4.1, T0 + 5.9)]
        since, until = (t.isoformat(timespec="milliseconds") for t in local)
        search(page, QUERY, stream="yard", preset="custom", since=since, until=until)
        assert [(cam, t) for cam, _, t in shown(page)] == [("yard", fmt_range(page, T0 + 4.0, T0 + 5.5))]


def test_a_question_about_the_past_shows_the_ranges_it_saw_and_plays_each(rt, world, page):
    budget = len(rt.prefix_ids()) + 2 * 8  # 2 chunks of 2 temporal patches of 4 tokens
    card = page.locator('article.camera[data-stream="gate"]')
    form = card.locator("form.ask")

    def ask(preset: str = "", history: bool = False, **fields: str) -> None:
        form.locator("input[name=question]").fill(QUERY)
        form.locator("select[name=preset]").select_option(preset)
        for name, value in fields.items():
            form.locator(f"input[name={name}]").fill(value)
        form.locator("input[name=scope]").set_checked(history)
        form.locator("button[type=submit]").click()
        page.wait_for_function("document.querySelector('article.camera[data-stream=gate] .answer:not(.streaming)')")

    def ranges() -> list[tuple[float, float]]:
        found = card.locator(".evidence .ranges button[data-from]")
        return [(float(b.get_attribute("data-from")), float(b.get_attribute("data-to"))) for b in found.all()]

    with answering(rt, world, history_max_tokens=budget):
        ask("1h")  # the last hour: two chunks evenly spaced over it, the first and the last
        assert card.locator(".answer.failed").count() == 0, card.locator(".answer").inner_text()
        first, last = (T0, T0 + (CHUNK - 1) / FPS), (T0 + (FRAMES - CHUNK) / FPS, T0 + (FRAMES - 1) / FPS)
        np.testing.assert_allclose(ranges(), [first, last], atol=1e-3)
        assert "the past: 2 range(s)" in card.locator(".answer-meta").inner_text()
        card.locator(".evidence .ranges button.range").nth(1).click()
        assert 1.4 <= page.wait_for_function(_PLAYABLE, arg="article.camera[data-stream=gate]").json_value() <= 2.6
        assert card.locator(".ranges button.range").nth(1).get_attribute("aria-current") == "true"
        whole = card.locator(".evidence .ranges button.clip")  # the evidence's clip: first to last
        assert whole.inner_text() == f"▶ in one clip: {fmt_range(page, first[0], last[1])}"
        whole.click()
        page.wait_for_function("document.querySelector('article.camera[data-stream=gate] button.clip[aria-current]')")
        assert 7.4 <= page.wait_for_function(_PLAYABLE, arg="article.camera[data-stream=gate]").json_value() <= 8.6
        no_sideways_overflow(page)

        ask(history=True)  # search the past: the best two chunks, oldest first, adjacent ones as one range
        best = sorted([seq for _, cam, seq in oracle(rt, world, QUERY) if cam == "gate"][:2])
        chunks = [((b, b + CHUNK - 1), (T0 + b / FPS, T0 + (b + CHUNK - 1) / FPS)) for b in best]
        np.testing.assert_allclose(ranges(), capture_ranges(chunks), atol=1e-3)

        ask("custom", since="5m")  # nothing kept since: the worker's error, shown
        assert "holds no frame" in card.locator(".answer.failed").inner_text()
        assert card.locator(".evidence").is_hidden()


def test_the_page_shows_the_apis_refusals_plainly(world, page):
    """A bad since (400 naming it) in a question and in a search: the API's message, the field
    marked; a busy API (503, Retry-After): said so, with when to try again. No worker: nothing
    here is answered."""
    card = page.locator('article.camera[data-stream="gate"]')
    form = card.locator("form.ask")
    form.locator("input[name=question]").fill(QUERY)
    form.locator("select[name=preset]").select_option("custom")
    form.locator("input[name=since]").fill("yesterday")
    form.locator("button[type=submit]").click()
    failed = card.locator(".answer.failed")
    assert failed.inner_text().startswith("since:") and "'yesterday'" in failed.inner_text()
    assert form.locator("input[name=since]").get_attribute("aria-invalid") == "true"

    search(page, QUERY, preset="custom", since="", until="1h")  # until without since
    status = page.locator("#search .search-status.failed")
    assert status.inner_text().startswith("until:"), status.inner_text()
    assert page.locator("form.search input[name=until]").get_attribute("aria-invalid") == "true"
    assert page.locator("#search .results li").count() == 0

    busy = ApiConfig(redis_url=world["url"], block_ms=100, token=TOKEN, max_answers=1, keep_alive_s=0.2)
    with served(busy) as other:
        page.goto(other + "/")
        page.locator('form.search option[value="gate"]').wait_for(state="attached")
        held = {"question": "anyone?"}  # holds the process's one answer: no worker answers it
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.stream("POST", f"{other}/api/streams/gate/ask", json=held, headers=auth, timeout=30):
            search(page, QUERY)
        text = page.locator("#search .search-status.failed").inner_text()
        assert text.startswith("busy:") and text.endswith("(try again in 1 s)"), text
        assert page.locator('form.search input[name="q"]').get_attribute("aria-invalid") is None
