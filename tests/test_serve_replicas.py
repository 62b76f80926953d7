"""Replicas that share jobs: servers on one real PostgreSQL (started by the test) and one video folder list,
retrieve, download and cancel each other's jobs; a cancel reaches the replica running the job within one
denoising step; a SIGKILLed replica's job is finished by another once its lease expires, and none of 50 jobs
from 8 clients is lost or finished twice across a restart and a kill.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import signal
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("sqlalchemy", reason="the job store needs `pip install -e .[serve]`")
pytest.importorskip("av", reason="the videos API needs `pip install -e .[video]`")

from diffusers_stepbatch.serve.job_store import JobStore

from .postgres_helpers import fresh_database, missing_reason, postgres_server
from .serve_helpers import ServerProcess, ServerThread, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
SHORT = {"num_frames": 5, "num_inference_steps": 2}
LEASE_S = 3.0
ORPHAN_STEPS = 200  # ~2 s at 16x16 here: still running on A when A is killed, a poll after it started


@pytest.fixture(scope="module")
def postgres():
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    with postgres_server() as url:
        yield url


def replica_args(database: str, videos, *extra: str) -> tuple[str, ...]:
    return ("--model", "tiny-wan", "--jobs-db", database, "--video-dir", str(videos), "--max-batch-size", "2",
            "--video-fps", "4", "--jobs-poll-s", "0.2", "--job-lease-s", str(LEASE_S), "--shutdown-timeout", "5",
            *extra)


def events(url: str, video_id: str) -> list[dict]:
    import json

    import httpx

    with httpx.stream("GET", f"{url}/v1/videos/{video_id}/events", timeout=60,
                      headers={"Authorization": "Bearer sk-carol"}) as response:
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


def finished(c, video_id: str, timeout: float = 120.0):
    video = wait_for(lambda: (v := c.videos.retrieve(video_id)).status in ("completed", "failed") and v,
                     timeout=timeout, interval=0.1)
    assert video, f"{video_id} did not finish in {timeout} s"
    return video


def test_two_replicas_share_jobs_and_a_cancel_stops_the_other_within_a_step(postgres, tmp_path):
    """In one process, so the test can slow one replica's steps (0.2 s each) and read its step counter; the
    heartbeat is 5 s, so only the database's notification can deliver the cancel that fast."""
    from diffusers_stepbatch.serve import ServeConfig, create_app, load_model

    database = fresh_database(postgres, "share")
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nkey = "sk-carol"\ntenant = "carol"\nrequests_per_minute = 2\n')
    config = dict(model="tiny-wan", jobs_db=database, video_dir=str(tmp_path / "videos"), video_fps=4,
                  jobs_poll_s=5.0, job_lease_s=30.0, api_keys=str(keys))
    models = [load_model(ServeConfig(**config)) for _ in range(2)]
    transformer = models[0].sb.pipe.transformer
    plain_forward = transformer.forward
    forwards = itertools.count(1)
    calls = [0]

    def slow_forward(*args, **kwargs):
        time.sleep(0.2)
        calls[0] = next(forwards)
        return plain_forward(*args, **kwargs)

    transformer.forward = slow_forward
    apps = [create_app(ServeConfig(**config, replica_name=f"r{i}"), model=model) for i, model in enumerate(models)]
    try:
        with ServerThread(apps[0]) as url_a, ServerThread(apps[1]) as url_b:
            a, b = (openai.OpenAI(base_url=f"{url}/v1", api_key="sk-carol", max_retries=0, timeout=60)
                    for url in (url_a, url_b))
            made_on_b = b.videos.create(prompt="made on b", size="32x32", extra_body={**SHORT, "seed": 7})
            long = a.videos.create(prompt="long", size="16x16", extra_body={"num_frames": 5,
                                                                            "num_inference_steps": 300})
            assert {made_on_b.id, long.id} <= {v.id for v in a.videos.list().data} == \
                {v.id for v in b.videos.list().data}
            with pytest.raises(openai.RateLimitError) as caught:  # the rate is the tenant's, on every replica
                b.videos.create(prompt="a third in a minute", size="32x32", extra_body=SHORT)
            assert caught.value.body["param"] == "requests_per_minute"
            assert 25 <= int(caught.value.response.headers["Retry-After"]) <= 30
            stream = events(url_a, made_on_b.id)  # followed through the replica that doesn't run it
            assert stream[-1]["type"] == "video.completed" and stream[-1]["video"]["progress"] == 100
            assert all(e["type"] == "video.progress" for e in stream[:-1])
            assert finished(a, made_on_b.id).status == "completed"
            assert a.videos.download_content(made_on_b.id).read() == b.videos.download_content(made_on_b.id).read()
            run = apps[0].state.server.videos._runs[long.id]
            assert wait_for(lambda: run.step >= 3, timeout=60)
            assert b.videos.retrieve(long.id).status in ("queued", "in_progress")
            per_step = round(calls[0] / run.step)  # one forward a step, or two without batched CFG rows
            at_delete, asked = calls[0], time.monotonic()
            answer = b.videos.delete(long.id)
            assert answer.cancelled and not answer.deleted
            cancelled = finished(b, long.id, timeout=10)
            took = time.monotonic() - asked
            assert cancelled.status == "failed" and cancelled.error.code == "cancelled"
            assert wait_for(lambda: not models[0].sb.engine.scheduler.running, timeout=5)
            steps_after = (calls[0] - at_delete) / per_step
            assert steps_after <= 1 and took < 2.0, (steps_after, took)  # the step running, then out
            assert b.videos.delete(long.id).deleted  # finished now: deleted through the other replica
            with pytest.raises(openai.NotFoundError):
                a.videos.retrieve(long.id)
    finally:
        for model in models:
            model.close()


def test_a_killed_replicas_job_is_finished_by_the_other_within_its_lease(postgres, tmp_path):
    database, videos = fresh_database(postgres, "kill"), tmp_path / "videos"
    a, b = ServerProcess(*replica_args(database, videos)), ServerProcess(*replica_args(database, videos))
    with concurrent.futures.ThreadPoolExecutor(2) as starting:
        list(starting.map(ServerProcess.start, (a, b)))
    with a, b:
        client_a, client_b = a.client(), b.client()
        job = client_a.videos.create(prompt="orphan", size="16x16",
                                     extra_body={"num_frames": 5, "num_inference_steps": ORPHAN_STEPS, "seed": 3})
        assert wait_for(lambda: client_a.videos.retrieve(job.id).progress > 0, timeout=60)
        killed = time.monotonic()
        a.stop(signal.SIGKILL)
        store = JobStore(database)
        assert store.get(job.id).attempt == 1
        assert wait_for(lambda: store.get(job.id).attempt == 2, timeout=LEASE_S + 30, interval=0.05)
        took = time.monotonic() - killed
        assert LEASE_S * 0.5 <= took <= LEASE_S + 5, took  # once A's lease ran out (it was renewed until the kill)
        assert store.get(job.id).lease_owner == f"{socket.gethostname()}:{b.port}"
        store.close()
        assert finished(client_b, job.id).status == "completed"
        folders = sorted(path.parent.name for path in (videos / job.id).glob("attempt-*/video.mp4"))
        assert folders == ["attempt-2"]  # B's attempt; A's never finished
        again = client_b.videos.create(prompt="orphan", size="16x16",
                                       extra_body={"num_frames": 5, "num_inference_steps": ORPHAN_STEPS, "seed": 3})
        assert finished(client_b, again.id).status == "completed"
        assert client_b.videos.download_content(job.id).read() == client_b.videos.download_content(again.id).read()


def test_fifty_jobs_from_eight_clients_survive_a_restart_and_a_kill(postgres, tmp_path):
    database, videos = fresh_database(postgres, "soak"), tmp_path / "videos"
    replicas = [ServerProcess(*replica_args(database, videos)) for _ in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as starting:
        list(starting.map(ServerProcess.start, replicas))
    made: list[str] = []
    numbers = itertools.count()
    lock = threading.Lock()

    def client_loop(worker: int) -> None:
        while True:
            with lock:
                n = next(numbers)
            if n >= 50:
                return
            for attempt in range(200):  # a replica that is down: try the other one
                replica = replicas[(worker + attempt) % 2]
                try:
                    video = replica.client().videos.create(prompt=f"job {n}", size="16x16",
                                                           extra_body={**SHORT, "seed": n})
                except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
                    time.sleep(0.2)
                    continue
                with lock:
                    made.append(video.id)
                break
            time.sleep(0.05)

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as clients:
            work = [clients.submit(client_loop, worker) for worker in range(8)]
            assert wait_for(lambda: len(made) >= 15, timeout=120)
            assert replicas[0].stop(signal.SIGTERM) in (0, -signal.SIGTERM)
            replicas[0].start()
            assert wait_for(lambda: len(made) >= 30, timeout=120)
            replicas[1].stop(signal.SIGKILL)
            replicas[1].start()
            for future in work:
                future.result(timeout=300)
        assert len(made) == 50 and len(set(made)) == 50
        client = replicas[1].client()
        for video_id in made:
            assert finished(client, video_id).status == "completed", video_id
        every = client.videos.list(limit=100).data
        assert len(every) >= 50 and all(video.status == "completed" for video in every)  # none lost or stuck
        for video in every:  # each finished exactly once: one attempt's folder holds its MP4
            assert len(list((videos / video.id).glob("attempt-*/video.mp4"))) == 1, video.id
    finally:
        for replica in replicas:
            replica.stop(signal.SIGKILL)
