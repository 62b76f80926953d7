"""Hook mode: `enable_step_batching(pipe)` batches `pipe(...)` in place for code that only holds the pipeline;
`disable_step_batching(pipe)` gives back exactly the plain pipeline."""

import inspect
import threading

import pytest
from diffusers import FluxPipeline, PixArtSigmaPipeline, StableDiffusionXLPipeline

from diffusers_stepbatch import disable_step_batching, enable_step_batching, is_step_batching

from .dropin_helpers import call_kwargs, pipe_for, run
from .references import TOLERANCE, count_forwards, max_diff, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")
CLASSES = {"flux": FluxPipeline, "sdxl-euler": StableDiffusionXLPipeline, "pixart-tiny": PixArtSigmaPipeline}


def app(pipe, name, seed, steps, results):
    """Code written for the plain pipeline: it calls pipe(...) and reads the call's state from pipe."""
    images = run(pipe, call_kwargs(name, seed=seed, num_inference_steps=steps))
    results[seed] = (images, getattr(pipe, "num_timesteps", None), isinstance(pipe, CLASSES[name]))


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_hook_mode_batches_plain_calls_and_restores_the_pipeline(name):
    pipe = pipe_for(name)
    plain_class, plain_dict = type(pipe), dict(pipe.__dict__)
    requests = [(seed, 2 + seed) for seed in range(4)]
    expected = {seed: run(pipe, call_kwargs(name, seed=seed, num_inference_steps=steps)) for seed, steps in requests}
    engine = enable_step_batching(pipe, max_batch_size=8)
    try:
        assert is_step_batching(pipe) and type(pipe).__name__ == plain_class.__name__
        assert isinstance(pipe, plain_class)
        own = set(inspect.signature(plain_class.__call__).parameters) - {"self"}
        assert own | {"priority", "deadline", "teacache"} == set(inspect.signature(pipe.__call__).parameters)
        with pytest.raises(ValueError, match="already enabled"):
            enable_step_batching(pipe)
        denoiser = pipe.transformer if hasattr(pipe, "transformer") else pipe.unet
        sizes, handle = count_forwards(denoiser)
        results: dict = {}
        threads = [threading.Thread(target=app, args=(pipe, name, seed, steps, results)) for seed, steps in requests]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        handle.remove()
    finally:
        disable_step_batching(pipe)
    for seed, steps in requests:
        images, num_timesteps, is_instance = results[seed]
        assert max_diff(images, expected[seed]) <= TOLERANCE
        assert is_instance
        if name != "pixart-tiny":  # PixArt keeps no call state
            assert num_timesteps is not None
    assert max(sizes) > 1  # calls of several threads shared forwards
    assert type(pipe) is plain_class and type(pipe).__call__ is plain_class.__call__
    assert not is_step_batching(pipe) and not engine.engine.is_alive
    assert {k: v for k, v in pipe.__dict__.items() if not k.startswith("_")} == {
        k: v for k, v in plain_dict.items() if not k.startswith("_")}
    assert max_diff(run(pipe, call_kwargs(name)), run(pipe, call_kwargs(name))) == 0.0  # plain again
    with pytest.raises(ValueError, match="not enabled"):
        disable_step_batching(pipe)


def test_hook_mode_call_state_after_a_call():
    pipe = pipe_for("sd-euler")
    enable_step_batching(pipe)
    try:
        run(pipe, call_kwargs("sd-euler", guidance_scale=6.5, num_inference_steps=3))
        assert (pipe.guidance_scale, pipe.num_timesteps, pipe.do_classifier_free_guidance) == (6.5, 3, True)
    finally:
        disable_step_batching(pipe)
