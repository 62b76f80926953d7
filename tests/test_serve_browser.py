"""The web page at `/` in a real headless Chromium (Debian's `chromium` package, driven by Playwright).

Three tabs generate at once: each shows its partial images as they stream, then its result, and their
requests share the engine's batches.
"""

from __future__ import annotations

import base64
import io
import os
import shutil

import pytest
from PIL import Image

pytest.importorskip("fastapi", reason="the server tests need `pip install -e .[serve,test]`")
sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs `pip install playwright`")

from diffusers_stepbatch.serve import ServeConfig, create_app, load_model
from diffusers_stepbatch.toy.judge import score_images

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

if not os.path.exists(CHROMIUM) and not os.environ.get("CI"):
    pytest.skip("Debian's chromium is not installed (`apt-get install chromium`; .ci/run does)", allow_module_level=True)


def test_three_tabs_stream_partial_images_and_share_batches(tmp_path):
    served = load_model(ServeConfig(max_batch_size=8))
    try:
        with ServerThread(create_app(ServeConfig(), model=served)) as url, sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
            pages = []
            for seed, caption in enumerate(CAPTIONS):
                page = browser.new_page()
                page.goto(url + "/")
                page.fill("#prompt", caption)
                page.fill("#steps", "60")
                page.fill("#seed", str(seed))
                pages.append(page)
            for page in pages:  # all three in flight at once
                page.click("#generate")
            images = []
            for page in pages:
                page.wait_for_function("window.completed === true", timeout=90_000)
                assert page.evaluate("window.partialsShown") == 3
                assert page.text_content("#status").startswith("done: 64x64")
                source = page.get_attribute("#image", "src")
                assert source.startswith("data:image/png;base64,")
                images.append(Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1]))).convert("RGB"))
            pages[0].screenshot(path=str(tmp_path / "page.png"))
            browser.close()
    finally:
        served.close()
    assert [image.size for image in images] == [(64, 64)] * 3
    scores = score_images(images, CAPTIONS)
    assert scores.color >= 2 / 3 and scores.position >= 2 / 3, scores
    denoise = served.sb.stats()["rows_histogram"]["denoise"]
    assert sum(count for rows, count in denoise.items() if rows > 1) > 0, denoise  # the tabs shared forwards
