"""Offloading under StepBatched. Group offloading (diffusers' hooks, `model.enable_group_offload(...)`): outputs
equal the plain pipeline's. `pipe.enable_model_cpu_offload()`: outputs equal the plain offloaded pipeline's, and,
as after each plain call (diffusers' `maybe_free_model_hooks`), the offloaded models go back to the CPU once the
engine's work runs out: with no request in flight, never while a caller's prologue reads the pipeline.

This CPU has no accelerator to offload from (`device="cpu"`), so the tests watch what moves the models:
`maybe_free_model_hooks`, which re-attaches the offload hooks (`pipe._all_hooks` are new objects afterwards). As
after a plain call, a caller whose request ended the engine's work gets its result after that free."""

import gc
import logging
import threading
import time
import weakref

import pytest
import torch

from diffusers_stepbatch import StepBatched

from .dropin_helpers import FAMILIES, call_kwargs, run
from .references import (TOLERANCE, family_pipe, flux_pipe, max_diff, output_images, seeded,  # noqa: F401
                         single_thread)  # (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["a red circle", "a blue square", "a green cat"]


def fresh_pipe(name: str):
    """A pipeline of its own (the shared cached ones must not carry these tests' offload hooks and patches)."""
    pipe = flux_pipe.__wrapped__("dev-tiny") if name == "flux" else family_pipe.__wrapped__(name)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def offloaded(name: str):
    pipe = fresh_pipe(name)
    pipe.enable_model_cpu_offload(device="cpu")
    return pipe


def watch_frees(pipe, handles: list, body=None, engine=None) -> list[int]:
    """Wrap `pipe.maybe_free_model_hooks`: each call records how many requests still had work in the engine
    (`engine()`, once it exists), and that none of `handles` had its result yet when that was 0."""
    in_flight_at_free: list[int] = []
    free = pipe.maybe_free_model_hooks

    def watched():
        core = engine() if engine is not None else None
        in_flight_at_free.append(len(core.scheduler.running) + len(core.scheduler.waiting) if core else
                                 sum(not handle.done() for handle in handles))
        if body is not None:
            body()
        free()

    pipe.maybe_free_model_hooks = watched  # the engine looks it up on the pipeline at each free
    return in_flight_at_free


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("concurrent", [1, 3])
def test_offloaded_models_are_freed_once_the_work_runs_out(name, concurrent):
    calls = [call_kwargs(name, prompt=prompt, seed=i) for i, prompt in enumerate(PROMPTS[:concurrent])]
    plain = offloaded(name)
    hooks = list(plain._all_hooks)
    expected = [run(plain, kwargs) for kwargs in calls]
    assert all(new is not old for new, old in zip(plain._all_hooks, hooks))  # what a plain call does at its end

    pipe = offloaded(name)
    handles: list = []
    wrapper: list = []
    in_flight_at_free = watch_frees(pipe, handles, engine=lambda: wrapper[0].engine if wrapper else None)
    sb = StepBatched(pipe)
    wrapper.append(sb)
    hooks = list(pipe._all_hooks)
    handles += [sb.submit(**seeded(kwargs)) for kwargs in calls]
    outputs = [output_images(handle.result()) for handle in handles]
    # NOTE: at the last result, before any wait: the models are offloaded again, as when a plain call returns
    assert all(new is not old for new, old in zip(pipe._all_hooks, hooks))
    assert sb.engine.wait_idle(timeout=30)

    for output, reference in zip(outputs, expected):
        assert max_diff(output, reference) < TOLERANCE
    assert in_flight_at_free and in_flight_at_free[-1] == 0, in_flight_at_free
    if not name.startswith("pixart"):  # NOTE: the generic program runs the pipeline's own __call__, which frees at its end
        assert set(in_flight_at_free) == {0}, in_flight_at_free
    assert all(new is not old for new, old in zip(pipe._all_hooks, hooks))
    sb.close()


def test_a_caller_arriving_while_models_are_freed_waits_for_it():
    """The free re-attaches hooks, which changes what a prologue reads (the execution device): a call that
    arrives meanwhile starts planning only after it."""
    freeing = threading.Event()
    entered = threading.Event()

    def slow_free():
        freeing.set()
        entered.set()
        time.sleep(0.3)
        freeing.clear()

    pipe = offloaded("flux")
    handles: list = []
    watch_frees(pipe, handles, body=slow_free)
    check_inputs = pipe.check_inputs
    planned_while_freeing: list[bool] = []

    def watched_check_inputs(*args, **kwargs):
        planned_while_freeing.append(freeing.is_set())
        return check_inputs(*args, **kwargs)

    pipe.check_inputs = watched_check_inputs
    sb = StepBatched(pipe)
    first, second = call_kwargs("flux"), call_kwargs("flux", prompt="a blue square", seed=1)
    run(sb, first)
    assert entered.wait(timeout=30)
    assert max_diff(run(sb, second), run(offloaded("flux"), second)) < TOLERANCE
    assert planned_while_freeing == [False, False]
    sb.close()


def test_a_failing_free_is_logged_and_the_engine_goes_on(caplog):
    pipe = fresh_pipe("flux")

    def broken_free():
        raise RuntimeError("broken offload hook")

    pipe.maybe_free_model_hooks = broken_free
    sb = StepBatched(pipe)
    kwargs = call_kwargs("flux")
    with caplog.at_level(logging.ERROR, logger="diffusers_stepbatch.engine.core"):
        first = run(sb, kwargs)
        assert sb.engine.wait_idle(timeout=30)
        second = run(sb, kwargs)
    assert "idle hook failed" in caplog.text
    assert max_diff(first, second) == 0
    sb.close()


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("offload_type", ["leaf_level", "block_level"])
def test_group_offloaded_models_give_the_plain_outputs(name, offload_type):
    calls = [call_kwargs(name, prompt=prompt, seed=i) for i, prompt in enumerate(PROMPTS)]
    expected = [run(fresh_pipe(name), kwargs) for kwargs in calls]
    pipe = fresh_pipe(name)
    options = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    grouped = [component for component in pipe.components.values() if hasattr(component, "enable_group_offload")]
    for component in grouped:
        component.enable_group_offload(onload_device=torch.device("cpu"), offload_type=offload_type, **options)
    assert grouped
    sb = StepBatched(pipe)
    handles = [sb.submit(**seeded(kwargs)) for kwargs in calls]
    for handle, reference in zip(handles, expected):
        assert max_diff(output_images(handle.result()), reference) < TOLERANCE
    sb.close()


@pytest.mark.parametrize("hook_mode", [False, True])
def test_a_dropped_wrapper_stops_its_engine(hook_mode):
    """The engine's idle free reaches the pipeline weakly: dropping every reference to the wrapper (in hook mode,
    to the pipeline) still collects it and stops the engine thread."""
    from diffusers_stepbatch import enable_step_batching

    pipe = fresh_pipe("flux")
    sb = enable_step_batching(pipe) if hook_mode else StepBatched(pipe)
    run(pipe if hook_mode else sb, call_kwargs("flux"))
    assert sb.engine.wait_idle(timeout=30)
    engine, wrapper = sb.engine, weakref.ref(sb)
    assert engine.is_alive
    del sb
    if hook_mode:
        del pipe
    gc.collect()
    assert wrapper() is None
    engine._thread.join(timeout=10)
    assert not engine.is_alive


def test_a_combined_pipeline_with_model_offload_runs_wrapped_as_plain():
    # NOTE: a combined pipeline frees its sub-pipelines' hooks through their request views: accelerate's
    # `remove_hook_from_module` deletes `_hf_hook` from each component, here our model proxies
    from diffusers import KandinskyV22CombinedPipeline

    from .test_row_kernels import _tiny_kandinsky22, _tiny_kandinsky22_prior

    def combined():
        decoder, prior = _tiny_kandinsky22(32), _tiny_kandinsky22_prior(32, 37, 32)
        pipe = KandinskyV22CombinedPipeline(
            unet=decoder.unet, scheduler=decoder.scheduler, movq=decoder.movq, prior_prior=prior.prior,
            prior_image_encoder=prior.image_encoder, prior_text_encoder=prior.text_encoder,
            prior_tokenizer=prior.tokenizer, prior_scheduler=prior.scheduler,
            prior_image_processor=prior.image_processor)
        pipe.set_progress_bar_config(disable=True)
        pipe.enable_model_cpu_offload(device="cpu")
        return pipe

    def calls():
        return [dict(prompt=f"a horse {seed}", height=64, width=64, num_inference_steps=2, prior_num_inference_steps=2,
                     output_type="pt", generator=torch.Generator().manual_seed(seed)) for seed in range(3)]

    def unhooked(pipe):
        return [name for name, model in pipe.components.items()
                if isinstance(model, torch.nn.Module) and not hasattr(model, "_hf_hook")]

    plain = combined()
    expected = [plain(**kwargs).images for kwargs in calls()]
    pipe = combined()
    with StepBatched(pipe) as sb:
        outputs = [handle.result(300).images for handle in [sb.submit(**kwargs) for kwargs in calls()]]
        assert unhooked(pipe) == unhooked(plain)  # at the results: the offload hooks are back, as after plain calls
    assert max(max_diff(got, want) for got, want in zip(outputs, expected)) <= TOLERANCE
