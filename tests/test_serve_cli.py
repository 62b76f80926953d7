"""`python -m diffusers_stepbatch.serve` as a process: flags, readiness, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server tests need `pip install -e .[serve,test]`")
httpx = pytest.importorskip("httpx")

from diffusers_stepbatch.serve.cli import add_serve_arguments, config_from_args, main

from .serve_helpers import decode_b64, wait_for
from .ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_flags_become_the_engine_config():
    import argparse

    parser = add_serve_arguments(argparse.ArgumentParser())
    config = config_from_args(parser.parse_args(
        ["--max-batch-size", "4", "--policy", "sjf", "--max-queue", "0", "--pid-exit-step", "0.8",
         "--api-key", "k", "--served-model-name", "shapes", "--no-cost-aware", "--burst-wait-s", "0.01",
         "--burst-settle-s", "0.002"]))
    scheduler = config.scheduler_config()
    assert (scheduler.max_batch_size, scheduler.policy, scheduler.max_queue, scheduler.cost_aware,
            scheduler.burst_wait_s, scheduler.burst_settle_s) == (4, "sjf", None, False, 0.01, 0.002)
    assert config.pid_exit_step == 0.8 and config.api_key == "k" and config.model_name == "shapes"
    assert config_from_args(parser.parse_args(["--pid-exit-step", "8"])).pid_exit_step == 8


def test_api_key_from_the_environment(monkeypatch):
    from diffusers_stepbatch.serve import ServeConfig

    monkeypatch.setenv("DIFFUSERS_STEPBATCH_API_KEY", "from-env")
    assert ServeConfig().api_key == "from-env"
    assert ServeConfig(api_key="").api_key is None  # "" switches the key off


def test_bad_flags_fail_with_the_config_message(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--max-batch-size", "0"])
    assert exit_.value.code == 2 and "max_batch_size=0 must be >= 1" in capsys.readouterr().err


def test_help_and_flag_checks_import_neither_torch_nor_diffusers():
    # NOTE: the package's names load on first use; `--help` took 6 s here while it imported torch and diffusers
    code = ("import sys\nfrom diffusers_stepbatch.serve.cli import main\n"
            "for argv in (['serve', '--help'], ['serve', '--max-batch-size', '0']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(name for name in ('torch', 'diffusers', 'transformers', 'fastapi') if name in sys.modules))")
    done = _python(code)
    assert "--max-batch-size" in done.stdout and "max_batch_size=0 must be >= 1" in done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_package_names_load_on_first_use():
    code = ("import sys, diffusers_stepbatch as d\nassert 'torch' not in sys.modules\n"
            "from diffusers_stepbatch import *\nfrom diffusers_stepbatch.wrapper import StepBatched\n"
            "assert d.StepBatched is StepBatched and set(d.__all__) <= set(dir(d))\n"
            "print(sorted(name for name in d.__all__ if name not in globals()))")
    assert _python(code).stdout.strip().splitlines()[-1] == "[]"


def _python(code: str) -> subprocess.CompletedProcess:
    """`code` run by this interpreter in a fresh process (a clean sys.modules); it must succeed."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done


def test_sigterm_finishes_in_flight_requests_then_exits():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    process = subprocess.Popen(
        [sys.executable, "-m", "diffusers_stepbatch.serve", "--port", str(port), "--shutdown-timeout", "5",
         "--no-access-log", "--log-level", "warning", "--max-steps", "100000"],  # NOTE: lets "endless" in
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def healthy():
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_for(healthy, timeout=120, interval=0.2), "the server never became healthy"
        results: dict[str, object] = {}

        def post(name: str, steps: int) -> None:
            try:
                results[name] = httpx.post(f"{url}/v1/images/generations", timeout=120,
                                           json={"prompt": "a red circle", "num_inference_steps": steps})
            except httpx.HTTPError as exc:
                results[name] = exc

        threads = [threading.Thread(target=post, args=(f"short{i}", 120)) for i in range(3)]
        threads.append(threading.Thread(target=post, args=("endless", 100_000)))
        for thread in threads:
            thread.start()

        def all_in_flight():
            text = httpx.get(f"{url}/metrics", timeout=5).text
            line = next(line for line in text.splitlines() if line.startswith("stepbatch_http_generations_in_flight"))
            return float(line.split()[-1]) >= 4  # accepted by the engine, not only received

        assert wait_for(all_in_flight, timeout=30)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.post(f"{url}/v1/images/generations", json={"prompt": "a red circle"}, timeout=5)
        # NOTE: uvicorn re-raises the signal once it has shut down, so the exit is "killed by SIGTERM", as
        # supervisors expect of a process that honoured it
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
        took = time.monotonic() - signalled
        for thread in threads:
            thread.join(30)
    finally:
        if process.poll() is None:
            process.kill()
    log = process.stdout.read()
    for i in range(3):  # in flight at SIGTERM: they finish
        response = results[f"short{i}"]
        assert isinstance(response, httpx.Response) and response.status_code == 200, (response, log)
        assert decode_b64(response.json()["data"][0]["b64_json"]).size == (64, 64)
    # longer than --shutdown-timeout: cut off (its request aborted in the engine), and the process still exits
    assert not (isinstance(results["endless"], httpx.Response) and results["endless"].status_code == 200)
    assert 5 <= took < 35, (took, results["endless"], log[-3000:])


def test_load_model_builds_the_engine_the_flags_describe():
    import numpy as np
    import torch

    from diffusers_stepbatch.serve import ServeConfig, load_model

    config = ServeConfig(max_batch_size=3, policy="sjf", max_queue=5, teacache=0.4)
    model = load_model(config)
    exact = load_model(ServeConfig())
    try:
        assert model.sb.engine.config == config.scheduler_config()
        assert model.name == "toy-shapes" and model.call_defaults["max_sequence_length"] == 16
        call = {"prompt": "a red circle at the top left on a white background", "num_inference_steps": 20}
        cached, plain = (
            np.asarray(m.sb(**call, **{k: v for k, v in m.call_defaults.items() if k not in call},
                            generator=torch.Generator().manual_seed(0)).images[0], dtype=np.int16)
            for m in (model, exact))
        assert 0 < np.abs(cached - plain).mean() < 10  # TeaCache skipped steps: close to, not equal to, exact
    finally:
        model.close()
        exact.close()


def test_load_model_from_a_local_folder(tmp_path):
    """`--model PATH`: any saved diffusers pipeline through DiffusionPipeline.from_pretrained, offline; without
    `guidance_embeds`, a FluxPipeline folder gets FLUX.1 schnell's preset."""
    from diffusers_stepbatch.serve import ServeConfig, load_model
    from diffusers_stepbatch.testing import tiny_flux_pipeline

    tiny_flux_pipeline().save_pretrained(tmp_path)
    model = load_model(ServeConfig(model=str(tmp_path)))
    try:
        assert model.name == str(tmp_path) and model.preset == "black-forest-labs/FLUX.1-schnell"
        assert model.call_defaults == {"height": 1024, "width": 1024, "num_inference_steps": 4,
                                       "guidance_scale": 0.0, "max_sequence_length": 256}
        assert type(model.sb.pipe).__name__ == "FluxPipeline"
        image = model.sb("a cat", height=32, width=32, num_inference_steps=2, max_sequence_length=16).images[0]
        assert image.size == (32, 32)
    finally:
        model.close()


def test_run_serves_a_pipeline_built_in_python_with_the_clis_shutdown(tmp_path):
    """`run(config, model=serve_pipeline(...))`: the CLI's server (graceful SIGTERM) around your own pipeline."""
    port = free_port()
    code = ("from diffusers_stepbatch.serve import ServeConfig, serve_pipeline\n"
            "from diffusers_stepbatch.serve.cli import run\n"
            "from diffusers_stepbatch.testing import tiny_flux_pipeline\n"
            f"config = ServeConfig(port={port}, served_model_name='mine')\n"
            "run(config, model=serve_pipeline(tiny_flux_pipeline(), config, call_defaults={'num_inference_steps': 2,"
            " 'max_sequence_length': 16, 'height': 32, 'width': 32}), log_level='warning')\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_for(healthy, timeout=120, interval=0.2), "the server never became healthy"
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert card["id"] == "mine" and card["call_defaults"]["num_inference_steps"] == 2
        response = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat"}, timeout=60)
        assert response.status_code == 200 and decode_b64(response.json()["data"][0]["b64_json"]).size == (32, 32)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
