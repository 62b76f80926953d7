"""The web page's video mode in a real headless Chromium (Debian's `chromium`, driven by Playwright): a video
model selects it by itself; a job shows its previews and progress, then plays its MP4, and the job list shows
the server's jobs."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("fastapi", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("av", reason="the videos API needs `pip install -e .[video]`")
sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs `pip install playwright`")

from diffusers_stepbatch.serve import ServeConfig, create_app, load_model

from .serve_helpers import ServerThread
from .test_serve_browser import CHROMIUM, CHROMIUM_FLAGS

if not os.path.exists(CHROMIUM) and not shutil.which("chromium") and not os.environ.get("CI"):
    pytest.skip("Debian's chromium is not installed (`apt-get install chromium`)", allow_module_level=True)


@pytest.fixture(scope="module")
def server():
    config = ServeConfig(model="tiny-wan")
    served = load_model(config)
    try:
        with ServerThread(create_app(config, model=served)) as url:
            yield url
    finally:
        served.close()


def test_video_mode_shows_previews_then_plays_the_mp4(server):
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(server + "/")
        page.wait_for_function("document.querySelector('#mode-video').getAttribute('aria-pressed') === 'true'")
        assert page.is_hidden("#form") and page.is_disabled("#mode-generate")
        page.fill("#video-steps", "12")
        page.fill("#video-frames", "9")
        page.fill("#video-seed", "4")
        page.click("#video-submit")
        page.wait_for_function("window.videosCompleted === 1", timeout=60_000)
        assert page.evaluate("window.videoPreviews") >= 1
        assert page.evaluate("document.querySelector('#gallery .card progress').value") == 100
        source = page.get_attribute("#gallery .card video", "src")
        assert source.startswith("blob:")
        page.wait_for_function("document.querySelector('#gallery video').readyState >= 2", timeout=10_000)
        assert page.evaluate("document.querySelector('#gallery video').videoWidth") == 32  # the browser decodes it
        page.wait_for_function("document.querySelectorAll('#video-jobs .job[data-status=completed]').length === 1",
                               timeout=10_000)
        page.fill("#video-size", "30x32")  # not multiples of 16: the server's 400 is shown
        page.click("#video-submit")
        page.wait_for_function("document.querySelector('#status').className === 'error'")
        assert "size='30x32'" in page.text_content("#status")
        browser.close()
