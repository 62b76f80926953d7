"""Given text embeddings whose negative branch has another sequence length than the positive one: where the
plain pipeline refuses them (Flux with true CFG, SD3, SDXL, SD: "must have the same shape"), the wrapper and hook
mode refuse them with its message, in the caller; where it accepts them (Qwen-Image, with or without masks),
they give its output, alone and sharing batches with requests of other lengths."""

import pytest

from diffusers_stepbatch import StepBatched, disable_step_batching, enable_step_batching

from .dropin_helpers import call_kwargs, pipe_for, run
from .references import TOLERANCE, max_diff, seeded, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")
SAME_SHAPE = "must have the same shape when passed directly"


def embeds_of_two_lengths(name, pipe):
    """Call arguments with positive and negative embeddings of different sequence lengths (CFG on)."""
    if name == "flux":
        embeds, pooled, _ = pipe.encode_prompt("a cat", prompt_2=None, max_sequence_length=16)
        negative, negative_pooled, _ = pipe.encode_prompt("blurry", prompt_2=None, max_sequence_length=24)
        return dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=negative,
                    negative_pooled_prompt_embeds=negative_pooled, true_cfg_scale=2.0)
    if name.startswith("sd3"):
        embeds, _, pooled, _ = pipe.encode_prompt("a cat", None, None, do_classifier_free_guidance=False,
                                                  max_sequence_length=16)
        negative, _, negative_pooled, _ = pipe.encode_prompt("blurry", None, None, do_classifier_free_guidance=False,
                                                             max_sequence_length=24)
        return dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=negative,
                    negative_pooled_prompt_embeds=negative_pooled, guidance_scale=5.0)
    if name.startswith("sdxl"):
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt("a cat", negative_prompt="blurry")
        return dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=negative[:, :-3],
                    negative_pooled_prompt_embeds=negative_pooled, guidance_scale=5.0)
    embeds, negative = pipe.encode_prompt("a cat", "cpu", 1, True, negative_prompt="blurry")
    return dict(prompt_embeds=embeds, negative_prompt_embeds=negative[:, :-3], guidance_scale=5.0)


@pytest.mark.parametrize("name", ["flux", "sd3-tiny", "sdxl-euler", "sd-euler"])
def test_negative_embeds_of_another_length_are_refused_in_the_pipelines_words(name):
    pipe = pipe_for(name)
    arguments = embeds_of_two_lengths(name, pipe)
    assert arguments["negative_prompt_embeds"].shape[1] != arguments["prompt_embeds"].shape[1]
    kwargs = call_kwargs(name, prompt=None, **arguments)
    with pytest.raises(ValueError, match=SAME_SHAPE) as plain:
        run(pipe, kwargs)
    with StepBatched(pipe) as sb, pytest.raises(ValueError, match=SAME_SHAPE) as wrapped:
        sb.submit(**seeded(kwargs))
    assert str(wrapped.value) == str(plain.value)
    assert sb.engine._thread is None  # refused in the caller, before the engine ran anything
    enable_step_batching(pipe)
    try:
        with pytest.raises(ValueError, match=SAME_SHAPE) as hooked:
            run(pipe, kwargs)
    finally:
        disable_step_batching(pipe)
    assert str(hooked.value) == str(plain.value)


def qwen_texts(pipe, prompts, negatives):
    """Qwen-Image embeddings and masks: each list is padded to its longest prompt, so the two differ in length."""
    embeds, mask = pipe.encode_prompt(prompts, device="cpu")
    negative, negative_mask = pipe.encode_prompt(negatives, device="cpu")
    return dict(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=negative,
                negative_prompt_embeds_mask=negative_mask)


QWEN_CASES = {
    "one prompt, a longer negative": (["a cat"], ["a very long and blurry, ugly negative prompt"]),
    "two prompts, a shorter negative each": (["a red circle on a wide blue field", "a cat"], ["blurry", "ugly"]),
}


@pytest.mark.parametrize("with_masks", [True, False], ids=["masks", "no-masks"])
@pytest.mark.parametrize("case", list(QWEN_CASES))
def test_qwenimage_negative_embeds_of_another_length_give_the_plain_output(case, with_masks):
    pipe = pipe_for("qwen-tiny")
    arguments = qwen_texts(pipe, *QWEN_CASES[case])
    assert arguments["negative_prompt_embeds"].shape[1] != arguments["prompt_embeds"].shape[1]
    if not with_masks:  # diffusers then treats every token as valid (it warns)
        arguments = {k: v for k, v in arguments.items() if not k.endswith("mask")}
    kwargs = call_kwargs("qwen-tiny", prompt=None, true_cfg_scale=3.0, **arguments)
    other = call_kwargs("qwen-tiny", prompt="a small green square in the corner", negative_prompt="noise",
                        true_cfg_scale=2.0, seed=1)
    expected, expected_other = run(pipe, kwargs), run(pipe, other)
    with StepBatched(pipe, max_batch_size=8) as sb:
        assert max_diff(run(sb, kwargs), expected) <= TOLERANCE
        futures = [sb.submit(**seeded(kwargs)), sb.submit(**seeded(other))]  # sharing batches
        together = [future.result(timeout=300).images for future in futures]
    assert max_diff(together[0], expected) <= TOLERANCE
    assert max_diff(together[1], expected_other) <= TOLERANCE
    enable_step_batching(pipe)
    try:
        hooked = run(pipe, kwargs)
    finally:
        disable_step_batching(pipe)
    assert max_diff(hooked, expected) <= TOLERANCE


def test_flux_negative_embeds_of_another_length_without_true_cfg_are_ignored_as_in_diffusers():
    """true_cfg_scale 1: Flux skips the shape check and the negative branch (the output is the positive
    embeddings' alone); so it is wrapped."""
    pipe = pipe_for("flux")
    arguments = dict(embeds_of_two_lengths("flux", pipe), true_cfg_scale=1.0)
    kwargs = call_kwargs("flux", prompt=None, **arguments)
    expected = run(pipe, kwargs)
    positive_only = call_kwargs("flux", prompt=None, prompt_embeds=arguments["prompt_embeds"],
                                pooled_prompt_embeds=arguments["pooled_prompt_embeds"])
    assert max_diff(expected, run(pipe, positive_only)) == 0
    with StepBatched(pipe) as sb:
        assert max_diff(run(sb, kwargs), expected) <= TOLERANCE
