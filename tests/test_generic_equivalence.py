"""The generic fallback: any DiffusionPipeline without a family program equals its solo unwrapped run.

PixArt-Sigma (DPM-Solver, per-row timesteps) batches across requests at different steps; so does an SD
subclass that overrides __call__ (its scalar timestep becomes a per-row vector through the model layer); a
model whose output is not row-wise and a model with diffusers hooks run unbatched. Aborts and errors unwind the
request's pipeline call.
"""

import copy
import logging
import threading

import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline
from diffusers.hooks import HookRegistry, ModelHook

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.programs import generic, program_for
from diffusers_stepbatch.testing import tiny_pixart_or_sana_pipeline

from .references import (  # noqa: F401  (single_thread is a fixture)
    TOLERANCE, ToyLoopPipeline, count_forwards, family_pipe, family_size, max_diff, seeded, single_thread, submit_all,
)

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = ["pixart-tiny", "pixart-wide"]


def kwargs_for(name, **overrides):
    height, width = family_size(name)
    kwargs = dict(prompt="a red circle", height=height, width=width, num_inference_steps=3, seed=0,
                  output_type="pt", use_resolution_binning=False, clean_caption=False, max_sequence_length=16)
    kwargs.update(overrides)
    return kwargs


def images(output):
    return output[0] if isinstance(output, tuple) else output.images


def suspended_calls():
    """Pipeline calls left suspended at a model call (each runs in a helper thread of its own)."""
    import threading

    return [thread for thread in threading.enumerate() if thread.name.startswith("StepBatched-")
            and thread.name.endswith("-request")]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("guidance_scale", [1.0, 4.5])
def test_solo_equals_diffusers(name, guidance_scale):
    pipe = family_pipe(name)
    assert program_for(pipe) is generic.plan_generic
    kwargs = kwargs_for(name, guidance_scale=guidance_scale, negative_prompt="blurry")
    expected = pipe(**seeded(kwargs)).images
    with StepBatched(pipe) as sb:
        got = sb(**seeded(kwargs)).images
    assert max_diff(got, expected) <= TOLERANCE


@pytest.mark.parametrize("name", CONFIGS)
def test_mixed_batch_equals_solo_runs(name):
    pipe = family_pipe(name)
    requests = [
        kwargs_for(name, guidance_scale=1.0, num_inference_steps=2, seed=1),
        kwargs_for(name, prompt="a blue square", guidance_scale=5.0, negative_prompt="noise", num_inference_steps=5,
                   seed=2),
        kwargs_for(name, prompt=["a cat", "x"], num_images_per_prompt=2, guidance_scale=2.0, seed=3),
        kwargs_for(name, prompt="a green cross", guidance_scale=7.0, num_inference_steps=6, seed=4),
        kwargs_for(name, prompt="a yellow cross", guidance_scale=3.0, num_inference_steps=4, seed=5,
                   output_type="np", return_dict=False),
    ]
    expected = [images(pipe(**seeded(kwargs))) for kwargs in requests]
    sizes, hook = count_forwards(pipe.transformer)
    try:
        with StepBatched(pipe, max_batch_size=8) as sb:
            results = submit_all(sb, requests)
    finally:
        hook.remove()
        steps = sorted(request["steps"] for request in sb.stats()["requests"])
    for kwargs, got, want in zip(requests, results, expected):
        assert max_diff(images(got), want) <= TOLERANCE, kwargs
    assert max(sizes) > 2, "no forward held rows of more than one request"
    assert steps == sorted(kwargs["num_inference_steps"] for kwargs in requests)  # progress from each scheduler
    assert not suspended_calls()


def test_abort_and_error_unwind_only_their_request():
    pipe = family_pipe("pixart-tiny")
    others = [kwargs_for("pixart-tiny", prompt=f"other {i}", seed=i, num_inference_steps=5) for i in range(2)]
    expected = [pipe(**seeded(kwargs)).images for kwargs in others]
    holder, steps_seen = {}, []

    def abort_at_step_one(step, t, latents):
        steps_seen.append(step)
        if step == 1:
            holder["victim"].abort()

    def explode(step, t, latents):
        raise RuntimeError("boom at step %d" % step)

    with StepBatched(pipe) as sb:
        victim = sb.submit(**seeded(kwargs_for("pixart-tiny", num_inference_steps=20, callback=abort_at_step_one)))
        holder["victim"] = victim
        failing = sb.submit(**seeded(kwargs_for("pixart-tiny", callback=explode)))
        futures = [sb.submit(**seeded(kwargs)) for kwargs in others]
        results = [future.result(timeout=300).images for future in futures]
        with pytest.raises(RuntimeError, match="boom at step 0"):
            failing.result(timeout=300)
    assert victim.cancelled() and max(steps_seen) <= 2
    assert all(max_diff(r, e) <= TOLERANCE for r, e in zip(results, expected))
    assert not suspended_calls()


class _OverridingSD(StableDiffusionPipeline):
    """A subclass whose __call__ differs from StableDiffusionPipeline's: the SD program must not serve it."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs)


def test_subclass_overriding_call_batches_through_the_generic_program():
    base = family_pipe("sd-euler")
    pipe = _OverridingSD(**dict(base.components, scheduler=copy.deepcopy(base.scheduler)))
    pipe.set_progress_bar_config(disable=True)
    assert program_for(pipe) is generic.plan_generic
    height, width = family_size("sd-euler")
    requests = [dict(prompt=f"p{i}", height=height, width=width, num_inference_steps=3, guidance_scale=2.0 + i,
                     seed=i, output_type="pt") for i in range(4)]
    requests.append(dict(requests[0], num_inference_steps=4, seed=9))  # other timesteps: rarely merged with them
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    entered, released = threading.Event(), threading.Event()

    def hold_engine_once(step_pipe, i, t, tensors):
        entered.set()
        released.wait(60)  # the engine waits on this helper: later submissions start together, in lockstep
        return {}

    timesteps: list[set] = []
    hook = pipe.unet.register_forward_pre_hook(
        lambda module, args, kwargs: timesteps.append(set(kwargs.get("timestep", args[1]).reshape(-1).tolist())),
        with_kwargs=True)
    try:
        with StepBatched(pipe) as sb:
            futures = [sb.submit(**seeded(requests[0]), callback_on_step_end=hold_engine_once)]
            assert entered.wait(60)  # submit the others only once the engine is held
            futures += [sb.submit(**seeded(kwargs)) for kwargs in requests[1:]]
            released.set()
            results = [future.result(timeout=300) for future in futures]
    finally:
        hook.remove()
    assert all(max_diff(r.images, e) <= TOLERANCE for r, e in zip(results, expected))
    # the pipeline passes one scalar timestep per call; merged calls carry a vector of their rows' timesteps
    assert max(len(values) for values in timesteps) > 1, timesteps


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, t):
        return self.linear(x) * t[:, None], t.sum()  # the second output is not row-wise


def test_calls_with_outputs_that_are_not_row_wise_run_alone(caplog):
    pipe = ToyLoopPipeline(_Toy(), DDIMScheduler())
    requests = [dict(batch_size=1 + i % 2, num_inference_steps=3 + i, seed=i) for i in range(3)]
    expected = [pipe(**seeded(kwargs)) for kwargs in requests]
    with caplog.at_level(logging.INFO), StepBatched(pipe) as sb:
        results = submit_all(sb, requests)
    assert all(max_diff(r, e) <= TOLERANCE for r, e in zip(results, expected))
    assert "not row-wise" in caplog.text


class _Noop(ModelHook):
    pass


def test_models_with_diffusers_hooks_run_whole_calls_unbatched(caplog):
    pipe = tiny_pixart_or_sana_pipeline()
    HookRegistry.check_if_exists_or_initialize(pipe.transformer).register_hook(_Noop(), "noop")
    requests = [kwargs_for("pixart-tiny", prompt=f"p{i}", seed=i, guidance_scale=2.0) for i in range(2)]
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    sizes, hook = count_forwards(pipe.transformer)
    try:
        with caplog.at_level(logging.INFO), StepBatched(pipe) as sb:
            results = submit_all(sb, requests)
            sb(**seeded(requests[0]))
    finally:
        hook.remove()
    assert all(max_diff(r.images, e) <= TOLERANCE for r, e in zip(results, expected))
    assert max(sizes) == 2  # each call's own CFG rows, nobody else's
    assert caplog.text.count("unbatched") == 1  # logged once


@pytest.mark.parametrize("overrides, message", [
    (dict(height=33), "divisible by 8"),
    (dict(num_inference_steps=0), "num_inference_steps"),
    (dict(generator=[torch.Generator(), torch.Generator()]), "generator"),
    (dict(prompt=None), "prompt"),
])
def test_bad_input_raises_value_error_in_caller(overrides, message):
    kwargs = kwargs_for("pixart-tiny", **overrides)
    kwargs.pop("seed")
    with StepBatched(family_pipe("pixart-tiny")) as sb:
        with pytest.raises(ValueError, match=message):
            sb.submit(**kwargs)
    assert not sb.engine.is_alive
