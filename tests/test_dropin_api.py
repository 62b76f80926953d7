"""The wrapper looks like the pipeline to code written for the plain pipeline: its call signature, and the
per-call state (`guidance_scale`, `num_timesteps`, `current_timestep`, ...) after a call and inside callbacks."""

import contextlib
import inspect
import logging
import pydoc
import threading
import warnings

import pytest
import torch
from diffusers import DiffusionPipeline, FluxImg2ImgPipeline

from diffusers_stepbatch import StepBatched, disable_step_batching, enable_step_batching
from diffusers_stepbatch.toy.video import tiny_wan_pipeline

from .dropin_helpers import FAMILIES, call_kwargs, pipe_for, run
from .references import TOLERANCE, max_diff, seeded, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")
EXTRAS = ["priority", "deadline", "teacache"]


def call_state_names(pipe) -> list[str]:
    """The per-call properties a family defines (guidance_scale, num_timesteps, ...), as diffusers' tests read."""
    return sorted(name for name in dir(type(pipe))
                  if isinstance(inspect.getattr_static(type(pipe), name, None), property)
                  and not hasattr(DiffusionPipeline, name))


@pytest.mark.parametrize("name", FAMILIES)
def test_signature_is_the_pipelines_plus_keyword_only_extras(name):
    pipe = pipe_for(name)
    own = inspect.signature(pipe.__call__)
    with StepBatched(pipe) as sb:
        for method in (sb.__call__, sb.submit, sb.agenerate):
            signature = inspect.signature(method)
            assert [p for p in signature.parameters.values() if p.name not in EXTRAS] == list(own.parameters.values())
            for extra in EXTRAS:
                assert signature.parameters[extra].kind is inspect.Parameter.KEYWORD_ONLY
        assert "preview_every" in inspect.signature(sb.stream).parameters
        # diffusers' test_encode_prompt_works_in_isolation filters call arguments by this signature
        assert set(own.parameters) <= set(inspect.signature(sb.__call__).parameters)
        assert isinstance(sb, StepBatched) and type(sb).__name__ == "StepBatched"
        text = pydoc.render_doc(sb.__call__)
        assert "num_inference_steps" in text and "priority" in text


@pytest.mark.parametrize("name", FAMILIES)
def test_call_state_after_a_call_reads_like_the_plain_pipeline(name):
    pipe = pipe_for(name)
    kwargs = call_kwargs(name, guidance_scale=4.0)
    fresh = type(pipe)(**pipe.components)
    fresh.set_progress_bar_config(disable=True)
    run(fresh, kwargs)
    names = call_state_names(fresh)
    expected = {}
    for attribute in names:
        try:
            expected[attribute] = getattr(fresh, attribute)
        except AttributeError:  # a property of a feature this call does not use
            continue
    if name.startswith("pixart"):
        assert names == []  # PixArtSigmaPipeline keeps no per-call state on itself
    else:
        assert {"guidance_scale", "num_timesteps"} <= set(expected), sorted(expected)
    with StepBatched(pipe) as sb:
        run(sb, kwargs)
        for attribute, value in expected.items():
            got = getattr(sb, attribute)
            if isinstance(value, torch.Tensor):
                assert torch.equal(got, value), attribute
            else:
                assert got == value, attribute


def test_call_state_is_per_calling_thread():
    pipe = pipe_for("sd-euler")
    with StepBatched(pipe) as sb:
        seen = {}

        def call(scale, steps):
            run(sb, call_kwargs("sd-euler", guidance_scale=scale, num_inference_steps=steps))
            seen[scale] = (sb.guidance_scale, sb.num_timesteps, sb.do_classifier_free_guidance)

        threads = [threading.Thread(target=call, args=(scale, steps)) for scale, steps in ((1.0, 2), (6.0, 4))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert seen == {1.0: (1.0, 2, False), 6.0: (6.0, 4, True)}


@pytest.mark.parametrize("name", ["flux", "qwen-tiny", "sd3-tiny", "sdxl-euler"])
def test_call_state_inside_a_callback_is_the_requests(name):
    """A callback that reads the wrapper (as code written for `pipe` does) sees its own request's timestep."""
    pipe = pipe_for(name)

    def recorder(source, log):
        def callback(view, i, t, callback_kwargs):
            log.append((i, float(t), float(source().num_timesteps), source().guidance_scale))
            return callback_kwargs
        return callback

    plain_log: list = []
    run(pipe, call_kwargs(name, callback_on_step_end=recorder(lambda: pipe, plain_log)))
    with StepBatched(pipe) as sb:
        logs = [[], []]
        futures = [sb.submit(**seeded(call_kwargs(name, callback_on_step_end=recorder(lambda: sb, logs[0])))),
                   sb.submit(**seeded(call_kwargs(name, num_inference_steps=5, guidance_scale=2.0,
                                                  callback_on_step_end=recorder(lambda: sb, logs[1]))))]
        for future in futures:
            future.result(timeout=300)
    assert logs[0] == plain_log
    assert [entry[2:] for entry in logs[1]] == [(5.0, 2.0)] * 5


@pytest.mark.parametrize("name", ["flux", "sd-euler"])
def test_submit_validates_priority_and_deadline(name):
    pipe = pipe_for(name)
    with StepBatched(pipe) as sb:
        for bad, error in (("high", TypeError), (1.5, TypeError), (True, TypeError)):
            with pytest.raises(error, match="priority"):
                sb.submit(**seeded(call_kwargs(name)), priority=bad)
        for bad, error in ((float("nan"), ValueError), (float("inf"), ValueError), (-1.0, ValueError),
                           (0, ValueError), ("10", TypeError)):
            with pytest.raises(error, match="deadline"):
                sb.submit(**seeded(call_kwargs(name)), deadline=bad)
        assert max_diff(run(sb, dict(call_kwargs(name), priority=3, deadline=600.0)),
                        run(pipe, call_kwargs(name))) <= TOLERANCE


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name} {record.levelname}: {record.getMessage()}")


@contextlib.contextmanager
def _diffusers_logs():
    """What is logged on diffusers' loggers at WARNING and above meanwhile."""
    records, logger = _Records(), logging.getLogger("diffusers")
    logger.addHandler(records)
    try:
        yield records.messages
    finally:
        logger.removeHandler(records)


def _warnings_of(fn, kwargs: dict) -> tuple[set[str], list[str]]:
    """The warnings a call raises, and what it logs on diffusers' loggers."""
    with _diffusers_logs() as logged, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(**seeded(kwargs))
    return {f"{w.category.__name__}: {w.message}" for w in caught}, sorted(logged)


def _pipe_and_call(name: str, extra: dict):
    if name.startswith("wan"):
        pipe = tiny_wan_pipeline(experts=name == "wan-experts")
        pipe.set_progress_bar_config(disable=True)
        return pipe, dict(prompt="a red circle", num_frames=5, height=16, width=16, num_inference_steps=2, seed=0,
                          output_type="pt", **extra)
    if name == "flux-img2img":  # the generic program, which runs the pipeline's check in the caller too
        pipe = FluxImg2ImgPipeline(**pipe_for("flux").components)
        pipe.set_progress_bar_config(disable=True)
        return pipe, call_kwargs("flux", image=torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
                                 strength=0.9, **extra)
    return pipe_for(name), call_kwargs(name, **extra)


WARNING_CALLS = [(name, {}) for name in FAMILIES] + [
    ("wan", {}), ("wan-experts", {}), ("flux", dict(height=40, width=40)), ("sd3-tiny", dict(height=40, width=40)),
    ("flux-img2img", {}), ("flux-img2img", dict(height=42, width=42)),  # 42: its check logs the size it rounds
    # QwenImagePipeline's __call__ logs guidance arguments it ignores (its default true_cfg_scale is 4.0)
    ("qwen-tiny", dict(negative_prompt="blurry", true_cfg_scale=1.0, guidance_scale=3.5)),
    ("qwen-tiny", dict(negative_prompt="blurry", true_cfg_scale=2.0)),
]


@pytest.mark.parametrize("hooked", [False, True], ids=["wrapped", "hook-mode"])
@pytest.mark.parametrize(("name", "extra"), WARNING_CALLS)
def test_a_wrapped_call_warns_and_logs_as_the_plain_call_does(name, extra, hooked):
    # Wan's `boundary_ratio` and SDXL's `force_zeros_for_empty_prompt` are config entries: reading them as
    # pipeline attributes (as a scan of the components by config name did) raises diffusers' FutureWarning
    pipe, kwargs = _pipe_and_call(name, extra)
    plain_warnings, plain_logs = _warnings_of(pipe, kwargs)
    if hooked:
        enable_step_batching(pipe)
        try:
            wrapped_warnings, wrapped_logs = _warnings_of(pipe, kwargs)
        finally:
            disable_step_batching(pipe)
    else:
        with StepBatched(pipe) as sb:
            wrapped_warnings, wrapped_logs = _warnings_of(sb, kwargs)
    assert wrapped_warnings <= plain_warnings
    assert wrapped_logs == plain_logs


def _logs_of_refused(fn, kwargs: dict) -> list[str]:
    with _diffusers_logs() as logged, pytest.raises(ValueError, match="Cannot forward both `prompt`"):
        fn(**seeded(kwargs))
    return logged


@pytest.mark.parametrize("name", ["flux", "flux-img2img"])
def test_a_refused_call_logs_what_the_plain_check_logs_before_raising(name):
    # the check runs in the caller (finding the argument to blame re-runs it, logging nothing more); for the
    # generic program, whose request would run the check again, it logs only when the request is refused
    pipe, kwargs = _pipe_and_call(name, dict(height=42, width=42, prompt_embeds=torch.zeros(1, 16, 32)))
    plain = _logs_of_refused(pipe, kwargs)
    with StepBatched(pipe) as sb:
        wrapped = _logs_of_refused(sb, kwargs)
    assert len(plain) == 1 and "divisible" in plain[0]
    assert wrapped == plain


class _SetsItsOwnState(FluxImg2ImgPipeline):
    """Sets a plain attribute in its call, as PRX's `self.num_timesteps = len(timesteps)` does."""

    def __call__(self, *args, **kwargs):
        output = super().__call__(*args, **kwargs)
        self.steps_run = self._num_timesteps
        return output


@pytest.mark.parametrize("hooked", [False, True], ids=["wrapped", "hook-mode"])
def test_a_plain_attribute_the_call_sets_reads_as_after_a_plain_call(hooked):
    pipe = _SetsItsOwnState(**pipe_for("flux").components)
    pipe.set_progress_bar_config(disable=True)
    kwargs = call_kwargs("flux", image=torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
                         strength=1.0)
    run(pipe, dict(kwargs, num_inference_steps=4))
    assert pipe.steps_run == 4
    sb = enable_step_batching(pipe) if hooked else StepBatched(pipe)
    try:
        run(pipe if hooked else sb, dict(kwargs, num_inference_steps=3))
        assert (pipe if hooked else sb).steps_run == 3
        if not hooked:  # per calling thread, as the other per-call state
            seen = {}

            def call(steps):
                run(sb, dict(kwargs, num_inference_steps=steps))
                seen[steps] = sb.steps_run

            threads = [threading.Thread(target=call, args=(steps,)) for steps in (2, 5)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert seen == {2: 2, 5: 5} and sb.steps_run == 3
    finally:
        disable_step_batching(pipe) if hooked else sb.close()

