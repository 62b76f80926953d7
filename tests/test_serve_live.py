"""The live panel's data: `StepBatched.recent_calls` / `queue_lengths` and `GET /v1/engine/live` built on them."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")

MODEL = "toy-shapes"


def test_recent_calls_are_the_engines_calls_of_a_window_and_kind(served):
    sb = served.sb
    start = time.time()
    before = dict(sb.stats()["rows_histogram"].get("denoise", {}))
    sb(prompt="a red circle", num_inference_steps=3, height=64, width=64, max_sequence_length=16)
    calls = sb.recent_calls(time.time() - start + 0.01)
    denoise = sb.recent_calls(time.time() - start + 0.01, "denoise")
    after = sb.stats()["rows_histogram"]["denoise"]
    assert [c.kind for c in denoise] == ["denoise"] * 3 and len(calls) > len(denoise)  # encode and decode too
    assert sum(after.values()) - sum(before.values()) == 3
    assert all(c.time >= start for c in calls) and [c.time for c in calls] == sorted(c.time for c in calls)
    assert sb.recent_calls(0.0) == []
    assert sb.queue_lengths() == {"running": 0, "waiting": 0}


def test_the_live_panel_shows_shared_forwards_with_their_users(served, base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.images.generate(model=MODEL, prompt="a red circle", user="alice", stream=True, partial_images=3,
                                    extra_body={"num_inference_steps": 80})
    events = iter(stream)
    assert next(events).type == "image_generation.partial_image"  # alice's request is running now
    assert served.sb.queue_lengths()["running"] >= 1
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        bob = pool.submit(client.images.generate, model=MODEL, prompt="a blue square", user="bob",
                          extra_body={"num_inference_steps": 20})
        assert len(bob.result().data) == 1
    assert list(events)[-1].type == "image_generation.completed"
    live = httpx.get(f"{base_url}/v1/engine/live", params={"seconds": 60}).json()
    assert (live["running"], live["waiting"]) == (0, 0)
    shared = [f for f in live["forwards"] if f["users"] == ["alice", "bob"]]
    assert shared and all(f["rows"] == 2 for f in shared), live["forwards"][:5]
    assert {r["user"] for r in live["requests"]} >= {"alice", "bob"}
    assert len(live["forwards"]) == len(served.sb.recent_calls(60, "denoise"))
