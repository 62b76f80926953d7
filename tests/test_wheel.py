"""The built wheel, installed non-editable in a fresh venv, serves a working page: every static asset is package
data, the `diffusers-stepbatch` console script starts the server, and Chromium loads the page with no failed
request and makes one image with it.

The fresh venv reuses this interpreter's installed dependencies (a path line in a `.pth` file, so torch is not
installed again) but not this checkout: the project itself comes only from the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server tests need `pip install -e .[serve,test]`")
httpx = pytest.importorskip("httpx")

from .test_serve_browser import CHROMIUM, CHROMIUM_FLAGS
from .ports import free_port

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "diffusers_stepbatch" / "serve" / "static"
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "*.egg-info", "outputs", "__pycache__",
                                     ".pytest_cache", ".hypothesis", "site", ".whl")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source") / "project"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)  # NOTE: a copy: the build leaves build/ and egg-info behind
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(out), str(source)], check=True, timeout=300)
    (built,) = out.glob("diffusers_stepbatch-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # NOTE: a plain path line: the dependencies are found there, but its .pth files (this checkout's editable
    # install among them) are not run
    dependencies = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "stepbatch_test_dependencies.pth").write_text("\n".join(sorted(dependencies)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    str(wheel)], check=True, timeout=300)
    return venv


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def test_the_wheel_holds_every_static_asset(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assets = sorted(path.name for path in STATIC.iterdir() if path.is_file())
    assert {"index.html", "app.js", "video.js"} <= set(assets)
    missing = [name for name in assets if f"diffusers_stepbatch/serve/static/{name}" not in names]
    assert missing == [], f"not package data: {missing}"


def test_installed_wheel_serves_the_page_and_a_generation_in_chromium(installed, tmp_path):
    python, script = installed / "bin" / "python", installed / "bin" / "diffusers-stepbatch"
    found = subprocess.run([str(python), "-c", "import diffusers_stepbatch; print(diffusers_stepbatch.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=_clean_env())
    assert found.returncode == 0, found.stderr[-3000:]
    assert found.stdout.startswith(str(installed)), found.stdout  # the wheel's copy, not this checkout
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([str(script), "serve", "--port", str(port), "--log-level", "warning"], cwd=tmp_path,
                              env=_clean_env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the installed server did not become healthy"
            time.sleep(0.2)
        page_html = httpx.get(url + "/", timeout=10).text
        for asset in ("/static/app.js", "/static/video.js"):
            assert asset in page_html
            response = httpx.get(url + asset, timeout=10)
            assert response.status_code == 200 and len(response.text) == len((STATIC / Path(asset).name).read_text())
        if not os.path.exists(CHROMIUM):
            if os.environ.get("CI"):
                pytest.fail(f"{CHROMIUM} is missing in CI")
            pytest.skip("Debian's chromium is not installed (`apt-get install chromium`); the HTTP checks passed")
        _generate_in_chromium(url, tmp_path)
    finally:
        server.terminate()
        server.wait(60)
        log.close()


def _generate_in_chromium(url: str, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1000, "height": 800})
        failed: list[str] = []
        page.on("requestfailed", lambda request: failed.append(f"{request.url}: {request.failure}"))
        page.on("response", lambda response: response.status >= 400 and failed.append(
            f"{response.url}: {response.status}"))
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(url + "/")
        page.wait_for_function("document.querySelector('#size').options.length > 10")  # app.js ran: sizes loaded
        page.fill("#prompt", "a red circle at the top left on a white background")
        page.fill("#steps", "8")
        page.fill("#seed", "1")
        page.click("#submit")
        page.wait_for_function("window.completed === true", timeout=90_000)
        assert page.text_content("#status").startswith("done: 64x64")
        assert page.locator("#gallery .card img").count() == 1
        page.screenshot(path=str(tmp_path / "wheel_page.png"), full_page=True)
        browser.close()
    assert failed == [] and errors == [], (failed, errors)
