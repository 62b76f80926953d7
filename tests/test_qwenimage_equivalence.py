"""StepBatched(QwenImagePipeline) output == the unwrapped pipeline's solo output, alone and batched.

Prompts of different lengths share a forward (padded to the batch's longest, masked); solo runs of prompts
of one length pass no mask at all. Both must give the same image.
"""

import pytest
import torch

from diffusers_stepbatch import StepBatched

from .references import (  # noqa: F401  (single_thread is a fixture)
    TOLERANCE, count_forwards, family_pipe, family_size, max_diff, seeded, single_thread, submit_all,
)

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = ["qwen-tiny", "qwen-wide"]


def kwargs_for(name, **overrides):
    height, width = family_size(name)
    kwargs = dict(prompt="a red circle", height=height, width=width, num_inference_steps=3, seed=0,
                  output_type="pt")
    kwargs.update(overrides)
    return kwargs


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("true_cfg", [False, True])
def test_solo_equals_diffusers(name, true_cfg):
    pipe = family_pipe(name)
    extra = dict(negative_prompt="blurry and dark", true_cfg_scale=3.0) if true_cfg else {}
    kwargs = kwargs_for(name, **extra)
    expected = pipe(**seeded(kwargs)).images
    with StepBatched(pipe) as sb:
        got = sb(**seeded(kwargs)).images
    assert got.shape == expected.shape
    assert max_diff(got, expected) <= TOLERANCE


def mixed_requests(name):
    """Prompt lengths 1..40 characters, true CFG scales 1.5..5, 2..5 steps, a prompt list and given embeddings."""
    pipe = family_pipe(name)
    embeds, mask = pipe.encode_prompt(["a tiny red dot", "a much longer prompt about a dog"])
    return [
        kwargs_for(name, prompt="x", num_inference_steps=2, seed=1),
        kwargs_for(name, prompt="a blue square at the top left of a gray field", negative_prompt="noise",
                   true_cfg_scale=5.0, num_inference_steps=4, seed=2),
        kwargs_for(name, prompt=["a cat", "a cat sitting on a very long red sofa"], negative_prompt=["dog", "x"],
                   true_cfg_scale=1.5, num_inference_steps=3, seed=3),
        kwargs_for(name, prompt="a green cross", negative_prompt="a long, long, long negative prompt",
                   true_cfg_scale=3.0, num_inference_steps=5, seed=4),
        kwargs_for(name, prompt=None, prompt_embeds=embeds, prompt_embeds_mask=mask, num_inference_steps=3, seed=5),
    ]


@pytest.mark.parametrize("name", CONFIGS)
def test_mixed_prompt_lengths_and_scales_equal_solo_runs(name):
    pipe = family_pipe(name)
    requests = mixed_requests(name)
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    sizes, hook = count_forwards(pipe.transformer)
    try:
        with StepBatched(pipe, max_batch_size=6) as sb:
            results = submit_all(sb, requests)
    finally:
        hook.remove()
    for kwargs, got, want in zip(requests, results, expected):
        assert max_diff(got.images, want) <= TOLERANCE, kwargs["prompt"]
    assert max(sizes) > 1, "the transformer never ran a batch larger than one"
    assert max(sizes) <= 6


def test_padded_rows_match_unpadded_solo_rows():
    """A short prompt batched with a long one (padded + masked) equals its solo, unmasked run."""
    pipe = family_pipe("qwen-tiny")
    short, long = kwargs_for("qwen-tiny", prompt="a", seed=7), kwargs_for("qwen-tiny", prompt="a" * 60, seed=8)
    solo_short = pipe(**seeded(short)).images
    masks = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs["encoder_hidden_states_mask"]), with_kwargs=True)
    try:
        with StepBatched(pipe) as sb:
            got_short, _ = submit_all(sb, [short, long])
    finally:
        hook.remove()
    assert any(mask is not None and not bool(mask.all()) for mask in masks)  # the short row really was padded
    assert max_diff(got_short.images, solo_short) <= TOLERANCE


@pytest.mark.parametrize("overrides, message", [
    (dict(num_inference_steps=0), "num_inference_steps"),
    (dict(prompt=["a", "b"], negative_prompt=["c"], true_cfg_scale=2.0), "negative_prompt"),
    (dict(latents=torch.zeros(1, 3, 16)), "latents"),
    (dict(generator=[torch.Generator(), torch.Generator()]), "generator"),
    (dict(max_sequence_length=2048), "max_sequence_length"),
    (dict(callback_on_step_end_tensor_inputs=["noise"]), "callback_on_step_end_tensor_inputs"),
])
def test_bad_input_raises_value_error_in_caller(overrides, message):
    kwargs = kwargs_for("qwen-tiny", **overrides)
    kwargs.pop("seed")
    with StepBatched(family_pipe("qwen-tiny")) as sb:
        with pytest.raises(ValueError, match=message):
            sb.submit(**kwargs)
    assert not sb.engine.is_alive
