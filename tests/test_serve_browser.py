"""The web page at `/` in a real headless Chromium (Debian's `chromium` package, driven by Playwright).

Three tabs generate at once: each shows its partial images as they stream, then its result in its gallery,
and the live panel shows forwards holding rows of several tabs. One tab edits an uploaded image with a mask
drawn with the mouse.
"""

from __future__ import annotations

import base64
import io
import os
import shutil

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("fastapi", reason="the server tests need `pip install -e .[serve,test]`")
sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs `pip install playwright`")

from diffusers_stepbatch.serve import ServeConfig, create_app, load_model
from diffusers_stepbatch.toy.judge import judge_image, score_images
from diffusers_stepbatch.toy.scenes import Scene, render_scene

from .serve_helpers import ServerThread

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# NOTE: nothing may reach outside this machine: no background services, updates, sync or first-run pages
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
CAPTIONS = [
    "a red circle at the top left on a white background",
    "a blue square at the bottom right on a black background",
    "a yellow triangle in the center on a gray background",
]
SCREENSHOTS = os.environ.get("STEPBATCH_SCREENSHOTS")  # a folder to keep the screenshots in (to look at them)

if not os.path.exists(CHROMIUM) and not os.environ.get("CI"):
    pytest.skip("Debian's chromium is not installed (`apt-get install chromium`; .ci/run does)", allow_module_level=True)


@pytest.fixture(scope="module")
def server():
    served = load_model(ServeConfig(max_batch_size=8))
    try:
        with ServerThread(create_app(ServeConfig(), model=served)) as url:
            yield url, served
    finally:
        served.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        yield browser
        browser.close()


def card_image(page, index: int = 0) -> Image.Image:
    source = page.locator("#gallery .card img").nth(index).get_attribute("src")
    assert source.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1]))).convert("RGB")


def screenshot(page, name: str, tmp_path) -> None:
    folder = SCREENSHOTS or str(tmp_path)
    os.makedirs(folder, exist_ok=True)
    page.screenshot(path=os.path.join(folder, name), full_page=True)


def test_three_tabs_stream_partial_images_share_batches_and_the_live_panel_shows_it(server, browser, tmp_path):
    url, served = server
    pages = []
    for seed, caption in enumerate(CAPTIONS):
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(url + "/")
        page.wait_for_function("document.querySelector('#size').options.length > 10")  # sizes from /v1/models
        page.fill("#prompt", caption)
        page.fill("#steps", "60")
        page.fill("#seed", str(seed))
        pages.append(page)
    before = dict(served.sb.stats()["rows_histogram"].get("denoise", {}))
    for page in pages:  # all three in flight at once
        page.click("#submit")
    images = []
    for page in pages:
        page.wait_for_function("window.completed === true", timeout=90_000)
        assert page.evaluate("window.partialsShown") == 3
        assert page.text_content("#status").startswith("done: 64x64")
        assert "60 steps" in page.text_content("#gallery .card .meta")
        images.append(card_image(page))
    # the live panel (polled every 0.5 s) showed a forward holding rows of at least two tabs
    pages[0].wait_for_function("window.liveMaxUsers >= 2", timeout=30_000)
    shared = pages[0].locator("#live-shared .shared-forward").first
    tabs = {page.evaluate("window.tabId") for page in pages}
    users = shared.get_attribute("data-users").split()
    assert int(shared.get_attribute("data-rows")) >= 2 and len(users) >= 2 and set(users) <= tabs, users
    screenshot(pages[0], "three_tabs.png", tmp_path)
    for page in pages:
        page.close()
    assert [image.size for image in images] == [(64, 64)] * 3
    scores = score_images(images, CAPTIONS)
    assert scores.color >= 2 / 3 and scores.position >= 2 / 3, scores
    after = served.sb.stats()["rows_histogram"]["denoise"]
    assert sum(count - before.get(rows, 0) for rows, count in after.items() if rows > 1) > 0, after


def test_edit_with_a_mask_drawn_with_the_mouse(server, browser, tmp_path):
    url, _ = server
    original = render_scene(Scene("blue", "square", "at the bottom right", "white"), 64)
    path = tmp_path / "base.png"
    original.save(path)
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(url + "/")
    page.click("#mode-edit")
    page.set_input_files("#edit-image", str(path))
    page.wait_for_function("document.querySelector('#mask-canvas').width === 64")
    box = page.locator("#mask-canvas").bounding_box()  # 256 css px for 64 image px
    page.fill("#brush", "40")
    page.mouse.move(box["x"] + 20, box["y"] + 20)
    page.mouse.down()
    for y in range(20, 120, 12):  # paint the top-left quadrant, row by row
        page.mouse.move(box["x"] + 20, box["y"] + y)
        page.mouse.move(box["x"] + 110, box["y"] + y, steps=4)
    page.mouse.up()
    page.fill("#prompt", "a red circle at the top left on a white background")
    page.fill("#steps", "20")
    page.fill("#strength", "1")
    page.fill("#seed", "4")
    page.click("#submit")
    page.wait_for_function("window.completed === true", timeout=90_000)
    assert page.text_content("#status").startswith("done: 64x64")
    meta = page.text_content("#gallery .card .meta")
    assert "edit" in meta and "mask drawn" in meta and "strength 1" in meta
    screenshot(page, "edit.png", tmp_path)
    edited = np.asarray(card_image(page))
    page.close()
    top_left = judge_image(edited[:32, :32])
    assert top_left.color == "red" and top_left.foreground_fraction > 0.1, top_left
    bottom_right = judge_image(edited[32:, 32:])
    assert bottom_right.color == "blue", bottom_right  # outside the drawn mask the square stays
