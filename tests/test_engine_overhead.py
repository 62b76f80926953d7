"""The engine thread's own time: per-request prologues run in the callers' threads, and what the engine reports
about the time it spends outside model calls."""

import threading
import time

import pytest
import torch

from diffusers_stepbatch import SchedulerConfig, StepBatched
from diffusers_stepbatch.engine.core import EngineCore

from .references import family_pipe, family_size, flux_pipe, max_diff, seeded

FAMILIES = ["flux", "sd3-tiny", "qwen-tiny", "sdxl-euler", "sd-euler"]


def _pipe_and_call(name: str, steps: int) -> tuple:
    if name == "flux":
        return flux_pipe(), dict(height=32, width=32, max_sequence_length=16)
    height, width = family_size(name)
    return family_pipe(name), dict(height=height, width=width)


def _engine_thread_reads(monkeypatch, pipe) -> list[bool]:
    """Record, for every read of `pipe._execution_device`, whether it happened in an engine thread."""
    owner = type(pipe)
    original = owner._execution_device
    reads: list[bool] = []

    def execution_device(self):
        reads.append(threading.current_thread().name.startswith("StepBatched"))
        return original.fget(self)

    monkeypatch.setattr(owner, "_execution_device", property(execution_device))
    return reads


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("steps", [2, 3])
def test_prologue_runs_in_the_callers_thread_and_outputs_stay_equal(monkeypatch, name, steps):
    pipe, size = _pipe_and_call(name, steps)
    calls = [dict(prompt=f"a shape {i}", seed=i, num_inference_steps=steps, output_type="pt", **size)
             for i in range(3)]
    expected = [pipe(**seeded(kwargs)).images for kwargs in calls]
    reads = _engine_thread_reads(monkeypatch, pipe)
    with StepBatched(pipe, max_batch_size=4) as sb:
        outputs = [future.result(timeout=120).images for future in [sb.submit(**seeded(k)) for k in calls]]
    assert reads, "the programs looked up their execution device"
    assert not any(reads), "a program looked up the pipeline's device (a module scan) in the engine thread"
    assert max(max_diff(a, b) for a, b in zip(outputs, expected)) <= 1e-4


def test_an_error_in_the_prologue_reaches_the_caller_and_the_engine_keeps_serving():
    pipe = flux_pipe()
    with StepBatched(pipe) as sb:
        with pytest.raises(ValueError, match="latents"):
            # a latents tensor of the wrong shape: prepare_latents, in the prologue, rejects it
            sb.submit(prompt="a", height=32, width=32, num_inference_steps=2, max_sequence_length=16,
                      latents=torch.zeros(1, 3, 7))
        image = sb(prompt="a", height=32, width=32, num_inference_steps=2, max_sequence_length=16,
                   output_type="pt").images
    assert image.shape == (1, 3, 32, 32)


@pytest.mark.parametrize("sleep_ms, steps", [(30, 3), (15, 4)])
def test_outside_model_time_counts_what_runs_between_model_calls(sleep_ms, steps):
    pipe = flux_pipe()

    def slow_callback(pipeline, step, timestep, callback_kwargs):
        time.sleep(sleep_ms / 1000)  # host work between two forwards, in the engine thread
        return callback_kwargs

    with StepBatched(pipe) as sb:
        sb(prompt="a", height=32, width=32, num_inference_steps=steps, max_sequence_length=16, output_type="pt")
        sb.engine.wait_idle()
        sb.reset_stats()
        assert sb.stats()["engine_steps"] == 0
        sb(prompt="a", height=32, width=32, num_inference_steps=steps, max_sequence_length=16, output_type="pt",
           callback_on_step_end=slow_callback)
        assert sb.engine.wait_idle(timeout=10)
        stats = sb.stats()
    engine_steps = stats["engine_steps"]
    assert engine_steps >= steps
    outside_ms = stats["outside_model_ms_per_step"] * engine_steps
    assert outside_ms >= steps * sleep_ms  # every sleep was counted as time outside model calls
    # the fused scheduler updates are the engine's own arithmetic, not model calls
    model_ms = 1000 * sum(call.seconds for call in sb.engine.metrics.calls if call.kind != "update")
    assert any(call.kind == "update" for call in sb.engine.metrics.calls)
    # per step: wall = model calls + outside; summed over the window, both sides of the books agree
    assert outside_ms + model_ms == pytest.approx(1000 * sb.engine.metrics.step_seconds, rel=1e-6)


def test_wait_idle_is_true_for_an_engine_with_nothing_to_do():
    engine = EngineCore(SchedulerConfig())
    assert engine.wait_idle(timeout=0.1)
