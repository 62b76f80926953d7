"""Video jobs under Ray Serve: two tiny-Wan replicas on one PostgreSQL and one video folder. Ray's proxy sends
each request to either replica, so every job is read, downloaded and cancelled through both (before the shared
job store, a job was a 404 on the replica that didn't make it)."""

from __future__ import annotations

import collections

import pytest

ray = pytest.importorskip("ray", reason="the Ray Serve test needs `pip install -e .[ray]`")
pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
pytest.importorskip("sqlalchemy", reason="the job store needs `pip install -e .[serve]`")

from .postgres_helpers import fresh_database, missing_reason, postgres_server
from .ray_helpers import local_ray_serve
from .serve_helpers import wait_for
from .test_serve_ray import REPLICA_HEADER

USES_LOCAL_RAY = True  # conftest stops the shared instance after the last module that uses it

SHORT = {"num_frames": 5, "num_inference_steps": 2, "size": "32x32"}


@pytest.fixture(scope="module")
def ray_videos(tmp_path_factory):
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    from ray import serve

    from diffusers_stepbatch.serve.ray import build_app

    with postgres_server() as admin:
        database = fresh_database(admin, "ray")
        url = local_ray_serve()
        # NOTE: max_steps lets the "long" job run until it is cancelled
        serve.run(build_app({"model": "tiny-wan", "jobs_db": database, "video_fps": 4, "jobs_poll_s": 0.2,
                             "max_steps": 100_000,
                             "video_dir": str(tmp_path_factory.mktemp("ray-videos")), "num_replicas": 2,
                             "ray_actor_options": {"num_cpus": 1}}), name="videos", route_prefix="/")
        try:
            assert wait_for(lambda: _status(f"{url}/health") == 200, timeout=180, interval=0.5)
            yield url
        finally:
            serve.delete("videos")  # before its database goes


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_every_replica_serves_every_job(ray_videos):
    with httpx.Client(base_url=ray_videos, timeout=60) as client:
        made = collections.Counter()
        jobs = []
        for i in range(6):
            answer = client.post("/v1/videos", json={"prompt": f"clip {i}", "seed": i, **SHORT})
            assert answer.status_code == 200, answer.text
            made[answer.headers[REPLICA_HEADER]] += 1
            jobs.append(answer.json()["id"])
        readers = collections.Counter()
        for video_id in jobs:
            def completed(video_id=video_id):
                answer = client.get(f"/v1/videos/{video_id}")
                assert answer.status_code == 200, answer.text  # never a 404 from the other replica
                readers[answer.headers[REPLICA_HEADER]] += 1
                return answer.json()["status"] == "completed"

            assert wait_for(completed, timeout=120, interval=0.1)
            for _ in range(4):
                content = client.get(f"/v1/videos/{video_id}/content")
                assert content.status_code == 200 and content.content[4:8] == b"ftyp"
                readers[content.headers[REPLICA_HEADER]] += 1
        assert len(readers) == 2, readers  # both replicas answered reads of jobs, wherever they ran
        listed = client.get("/v1/videos", params={"limit": 100}).json()["data"]
        assert {video["id"] for video in listed} == set(jobs)
        long = client.post("/v1/videos", json={"prompt": "long", "num_frames": 5, "num_inference_steps": 100_000,
                                               "size": "16x16"}).json()
        assert wait_for(lambda: client.get(f"/v1/videos/{long['id']}").json()["progress"] > 0, timeout=60)
        assert client.delete(f"/v1/videos/{long['id']}").json()["cancelled"]
        assert wait_for(lambda: client.get(f"/v1/videos/{long['id']}").json()["status"] == "failed", timeout=10)
        for video_id in jobs:
            assert client.delete(f"/v1/videos/{video_id}").json()["deleted"]
        assert client.get("/v1/videos").json()["data"] == [client.get(f"/v1/videos/{long['id']}").json()]
