"""Scheduling features end to end: queue bound, deadlines, priority, streaming previews, progress, metrics."""

import io
import time

import prometheus_client
import pytest
import torch

from diffusers_stepbatch import DeadlineUnmeetable, QueueFull, SchedulerConfig, StepBatched
from diffusers_stepbatch.preview import StreamPreview, to_vae_layout

from .references import TOLERANCE, flux_pipe, max_diff, seeded


def kwargs_for(prompt="a red circle", seed=0, steps=4, **overrides):
    kwargs = dict(prompt=prompt, height=32, width=32, num_inference_steps=steps, seed=seed, output_type="pt",
                  max_sequence_length=16)
    kwargs.update(overrides)
    return kwargs


def wait_until(condition, timeout=30.0):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


def test_bounded_queue_raises_queue_full_and_loses_nothing():
    pipe = flux_pipe("dev-tiny")
    config = SchedulerConfig(max_batch_size=1, max_queue=1)
    with StepBatched(pipe, scheduler=config) as sb:
        running = sb.submit(**seeded(kwargs_for(steps=30)))
        wait_until(lambda: sb.stats()["running"] == 1)
        queued = sb.submit(**seeded(kwargs_for("second", seed=1)))
        with pytest.raises(QueueFull, match="max_queue=1"):
            sb.submit(**seeded(kwargs_for("third", seed=2)))
        assert running.result(timeout=60) and queued.result(timeout=60)


def test_unmeetable_deadline_is_rejected_at_once_and_queued_when_configured():
    pipe = flux_pipe("dev-tiny")
    for mode in ("reject", "queue"):
        with StepBatched(pipe, scheduler=SchedulerConfig(on_unmeetable_deadline=mode)) as sb:
            sb(**seeded(kwargs_for(steps=3)))  # measures the step time the estimate needs
            started = time.time()
            handle = sb.submit(**seeded(kwargs_for(steps=400)), deadline=0.01)
            if mode == "reject":
                with pytest.raises(DeadlineUnmeetable, match="can't meet its deadline"):
                    handle.result(timeout=60)
                assert time.time() - started < 1.0  # at once, not after running 400 steps
            else:
                handle.abort()
    with pytest.raises(ValueError, match="deadline=-1"):
        StepBatched(pipe).submit(**seeded(kwargs_for()), deadline=-1)


def test_priority_policy_admits_higher_priority_first():
    pipe = flux_pipe("dev-tiny")
    finished = []
    with StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=1, policy="priority")) as sb:
        first = sb.submit(**seeded(kwargs_for(steps=12)))
        wait_until(lambda: sb.stats()["running"] == 1)
        handles = {name: sb.submit(**seeded(kwargs_for(name)), priority=p)
                   for name, p in (("low", 0), ("high", 9), ("mid", 5))}
        for name, handle in handles.items():
            handle.add_done_callback(lambda _, name=name: finished.append(name))
        first.result(timeout=60)
    assert finished == ["high", "mid", "low"]


def test_stream_yields_improving_previews_then_the_exact_output():
    pipe = flux_pipe("dev-tiny")
    kwargs = kwargs_for(steps=9, output_type="latent")
    expected = pipe(**seeded(kwargs)).images
    with StepBatched(pipe) as sb:
        items = list(sb.stream(**seeded(kwargs), preview_every=2))
    previews, final = items[:-1], items[-1]
    assert [p.step for p in previews] == [2, 4, 6, 8] and all(isinstance(p, StreamPreview) for p in previews)
    assert max_diff(final.images, expected) <= TOLERANCE
    clean = to_vae_layout(pipe, expected, 32, 32)
    errors = [float((p.latents - clean).abs().mean()) for p in previews]
    assert errors[-1] < errors[0]  # the predicted clean latent converges to the final one
    image = previews[-1].images[0]
    assert image.size == (16, 16) and image.mode == "RGB"


def test_stopping_a_stream_aborts_the_request():
    pipe = flux_pipe("dev-tiny")
    with StepBatched(pipe) as sb:
        stream = sb.stream(**seeded(kwargs_for(steps=200)), preview_every=1)
        first = next(stream)
        stream.close()
        wait_until(lambda: sb.stats()["requests_finished"].get("FINISHED_ABORTED") == 1)
    assert first.step == 1 and sb.stats()["requests_finished"].get("FINISHED_OK") is None
    with pytest.raises(ValueError, match="preview_every=0"):
        StepBatched(pipe).stream(**seeded(kwargs_for()), preview_every=0)


def test_progress_bar_per_request_follows_the_pipeline_config():
    pipe = flux_pipe("schnell-tiny")
    sink = io.StringIO()
    pipe.set_progress_bar_config(file=sink, disable=False, ascii=True)
    try:
        with StepBatched(pipe) as sb:
            handles = [sb.submit(**seeded(kwargs_for(f"p{i}", seed=i, steps=3 + i))) for i in range(3)]
            [h.result(timeout=60) for h in handles]
    finally:
        pipe.set_progress_bar_config(disable=True)
    text = sink.getvalue()
    assert all(f"{n}/{n}" in text for n in (3, 4, 5))


def test_stats_and_prometheus_exposition():
    pipe = flux_pipe("dev-tiny")
    registry = prometheus_client.CollectorRegistry()
    with StepBatched(pipe) as sb:
        sb.register_prometheus(registry)
        for handle in [sb.submit(**seeded(kwargs_for(f"p{i}", seed=i))) for i in range(3)]:
            handle.result(timeout=60)
        stats = sb.stats()
        exposition = prometheus_client.generate_latest(registry).decode()
    assert stats["requests_finished"] == {"FINISHED_OK": 3} and stats["throughput_requests_per_s"] > 0
    assert [len(r["step_times"]) for r in stats["requests"]] == [4, 4, 4]
    assert all(r["queue_time"] >= 0 and r["total_time"] > 0 for r in stats["requests"])
    assert 'stepbatch_requests_finished_total{status="FINISHED_OK"} 3.0' in exposition
    assert "stepbatch_batched_calls_total" in exposition


def test_cost_aware_splitting_keeps_outputs_exact():
    """Whatever chunking the cost model picks (it explores several), each output equals its solo run."""
    pipe = flux_pipe("schnell-tiny")
    requests = [kwargs_for(f"p{i}", seed=i, steps=10) for i in range(4)]
    expected = [pipe(**seeded(k)).images for k in requests]
    with StepBatched(pipe, scheduler=SchedulerConfig(cost_aware=True)) as sb:
        got = [h.result(timeout=60).images for h in [sb.submit(**seeded(k)) for k in requests]]
        histogram = sb.stats()["rows_histogram"]["denoise"]
    assert all(max_diff(g, e) <= TOLERANCE for g, e in zip(got, expected))
    assert len(histogram) > 1  # it measured more than one split of the group


def test_step_time_target_caps_rows():
    pipe = flux_pipe("schnell-tiny")
    with StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=8, step_time_target_s=1e-9)) as sb:
        sb(**seeded(kwargs_for(steps=2)))  # one measurement: nothing fits under 1 ns, so one row at a time
        handles = [sb.submit(**seeded(kwargs_for(f"p{i}", seed=i))) for i in range(4)]
        [h.result(timeout=60) for h in handles]
        assert sb.engine.scheduler.row_budget == 1
        assert max(sb.stats()["rows_histogram"]["denoise"]) == 1
    assert torch.is_grad_enabled()
