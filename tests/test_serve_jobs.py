"""Durable video jobs: the job store's schema migrations, and a real restart of a server process (SIGTERM,
start again on the same --state-dir) driven by the official `openai` client.

The servers run the tiny Wan 2.1 pipeline with `--max-batch-size 2`: a job (conditional + unconditional rows)
runs alone, so a job run twice with one seed gives the same MP4 bytes.
"""

from __future__ import annotations

import signal
import time

import pytest

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
sa = pytest.importorskip("sqlalchemy", reason="the job store needs `pip install -e .[serve]`")
pytest.importorskip("av", reason="the videos API needs `pip install -e .[video]`")

from diffusers_stepbatch.serve.job_store import JOBS, MIGRATIONS, JobStore, migrate

from .serve_helpers import ServerProcess, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
SERVER = ("--model", "tiny-wan", "--max-batch-size", "2", "--video-fps", "4", "--jobs-poll-s", "0.2",
          "--shutdown-timeout", "5")
SHORT = {"num_frames": 5, "num_inference_steps": 3}
LONG = {"num_frames": 5, "num_inference_steps": 800}  # ~3-6 s at 16x16 here: still running when it is stopped


def finished(client, video_id: str, timeout: float = 120.0):
    video = wait_for(lambda: (v := client.videos.retrieve(video_id)).status in ("completed", "failed") and v,
                     timeout=timeout, interval=0.1)
    assert video, f"{video_id} did not finish in {timeout} s"
    return video


def mp4(client, video_id: str) -> bytes:
    return client.videos.download_content(video_id).read()


def test_a_restart_keeps_finished_jobs_runs_queued_ones_and_resumes_running_ones(tmp_path):
    state = ("--state-dir", str(tmp_path / "state"))
    with ServerProcess(*SERVER, *state) as server:
        client = server.client()
        done = client.videos.create(prompt="kept", size="32x32", extra_body={**SHORT, "seed": 1})
        assert finished(client, done.id).status == "completed"
        kept = mp4(client, done.id)
        running = client.videos.create(prompt="running", size="16x16", extra_body={**LONG, "seed": 2})
        assert wait_for(lambda: client.videos.retrieve(running.id).progress > 0, timeout=60)
        queued = [client.videos.create(prompt=f"queued {i}", size="32x32", extra_body={**SHORT, "seed": 10 + i})
                  for i in range(2)]
        assert [client.videos.retrieve(v.id).status for v in queued] == ["queued", "queued"]  # behind `running`
        assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    videos = tmp_path / "state" / "videos"
    assert list((videos / done.id).glob("attempt-*/video.mp4"))  # shutdown deleted nothing finished
    with ServerProcess(*SERVER, *state) as server:
        client = server.client()
        after = client.videos.retrieve(done.id)
        assert after.status == "completed" and after.completed_at is not None
        assert mp4(client, done.id) == kept  # finished: kept with its content
        for video in queued:
            assert finished(client, video.id).status == "completed"
        resumed = finished(client, running.id)
        assert resumed.status == "completed" and resumed.num_inference_steps == 800
        # the same requests (same seeds) on a server that never restarted give the same bytes
        for video, seed in [(queued[0], 10), (queued[1], 11), (running, 2)]:
            steps = LONG if video is running else SHORT
            size = "16x16" if video is running else "32x32"
            again = client.videos.create(prompt=video.prompt, size=size, extra_body={**steps, "seed": seed})
            assert finished(client, again.id).status == "completed"
            assert mp4(client, again.id) == mp4(client, video.id), video.prompt
        listed = {v.id for v in client.videos.list(limit=100).data}
        assert {done.id, running.id, *(v.id for v in queued)} <= listed
        # with --no-resume a job that was running fails with the reason; a queued one still runs
        interrupted = client.videos.create(prompt="interrupted", size="16x16", extra_body={**LONG, "seed": 3})
        assert wait_for(lambda: client.videos.retrieve(interrupted.id).progress > 0, timeout=60)
        waiting = client.videos.create(prompt="waiting", size="32x32", extra_body={**SHORT, "seed": 4})
        assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    with ServerProcess(*SERVER, *state, "--no-resume") as server:
        client = server.client()
        failed = finished(client, interrupted.id)
        assert failed.status == "failed" and failed.error.code == "interrupted"
        assert "--no-resume" in failed.error.message
        assert finished(client, waiting.id).status == "completed"
        assert mp4(client, done.id) == kept


def test_the_jobs_database_sits_beside_the_video_dir(tmp_path):
    from diffusers_stepbatch.serve import ServeConfig

    assert ServeConfig(video_dir=str(tmp_path)).state_dir == str(tmp_path)
    assert ServeConfig(video_dir="memory://videos").state_dir is None  # not a folder: a temporary database
    with pytest.raises(ValueError, match="needs a video_dir"):
        ServeConfig(jobs_db="postgresql+psycopg://db/jobs")


# ------------------------------------------------------------------------------------------ the store
def _row(job_id: str, **values) -> dict:
    return {"id": job_id, "tenant": None, "end_user": None, "model": "m", "status": "completed",
            "created_at": time.time(), "step": 3, "num_steps": 3, "request": {"prompt": "p"},
            "summary": {"prompt": "p", "width": 16, "height": 16, "num_frames": 5, "fps": 4, "seed": 1},
            "has_reference": False, "attempt": 1, "cancel_requested": False, **values}


def test_a_migration_keeps_old_jobs_and_a_newer_schema_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
    store = JobStore(url)
    store.insert(**_row("video_old"))
    store.close()

    def add_note_column(connection):
        connection.execute(sa.text(f"ALTER TABLE {JOBS.name} ADD COLUMN note VARCHAR(20) DEFAULT 'migrated'"))

    engine = sa.create_engine(url)
    assert migrate(engine, (*MIGRATIONS, add_note_column)) == len(MIGRATIONS)  # the version it found
    with engine.connect() as connection:
        rows = connection.execute(sa.text(f"SELECT id, status, note FROM {JOBS.name}")).all()
    assert [tuple(row) for row in rows] == [("video_old", "completed", "migrated")]
    with pytest.raises(RuntimeError, match="newer than this release"):  # this release, on the upgraded database
        JobStore(url)
    engine.dispose()


def test_a_claim_is_exclusive_and_only_the_holder_finishes(tmp_path):
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.sqlite'}")
    now = time.time()
    store.insert(**_row("video_a", status="in_progress", lease_owner="r1", lease_expires_at=now - 1))
    assert store.claimable(now, model="another-model") == []  # left to a server of its own model
    job = store.claimable(now, model="m")[0]
    assert store.claim(job, "r2", 30, now) == 2
    assert store.claim(job, "r3", 30, now) is None  # it read the same row, but r2 was first
    assert store.claimable(now) == []  # r2's lease is fresh
    assert store.renew([("video_a", 1, {})], "r1", 30, now) == ["video_a"]  # r1 lost it
    assert not store.finish("video_a", "r1", 1, status="completed")
    assert store.finish("video_a", "r2", 2, status="completed")
    assert store.get("video_a").status == "completed" and store.get("video_a", tenant="alice") is None


def test_outputs_go_to_an_fsspec_store(tmp_path):
    """`--video-dir memory://...`: the files live in fsspec's in-memory filesystem, served from there."""
    import fsspec

    from diffusers_stepbatch.serve import ServeConfig, create_app, load_model

    from .serve_helpers import ServerThread

    model = load_model(ServeConfig(model="tiny-wan"))
    memory = fsspec.filesystem("memory")
    try:
        config = ServeConfig(video_dir="memory://stepbatch-videos", state_dir=str(tmp_path / "state"), video_fps=4)
        with ServerThread(create_app(config, model=model)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            video = client.videos.create(prompt="in memory", size="32x32", extra_body={**SHORT, "seed": 1})
            assert finished(client, video.id).status == "completed"
            stored = memory.cat_file(f"/stepbatch-videos/{video.id}/attempt-1/video.mp4")
            assert client.videos.download_content(video.id).read() == stored and stored[4:8] == b"ftyp"
            thumbnail = client.videos.download_content(video.id, variant="thumbnail").read()
            assert thumbnail[:4] == b"RIFF"
            assert client.videos.delete(video.id).deleted
            assert not memory.exists(f"/stepbatch-videos/{video.id}")
    finally:
        model.close()
        if memory.exists("/stepbatch-videos"):
            memory.rm("/stepbatch-videos", recursive=True)
