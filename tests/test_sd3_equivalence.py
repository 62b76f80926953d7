"""StepBatched(StableDiffusion3Pipeline) output == the unwrapped pipeline's solo output, alone and batched."""

import pytest
import torch

from diffusers_stepbatch import StepBatched

from .references import (  # noqa: F401  (single_thread is a fixture)
    TOLERANCE, assert_batched_equals_solo, count_forwards, family_pipe, family_size, max_diff, seeded, single_thread,
    submit_all,
)

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = ["sd3-tiny", "sd3-patch2"]


def kwargs_for(name, **overrides):
    height, width = family_size(name)
    kwargs = dict(prompt="a red circle", height=height, width=width, num_inference_steps=3, seed=0,
                  output_type="pt", max_sequence_length=16)
    kwargs.update(overrides)
    return kwargs


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("guidance_scale", [1.0, 5.0])
def test_solo_equals_diffusers(name, guidance_scale):
    pipe = family_pipe(name)
    kwargs = kwargs_for(name, guidance_scale=guidance_scale, negative_prompt="blurry")
    expected = pipe(**seeded(kwargs)).images
    with StepBatched(pipe) as sb:
        got = sb(**seeded(kwargs)).images
    assert got.shape == expected.shape
    assert max_diff(got, expected) <= TOLERANCE


def mixed_requests(name):
    """Mixed guidance scales and step counts, clip_skip, skip-layer guidance, lists and output types."""
    return [
        kwargs_for(name, guidance_scale=1.0, num_inference_steps=2, seed=1),
        kwargs_for(name, prompt="a blue square", guidance_scale=5.0, negative_prompt="noise", num_inference_steps=4,
                   seed=2),
        kwargs_for(name, prompt=["a cat", "x"], guidance_scale=3.0, clip_skip=1, seed=3),
        kwargs_for(name, prompt="a green cross", guidance_scale=4.0, num_inference_steps=5, seed=4,
                   skip_guidance_layers=[1], skip_layer_guidance_start=0.0, skip_layer_guidance_stop=0.7),
        kwargs_for(name, prompt="a yellow cross", guidance_scale=2.0, num_inference_steps=3, seed=5,
                   output_type="np", return_dict=False),
    ]


@pytest.mark.parametrize("name", CONFIGS)
def test_mixed_batch_equals_solo_runs(name):
    pipe = family_pipe(name)
    assert_batched_equals_solo(pipe, pipe.transformer, mixed_requests(name), max_batch_size=6)


def test_skip_layer_rows_share_forwards_only_with_the_same_skip_set():
    pipe = family_pipe("sd3-tiny")
    skipping = dict(guidance_scale=4.0, skip_layer_guidance_start=0.0, skip_layer_guidance_stop=1.0,
                    num_inference_steps=4)
    requests = [kwargs_for("sd3-tiny", seed=s, skip_guidance_layers=layers, **skipping)
                for s, layers in [(1, [0]), (2, [0]), (3, [1]), (4, None)]]
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    calls = []
    original = pipe.transformer.forward

    def record(*args, **kwargs):
        calls.append((kwargs["hidden_states"].shape[0], kwargs.get("skip_layers")))
        return original(*args, **kwargs)

    pipe.transformer.forward = record
    try:
        with StepBatched(pipe) as sb:
            results = submit_all(sb, requests)
    finally:
        del pipe.transformer.forward
    assert all(max_diff(r.images, e) <= TOLERANCE for r, e in zip(results, expected))
    skip_forwards = {(rows, tuple(skip)) for rows, skip in calls if skip is not None}
    assert (2, (0,)) in skip_forwards  # the two requests skipping layer 0 shared their skip forward
    assert skip_forwards <= {(1, (0,)), (2, (0,)), (1, (1,))}  # and nobody else's rows joined it


@pytest.mark.parametrize("overrides, message", [
    (dict(height=33), "divisible"),
    (dict(num_inference_steps=0), "num_inference_steps"),
    (dict(guidance_scale=5.0, prompt=["a", "b"], negative_prompt=["c"]), "negative_prompt"),
    (dict(prompt=["a", "b"], prompt_2=["c"]), "prompt_2"),
    (dict(guidance_scale=5.0, skip_guidance_layers=["7"]), "skip_guidance_layers"),
    (dict(latents=torch.zeros(1, 4, 3, 3)), "latents"),
    (dict(generator=[torch.Generator(), torch.Generator()]), "generator"),
    (dict(max_sequence_length=600), "max_sequence_length"),
])
def test_bad_input_raises_value_error_in_caller(overrides, message):
    kwargs = kwargs_for("sd3-tiny", **overrides)
    kwargs.pop("seed")
    with StepBatched(family_pipe("sd3-tiny")) as sb:
        with pytest.raises(ValueError, match=message):
            sb.submit(**kwargs)
    assert not sb.engine.is_alive  # nothing reached the engine (it starts at the first submit)


def test_given_embeddings_and_step_callbacks_stay_per_request():
    pipe = family_pipe("sd3-tiny")
    embeds, negative, pooled, negative_pooled = pipe.encode_prompt("a blue square", None, None,
                                                                   max_sequence_length=16)
    seen = {}

    def shrink(step_pipe, i, t, tensors):
        seen.setdefault(step_pipe.guidance_scale, []).append(i)
        return {"latents": tensors["latents"] * 0.9}

    requests = [
        kwargs_for("sd3-tiny", prompt=None, prompt_embeds=embeds, pooled_prompt_embeds=pooled,
                   negative_prompt_embeds=negative, negative_pooled_prompt_embeds=negative_pooled,
                   guidance_scale=3.0, seed=1),
        kwargs_for("sd3-tiny", guidance_scale=6.0, num_inference_steps=4, seed=2, callback_on_step_end=shrink,
                   callback_on_step_end_tensor_inputs=["latents", "prompt_embeds", "pooled_prompt_embeds"]),
        kwargs_for("sd3-tiny", guidance_scale=2.0, num_inference_steps=2, seed=3, callback_on_step_end=shrink),
    ]
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    reference, seen = seen, {}
    with StepBatched(pipe) as sb:
        results = submit_all(sb, requests)
    assert all(max_diff(r.images, e) <= TOLERANCE for r, e in zip(results, expected))
    assert seen == reference == {6.0: [0, 1, 2, 3], 2.0: [0, 1]}
