"""Abort, failures, bad input, close and asyncio: nothing is lost, nothing hangs, others are unharmed."""

import asyncio
import logging
import threading

import pytest
import torch

from diffusers_stepbatch import EngineClosedError, StepBatched

from .references import TOLERANCE, flux_pipe, max_diff, seeded


def kwargs_for(prompt="a red circle", seed=0, steps=4, **overrides):
    kwargs = dict(prompt=prompt, height=32, width=32, num_inference_steps=steps, seed=seed, output_type="pt",
                  max_sequence_length=16)
    kwargs.update(overrides)
    return kwargs


def test_abort_running_request_stops_between_steps():
    pipe = flux_pipe("dev-tiny")
    others = [kwargs_for(f"other {i}", seed=i, steps=6) for i in range(3)]
    expected = [pipe(**seeded(k)).images for k in others]
    steps_seen, handle_ready, holder = [], threading.Event(), {}

    def abort_at_step_two(step_pipe, i, t, tensors):
        steps_seen.append(i)
        if i == 1:
            handle_ready.wait(5)
            holder["handle"].abort()
        return {}

    with StepBatched(pipe) as sb:
        victim = sb.submit(**seeded(kwargs_for("victim", steps=20, callback_on_step_end=abort_at_step_two)))
        holder["handle"] = victim
        handle_ready.set()
        futures = [sb.submit(**seeded(k)) for k in others]
        results = [f.result(timeout=60).images for f in futures]
    assert victim.cancelled()
    assert steps_seen == [0, 1]  # stopped right after the step that aborted it
    assert all(max_diff(r, e) <= TOLERANCE for r, e in zip(results, expected))
    assert sb.stats()["requests_finished"]["FINISHED_ABORTED"] == 1


def test_abort_waiting_request_never_runs():
    pipe = flux_pipe("dev-tiny")
    ran = []
    with StepBatched(pipe, max_batch_size=1) as sb:
        first = sb.submit(**seeded(kwargs_for(steps=8)))
        waiting = sb.submit(**seeded(kwargs_for(callback_on_step_end=lambda p, i, t, k: ran.append(i) or {})))
        assert waiting.abort()
        first.result(timeout=60)
    assert waiting.cancelled() and ran == []


def test_failing_rows_fail_only_their_request(caplog):
    """A forward that raises for one request's rows fails that request; the batch is retried row-alone."""
    pipe = flux_pipe("dev-tiny")
    good = [kwargs_for(f"good {i}", seed=i) for i in range(3)]
    expected = [pipe(**seeded(k)).images for k in good]

    def poison(step_pipe, i, t, tensors):
        return {"latents": torch.full_like(tensors["latents"], float("inf"))}

    def reject_non_finite(module, args, kwargs):
        if not torch.isfinite(kwargs["hidden_states"]).all():
            raise RuntimeError("non-finite hidden states")

    hook = pipe.transformer.register_forward_pre_hook(reject_non_finite, with_kwargs=True)
    try:
        with caplog.at_level(logging.WARNING), StepBatched(pipe) as sb:
            bad = sb.submit(**seeded(kwargs_for("bad", callback_on_step_end=poison)))
            futures = [sb.submit(**seeded(k)) for k in good]
            results = [f.result(timeout=60).images for f in futures]
            with pytest.raises(RuntimeError, match="non-finite"):
                bad.result(timeout=60)
            # the engine keeps serving after the failure
            assert max_diff(sb(**seeded(good[0])).images, expected[0]) <= TOLERANCE
    finally:
        hook.remove()
    assert all(max_diff(r, e) <= TOLERANCE for r, e in zip(results, expected))


def test_callback_exception_fails_only_its_request():
    pipe = flux_pipe("schnell-tiny")

    def explode(step_pipe, i, t, tensors):
        raise KeyError("boom")

    with StepBatched(pipe) as sb:
        bad = sb.submit(**seeded(kwargs_for(callback_on_step_end=explode)))
        good = sb.submit(**seeded(kwargs_for("fine", seed=5)))
        with pytest.raises(KeyError, match="boom"):
            bad.result(timeout=60)
        assert max_diff(good.result(timeout=60).images, pipe(**seeded(kwargs_for("fine", seed=5))).images) <= TOLERANCE


BAD_INPUTS = [
    (dict(prompt_embeds=torch.zeros(1, 16, 32)), "Cannot forward both `prompt`"),
    (dict(prompt=None), "Provide either `prompt` or `prompt_embeds`"),
    (dict(prompt=42), "has to be of type `str` or `list`"),
    (dict(callback_on_step_end_tensor_inputs=["noise"]), "callback_on_step_end_tensor_inputs"),
    (dict(num_inference_steps=0), "num_inference_steps=0 must be >= 1"),
    (dict(num_inference_steps=2.5), "must be an int"),
    (dict(generator=[torch.Generator(), torch.Generator()], seed=None), "list of 2 generators for 1 images"),
    (dict(latents=torch.full((1, 64, 16), float("nan"))), "NaN"),
    (dict(latents=torch.zeros(1, 4, 16)), r"latents have shape \(1, 4, 16\)"),
    (dict(max_sequence_length=1024), "cannot be greater than 512"),
    (dict(negative_prompt=["a", "b"], true_cfg_scale=2.0), "negative_prompt has 2 entries for 1 prompts"),
]


@pytest.mark.parametrize("overrides, message", BAD_INPUTS, ids=[m[:24] for _, m in BAD_INPUTS])
def test_bad_input_raises_in_caller_while_others_complete(overrides, message):
    pipe = flux_pipe("dev-tiny")
    expected = pipe(**seeded(kwargs_for("valid", seed=9))).images
    with StepBatched(pipe) as sb:
        valid = sb.submit(**seeded(kwargs_for("valid", seed=9)))
        bad = seeded(kwargs_for(**overrides))
        with pytest.raises(ValueError, match=message):
            sb.submit(**{k: v for k, v in bad.items() if v is not None or k == "prompt"})
        assert max_diff(valid.result(timeout=60).images, expected) <= TOLERANCE
    assert sb.stats()["requests_finished"] == {"FINISHED_OK": 1}


def test_unknown_argument_is_a_type_error():
    with StepBatched(flux_pipe("dev-tiny")) as sb, pytest.raises(TypeError, match="num_steps"):
        sb.submit("a cat", num_steps=3)


def test_indivisible_size_is_resized_with_a_warning_like_diffusers(caplog):
    pipe = flux_pipe("dev-tiny")
    kwargs = kwargs_for(height=34, width=54)  # vae_scale_factor 2: sizes must divide by 4
    expected = pipe(**seeded(kwargs)).images
    with caplog.at_level(logging.WARNING), StepBatched(pipe) as sb:
        got = sb(**seeded(kwargs)).images
    assert "have to be divisible by 4" in caplog.text
    assert got.shape == expected.shape == (1, 3, 32, 52) and max_diff(got, expected) <= TOLERANCE


def test_close_resolves_everything_and_stops_the_thread():
    pipe = flux_pipe("dev-tiny")
    sb = StepBatched(pipe, max_batch_size=1)
    futures = [sb.submit(**seeded(kwargs_for(f"p{i}", seed=i, steps=10))) for i in range(4)]
    sb.close(cancel_pending=True)
    assert not sb.engine.is_alive
    assert all(f.done() for f in futures) and any(f.cancelled() for f in futures)
    with pytest.raises(EngineClosedError):
        sb.submit(**seeded(kwargs_for()))


def test_context_exit_waits_for_submitted_work():
    pipe = flux_pipe("dev-tiny")
    with StepBatched(pipe) as sb:
        futures = [sb.submit(**seeded(kwargs_for(f"p{i}", seed=i))) for i in range(3)]
    assert not sb.engine.is_alive
    assert all(f.done() and not f.cancelled() and f.exception() is None for f in futures)


def test_calling_from_engine_thread_is_refused():
    pipe = flux_pipe("dev-tiny")
    with StepBatched(pipe) as sb:
        def reenter(step_pipe, i, t, tensors):
            sb.submit("nested")
            return {}

        with pytest.raises(RuntimeError, match="own engine thread"):
            sb(**seeded(kwargs_for(callback_on_step_end=reenter)))


def test_scheduler_swap_applies_to_later_submissions_only():
    pipe = flux_pipe("dev-tiny")
    original = pipe.scheduler
    shifted = type(original).from_config(original.config, shift=3.0)
    waiting_kwargs, later_kwargs = kwargs_for("waiting", seed=1), kwargs_for("later", seed=2)
    expected_waiting = pipe(**seeded(waiting_kwargs)).images
    try:
        with StepBatched(pipe, max_batch_size=1) as sb:
            first = sb.submit(**seeded(kwargs_for(steps=10)))
            waiting = sb.submit(**seeded(waiting_kwargs))  # not admitted yet: max_batch_size=1
            sb.scheduler = shifted
            later = sb.submit(**seeded(later_kwargs))
            results = [h.result(timeout=60).images for h in (first, waiting, later)]
        expected_later = pipe(**seeded(later_kwargs)).images
    finally:
        pipe.scheduler = original
    assert max_diff(results[1], expected_waiting) <= TOLERANCE
    assert max_diff(results[2], expected_later) <= TOLERANCE
    assert max_diff(expected_later, pipe(**seeded(later_kwargs)).images) > 1e-3  # the swap mattered


def test_attributes_fall_through_to_the_pipeline():
    pipe = flux_pipe("dev-tiny")
    with StepBatched(pipe) as sb:
        assert sb.transformer is pipe.transformer and sb.vae_scale_factor == pipe.vae_scale_factor
        assert sb.to("cpu") is sb
        with pytest.raises(AttributeError):
            sb.no_such_attribute


def test_agenerate_and_task_cancellation():
    pipe = flux_pipe("dev-tiny")
    requests = [kwargs_for(f"async {i}", seed=i, steps=3 + i) for i in range(4)]
    expected = [pipe(**seeded(k)).images for k in requests]

    async def main(sb):
        results = await asyncio.gather(*(sb.agenerate(**seeded(k)) for k in requests))
        slow = asyncio.ensure_future(sb.agenerate(**seeded(kwargs_for(steps=200))))
        await asyncio.sleep(0.05)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        return results

    with StepBatched(pipe) as sb:
        results = asyncio.run(main(sb))
    assert all(max_diff(r.images, e) <= TOLERANCE for r, e in zip(results, expected))
    assert sb.stats()["requests_finished"]["FINISHED_ABORTED"] == 1


def test_unsupported_pipeline_is_rejected_clearly():
    with pytest.raises(ValueError, match="no step program for object"):
        StepBatched(object())
