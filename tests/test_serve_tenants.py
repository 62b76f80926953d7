"""Tenants (`--api-keys`): each key's limits (429 with `Retry-After`, 400 for sizes), its priority cap, and
isolation: another tenant's job is a 404 on every route, the live panel shows it as counts and shapes only.
Driven by the official `openai` client against the tiny Wan 2.1 pipeline (videos) and the toy model (images).
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("sqlalchemy", reason="the job store needs `pip install -e .[serve]`")
pytest.importorskip("av", reason="the videos API needs `pip install -e .[video]`")

from diffusers_stepbatch.serve import ServeConfig, create_app, load_model
from diffusers_stepbatch.serve.tenants import load_api_keys

from .references import engine_held
from .serve_helpers import ServerThread, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
KEYS = """
[[keys]]
key = "sk-alice"
tenant = "alice"
max_concurrent_video_jobs = 2
max_priority = 0
max_pixels = 1024
max_frames = 9
max_steps = 50

[[keys]]
key = "sk-bob"
tenant = "bob"

[[keys]]
key = "sk-carol"
tenant = "carol"
requests_per_minute = 2

[[keys]]
key = "sk-ops"
tenant = "ops"
admin = true

[[keys]]
key = "sk-dave"
tenant = "dave"
max_concurrent_requests = 1
"""
SHORT = {"num_frames": 5, "num_inference_steps": 2}
HOLD = dict(prompt="hold", num_frames=5, height=16, width=16, num_inference_steps=2, max_sequence_length=16,
            output_type="pt", seed=0)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    return str(path)


@pytest.fixture(scope="module")
def wan():
    model = load_model(ServeConfig(model="tiny-wan", max_batch_size=16))
    yield model
    model.close()


@pytest.fixture(scope="module")
def url(wan, keys_file):
    with ServerThread(create_app(ServeConfig(api_keys=keys_file, video_fps=4), model=wan)) as base_url:
        yield base_url


def client(url: str, key: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def finished(c, video_id: str):
    video = wait_for(lambda: (v := c.videos.retrieve(video_id)).status in ("completed", "failed") and v, 60)
    assert video, video_id
    return video


def test_a_tenant_sees_only_its_own_jobs(url):
    alice, bob, ops = client(url, "sk-alice"), client(url, "sk-bob"), client(url, "sk-ops")
    mine = alice.videos.create(prompt="alice's secret", size="32x32", extra_body={**SHORT, "user": "mallory"})
    theirs = bob.videos.create(prompt="bob's", size="32x32", extra_body=SHORT)
    assert finished(alice, mine.id).status == "completed" and finished(bob, theirs.id).status == "completed"
    for call in (lambda: bob.videos.retrieve(mine.id), lambda: bob.videos.download_content(mine.id),
                 lambda: bob.videos.delete(mine.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body["code"] == "video_not_found"  # as if it didn't exist
    events = httpx.get(f"{url}/v1/videos/{mine.id}/events", headers={"Authorization": "Bearer sk-bob"})
    assert events.status_code == 404
    assert [v.id for v in bob.videos.list(limit=100).data] == [theirs.id]
    with pytest.raises(openai.BadRequestError):  # a cursor of another tenant's job is no cursor
        bob.videos.list(after=mine.id)
    assert [v.id for v in alice.videos.list(limit=100).data] == [mine.id]
    assert alice.videos.download_content(mine.id).read()[4:8] == b"ftyp"  # still there after bob's DELETE
    # the admin key sees and manages every tenant's jobs
    assert {mine.id, theirs.id} <= {v.id for v in ops.videos.list(limit=100).data}
    assert ops.videos.retrieve(mine.id).prompt == "alice's secret"
    assert ops.videos.delete(theirs.id).deleted
    with pytest.raises(openai.NotFoundError):
        bob.videos.retrieve(theirs.id)


def test_the_live_panel_shows_other_tenants_as_counts_and_shapes(url, wan):
    alice, bob = client(url, "sk-alice"), client(url, "sk-bob")
    with engine_held(wan.sb, HOLD):  # both jobs start together, so they share forwards
        jobs = [alice.videos.create(prompt="alice's", size="32x32", extra_body={**SHORT, "user": "mallory"}),
                bob.videos.create(prompt="bob's", size="32x32", extra_body=SHORT)]
    for c, job in zip((alice, bob), jobs):
        assert finished(c, job.id).status == "completed"

    def live(key: str) -> dict:
        return httpx.get(f"{url}/v1/engine/live", params={"seconds": 60},
                         headers={"Authorization": f"Bearer {key}"}).json()

    seen_by_bob = live("sk-bob")
    assert "alice" not in json.dumps(seen_by_bob) and "mallory" not in json.dumps(seen_by_bob)
    shared = [f for f in seen_by_bob["forwards"] if "bob" in f["users"] and f["others"] >= 1]
    assert shared, seen_by_bob["forwards"]  # alice's rows were there: counted, not named
    hidden = [r for r in seen_by_bob["requests"] if not r["mine"]]
    assert hidden and all(r["id"] is None and r["user"] is None and r["size"] == "32x32" for r in hidden)
    # the tenant, not the client, sets `user`; the admin sees it
    assert any({"alice", "bob"} <= set(f["users"]) for f in live("sk-ops")["forwards"])


def test_limits_answer_429_with_retry_after_and_sizes_400(url, wan):
    alice, carol = client(url, "sk-alice"), client(url, "sk-carol")
    for extra, size, param, code in [({"num_frames": 13}, "32x32", "num_frames", "max_frames_exceeded"),
                                     ({"num_inference_steps": 51, "num_frames": 5}, "32x32", "num_inference_steps",
                                      "max_steps_exceeded"),
                                     (SHORT, "48x32", "size", "max_pixels_exceeded")]:
        with pytest.raises(openai.BadRequestError) as caught:
            alice.videos.create(prompt="too big", size=size, extra_body=extra)
        assert (caught.value.body["param"], caught.value.body["code"]) == (param, code)
    # concurrent video jobs: 2 unfinished at most; the priority asked for is capped at the key's 0
    with engine_held(wan.sb, HOLD):
        first, second = (alice.videos.create(prompt=f"held {i}", size="32x32",
                                             extra_body={**SHORT, "priority": 9}) for i in range(2))
        engine = wan.sb.engine
        pending = [*engine._inbox, *engine.scheduler.waiting, *engine.scheduler.running]  # the blocker and both
        with pytest.raises(openai.RateLimitError) as caught:
            alice.videos.create(prompt="third", size="32x32", extra_body=SHORT)
    assert caught.value.body["param"] == "max_concurrent_video_jobs"
    assert caught.value.body["code"] == "max_concurrent_video_jobs_exceeded"
    assert int(caught.value.response.headers["Retry-After"]) >= 1
    assert len(pending) >= 3 and max(r.priority for r in pending) == 0  # capped: not 9
    for job in (first, second):
        assert finished(alice, job.id).status == "completed"
    # requests per minute: a token every 30 s at 2 a minute
    for i in range(2):
        carol.videos.create(prompt=f"paced {i}", size="32x32", extra_body=SHORT)
    with pytest.raises(openai.RateLimitError) as caught:
        carol.videos.create(prompt="too fast", size="32x32", extra_body=SHORT)
    assert caught.value.body["param"] == "requests_per_minute"
    assert caught.value.body["code"] == "requests_per_minute_exceeded"
    assert 29 <= int(caught.value.response.headers["Retry-After"]) <= 30
    with pytest.raises(openai.AuthenticationError):
        client(url, "sk-nobody").videos.list()


def test_concurrent_image_requests_are_limited_per_tenant(served, keys_file):
    app = create_app(ServeConfig(api_keys=keys_file), model=served)
    with ServerThread(app) as base:
        dave, bob = client(base, "sk-dave"), client(base, "sk-bob")
        got = {}
        with engine_held(served.sb, dict(prompt="hold", num_inference_steps=2, height=64, width=64, seed=0)):
            thread = threading.Thread(target=lambda: got.setdefault("first", dave.images.generate(
                prompt="a red circle", extra_body={"num_inference_steps": 2})))
            thread.start()
            assert wait_for(lambda: app.state.server.tenants._tenants["dave"].in_flight == 1, timeout=30)
            with pytest.raises(openai.RateLimitError) as caught:
                dave.images.generate(prompt="a second", extra_body={"num_inference_steps": 2})
            assert caught.value.body["param"] == "max_concurrent_requests"
            other = threading.Thread(target=lambda: got.setdefault("bob", bob.images.generate(
                prompt="bob's", extra_body={"num_inference_steps": 2})))  # another tenant isn't limited by dave's
            other.start()
        thread.join(60)
        other.join(60)
        assert len(got["first"].data) == 1 and len(got["bob"].data) == 1
        # the slot is free again once the first ended
        assert len(dave.images.generate(prompt="after", extra_body={"num_inference_steps": 2}).data) == 1


def test_a_bad_keys_file_fails_the_launch_naming_the_entry(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text('[[keys]]\nkey = "sk-a"\ntenant = "a"\nrequests_per_minut = 5\n')
    with pytest.raises(ValueError, match=r"keys\[0\] has unknown fields \['requests_per_minut'\]"):
        ServeConfig(api_keys=str(path))
    path.write_text('[[keys]]\nkey = "sk-a"\ntenant = "a"\n[[keys]]\nkey = "sk-a"\ntenant = "b"\n')
    with pytest.raises(ValueError, match=r"keys\[1\] repeats a key"):
        load_api_keys(path)


def test_retry_after_of_a_concurrency_limit_is_when_the_tenants_first_request_ends():
    from diffusers_stepbatch.serve.tenants import Tenants, TenantKey

    def running(tenant, remaining):
        return SimpleNamespace(tenant=tenant, remaining_steps=remaining)

    scheduler = SimpleNamespace(step_seconds=0.5, running=[running("alice", 12), running("bob", 1),
                                                           running("alice", 7)])
    sb = SimpleNamespace(engine=SimpleNamespace(scheduler=scheduler))
    tenants = Tenants([TenantKey(key="sk-a", tenant="alice", max_concurrent_video_jobs=1)], retry_after_s=2)
    with pytest.raises(Exception) as caught:
        tenants.check_video_jobs(tenants.keys[0], 1, sb)
    assert caught.value.headers["Retry-After"] == "4"  # 7 steps at 0.5 s, rounded up; bob's request isn't hers
    scheduler.running = [running("bob", 1)]
    with pytest.raises(Exception) as caught:
        tenants.check_video_jobs(tenants.keys[0], 1, sb)
    assert caught.value.headers["Retry-After"] == "2"  # none of hers runs yet: the server's hint
