"""What an operator sees: `x-request-id` on every response, request histograms and engine gauges in
`/metrics`, `/health`, `/ready` and `/live` (503 once the engine thread died), JSON log lines naming requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("fastapi", reason="the server tests need `pip install -e .[serve,test]`")

from diffusers_stepbatch.serve import ServeConfig, create_app, load_model

from .serve_helpers import ServerThread, wait_for
from .test_serve import metric_value

ROOT = Path(__file__).resolve().parents[1]
MODEL = "toy-shapes"


@pytest.fixture(scope="module")
def served():
    model = load_model(ServeConfig())
    try:
        with ServerThread(create_app(ServeConfig(), model=model)) as url:
            yield url, model
    finally:
        model.close()


def test_every_response_carries_a_request_id(served):
    url, _ = served
    mine = httpx.get(f"{url}/v1/models", headers={"x-request-id": "client-7"})
    assert mine.headers["x-request-id"] == "client-7"
    ids = {httpx.get(f"{url}{path}").headers["x-request-id"] for path in ("/health", "/v1/nothing", "/", "/metrics")}
    assert len(ids) == 4 and all(len(i) == 32 for i in ids)  # new and distinct
    bad = httpx.post(f"{url}/v1/images/generations", json={"prompt": "x", "size": "nope"},
                     headers={"x-request-id": "a b;<c>" + "x" * 200})  # NOTE: unusable: replaced
    assert bad.status_code == 400 and len(bad.headers["x-request-id"]) == 32


def test_request_histograms_and_engine_gauges(served):
    url, model = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    before = httpx.get(f"{url}/metrics").text
    labels = {"endpoint": "generations", "model": MODEL}
    counts = {name: metric_value(before, f"{name}_count", **labels) for name in (
        "stepbatch_request_queue_seconds", "stepbatch_request_first_step_seconds", "stepbatch_request_step_seconds",
        "stepbatch_request_seconds")}
    for _ in range(2):
        client.images.generate(model=MODEL, prompt="a red circle", extra_body={"num_inference_steps": 3})
    after = httpx.get(f"{url}/metrics").text
    assert metric_value(after, "stepbatch_request_queue_seconds_count", **labels) == counts[
        "stepbatch_request_queue_seconds"] + 2
    assert metric_value(after, "stepbatch_request_first_step_seconds_count", **labels) == counts[
        "stepbatch_request_first_step_seconds"] + 2
    assert metric_value(after, "stepbatch_request_step_seconds_count", **labels) == counts[
        "stepbatch_request_step_seconds"] + 6  # 3 steps each
    assert metric_value(after, "stepbatch_request_seconds_count", **labels) == counts["stepbatch_request_seconds"] + 2
    assert metric_value(after, "stepbatch_request_seconds_sum", **labels) > 0
    rows = model.sb.stats()["rows_histogram"]["denoise"]
    assert metric_value(after, "stepbatch_forward_rows_count", kind="denoise") == sum(rows.values())
    assert metric_value(after, "stepbatch_forward_rows_bucket", kind="denoise", le="1") == rows.get(1, 0)

    # a long request in flight shows as running; the gauges go back to 0 when it is gone
    long = threading.Thread(target=lambda: httpx.post(f"{url}/v1/images/generations", timeout=120, json={
        "prompt": "a blue square", "num_inference_steps": 400}))
    long.start()
    assert wait_for(lambda: metric_value(httpx.get(f"{url}/metrics").text, "stepbatch_engine_requests",
                                         state="running", model=MODEL) == 1, timeout=30)
    long.join(120)
    text = httpx.get(f"{url}/metrics").text
    assert metric_value(text, "stepbatch_engine_requests", state="running", model=MODEL) == 0
    assert metric_value(text, "stepbatch_engine_requests", state="waiting", model=MODEL) == 0


def test_live_and_ready_while_loading():
    release = threading.Event()

    def slow_loader(config):
        release.wait(30)
        return load_model(config)

    with ServerThread(create_app(ServeConfig(), loader=slow_loader)) as url:
        assert httpx.get(f"{url}/live").status_code == 200
        assert httpx.get(f"{url}/ready").status_code == 503 and httpx.get(f"{url}/ready").json()["status"] == "loading"
        release.set()
        assert wait_for(lambda: httpx.get(f"{url}/ready").status_code == 200)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread we end
def test_a_dead_engine_thread_makes_health_503():
    model = load_model(ServeConfig())
    try:
        with ServerThread(create_app(ServeConfig(), model=model)) as url:
            ok = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a red circle", "num_inference_steps": 2})
            assert ok.status_code == 200 and httpx.get(f"{url}/health").status_code == 200
            engine = model.sb.engine

            def die(*args, **kwargs):
                raise SystemExit  # NOTE: ends the engine thread the way an uncaught error would

            engine._sleep_until_work = die  # the loop calls it next, once the request below is done
            httpx.post(f"{url}/v1/images/generations", json={"prompt": "a red circle", "num_inference_steps": 2})
            assert wait_for(lambda: not engine.is_alive, timeout=30)
            for path in ("/health", "/ready", "/live"):
                response = httpx.get(f"{url}{path}")
                assert response.status_code == 503 and response.json()["status"] == "engine_dead", path
            refused = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a red circle"})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_engine_dead"
    finally:
        model.close()


def test_json_log_lines_name_the_request(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    log = open(tmp_path / "log", "w")
    process = subprocess.Popen([sys.executable, "-m", "diffusers_stepbatch.serve", "--port", str(port),
                                "--log-format", "json"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_for(healthy, timeout=120, interval=0.2)
        response = httpx.post(f"{url}/v1/images/generations", headers={"x-request-id": "trace-json-1"},
                              json={"prompt": "a red circle", "num_inference_steps": 2}, timeout=60)
        assert response.status_code == 200
    finally:
        process.terminate()
        process.wait(60)
        log.close()
    lines = [json.loads(line) for line in (tmp_path / "log").read_text().splitlines() if line.startswith("{")]
    assert lines and all({"time", "level", "logger", "message", "request_id"} <= set(line) for line in lines)
    mine = [line for line in lines if line["request_id"] == "trace-json-1"]
    assert any("/v1/images/generations" in line["message"] and "200" in line["message"] for line in mine), mine


def test_video_job_gauges_by_status():
    pytest.importorskip("av", reason="the videos API needs PyAV")
    config = ServeConfig(model="tiny-wan")
    model = load_model(config)
    try:
        with ServerThread(create_app(config, model=model)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            assert metric_value(httpx.get(f"{url}/metrics").text, "stepbatch_video_jobs", status="completed") == 0
            video = client.videos.create(prompt="rain", extra_body={"num_frames": 5, "num_inference_steps": 2})
            assert wait_for(lambda: client.videos.retrieve(video.id).status == "completed", timeout=60)
            text = httpx.get(f"{url}/metrics").text
            assert metric_value(text, "stepbatch_video_jobs", status="completed") == 1
            assert metric_value(text, "stepbatch_video_jobs", status="queued") == 0
    finally:
        model.close()
