"""`diffusers_stepbatch.serve.ray` on a local Ray instance: examples/ray_serve.yaml with 2 toy replicas.

Requests spread over both replicas and all are answered; a replica killed under load fails its in-flight
requests with a 502 OpenAI error object (`serve.ray_proxy`; nothing hangs, nothing is lost silently) while the
other replica keeps serving.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray Serve test needs `pip install -e .[ray]`")
pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
yaml = pytest.importorskip("yaml")

from .ray_helpers import ROOT, local_ray_serve
from .serve_helpers import decode_b64, wait_for

USES_LOCAL_RAY = True  # conftest stops the shared instance after the last module that uses it
CONFIG = ROOT / "examples" / "ray_serve.yaml"
REPLICA_HEADER = "x-stepbatch-replica"


@pytest.fixture(scope="module")
def ray_app():
    from ray import serve

    from diffusers_stepbatch.serve.ray import DEPLOYMENT_NAME, build_app

    config = yaml.safe_load(CONFIG.read_text())
    application = config["applications"][0]
    deployment = next(d for d in application["deployments"] if d["name"] == DEPLOYMENT_NAME)
    options = {k: v for k, v in deployment.items() if k != "name"}
    assert options["num_replicas"] == 2
    url = local_ray_serve()
    serve.run(build_app({**application["args"], **options}), name=application["name"],
              route_prefix=application["route_prefix"])
    try:
        assert wait_for(lambda: _status(f"{url}/health") == 200, timeout=120, interval=0.5)
        yield url
    finally:
        serve.delete(application["name"])


def test_example_config_and_build_app_options():
    from ray.serve.schema import ServeDeploySchema

    from diffusers_stepbatch.serve.ray import build_app

    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    assert config.applications[0].import_path == "diffusers_stepbatch.serve.ray:build_app"
    autoscaled = build_app({"model": "toy", "max_batch_size": 4,
                            "autoscaling_config": {"min_replicas": 1, "max_replicas": 3}})
    deployment = autoscaled._bound_deployment  # NOTE: Ray-private attributes: what Ray will run
    assert deployment._deployment_config.autoscaling_config.max_replicas == 3
    with pytest.raises(ValueError, match="unknown ServeConfig fields \\['max_batch'\\]"):
        build_app({"model": "toy", "max_batch": 4})
    with pytest.raises(ValueError, match="max_batch_size=0"):
        build_app({"model": "toy", "max_batch_size": 0})  # checked in the driver, before any replica starts


def _answer(result: httpx.Response | Exception) -> str:
    if isinstance(result, Exception):
        return f"{type(result).__name__}: {result}"
    return f"{result.status_code} from {result.headers.get(REPLICA_HEADER)}"


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _replica_running(url: str) -> str | None:
    """The replica that answered this /metrics poll (Ray's proxy picks one) if its engine runs requests."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(f"{url}/metrics", timeout=5)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    running = any(sample.labels.get("state") == "running" and sample.value >= 1
                  for family in text_string_to_metric_families(response.text)
                  if family.name == "stepbatch_engine_requests" for sample in family.samples)
    return response.headers.get(REPLICA_HEADER) if running else None


def _generate(url: str, seed: int, steps: int = 20) -> httpx.Response | Exception:
    body = {"model": "toy-shapes", "prompt": "a red circle at the top left on a white background", "seed": seed,
            "num_inference_steps": steps}
    try:
        return httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
    except httpx.HTTPError as exc:
        return exc


def test_requests_spread_over_both_replicas_and_a_killed_replica_fails_only_its_own(ray_app):
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda s: _generate(ray_app, s), range(16)))
    assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in responses), responses
    replicas = {r.headers[REPLICA_HEADER] for r in responses}
    assert len(replicas) == 2, replicas
    assert all(decode_b64(r.json()["data"][0]["b64_json"]).size == (64, 64) for r in responses)
    # seed 0 alone, on either replica, is the seed-0 image of the burst bit for bit (docs/conformance.md)
    in_burst = np.asarray(decode_b64(responses[0].json()["data"][0]["b64_json"]))
    assert np.array_equal(np.asarray(decode_b64(_generate(ray_app, 0).json()["data"][0]["b64_json"])), in_burst)

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        # NOTE: 150 steps: the victim, a replica seen running its share, dies at once, so its requests are still
        # in flight and the other replica's have most of their steps to go
        load = [pool.submit(_generate, ray_app, 100 + i, 150) for i in range(24)]
        victim = wait_for(lambda: _replica_running(ray_app), timeout=60, interval=0.02)
        assert victim in replicas, (victim, replicas)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        killed_at = time.monotonic()
        results = [future.result(timeout=180) for future in load]
    ok = [r for r in results if isinstance(r, httpx.Response) and r.status_code == 200]
    failed = [r for r in results if r not in ok]
    answers = collections.Counter(map(_answer, results))  # NOTE: what the requests got, for the messages
    assert len(ok) + len(failed) == 24  # every request got an answer
    assert any(r.headers[REPLICA_HEADER] != victim for r in ok), (victim, answers)  # the other replica kept serving
    assert failed, "the killed replica had requests in flight; they must fail, not vanish"
    for r in failed:  # a clear OpenAI error object from the proxy (ray_proxy), which clients retry
        assert isinstance(r, httpx.Response) and r.status_code == 502, r
        assert r.json()["error"]["code"] == "replica_failed" and r.headers["retry-after"] == "1"
    survivors = [_generate(ray_app, 500 + i) for i in range(4)]
    assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in survivors)
    assert time.monotonic() - killed_at < 120


def test_a_replica_spanning_two_ranks_serves_with_context_parallelism(ray_app):
    import torch
    from ray import serve

    from diffusers_stepbatch.serve.ray import build_app
    from diffusers_stepbatch.toy import load_pipeline

    from .serve_helpers import TOY_CALL, pixels

    serve.run(build_app({"model": "toy", "context_parallel": "ulysses=2", "num_replicas": 1}), name="split",
              route_prefix="/split")
    try:
        url = f"{ray_app}/split"
        assert wait_for(lambda: _status(f"{url}/health") == 200, timeout=120, interval=0.5)
        response = _generate(url, seed=3, steps=6)
        assert isinstance(response, httpx.Response) and response.status_code == 200, _answer(response)
        stats = serve.get_app_handle("split").engine_stats.remote().result()
    finally:
        serve.delete("split")
    assert stats["parallel"]["split"] == ["transformer"] and stats["parallel"]["calls_relayed"] > 0, stats
    want = load_pipeline()("a red circle at the top left on a white background", height=64, width=64,
                           generator=torch.Generator().manual_seed(3),
                           **{**TOY_CALL, "num_inference_steps": 6}).images[0]
    got = decode_b64(response.json()["data"][0]["b64_json"])
    # PNG is lossless: only fp32 differences <= 1e-4 before uint8 rounding may flip a level
    assert np.abs(pixels(got) - pixels(want)).max() <= 1
