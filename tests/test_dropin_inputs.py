"""Bad input fails in the caller, before the request enters a batch, with an error naming the argument; what the
plain pipeline accepts (legacy output types, resizable sizes, one pooled row for several prompts) works wrapped
with the plain output; where we run the pipeline's own check, the message is the pipeline's."""

import logging

import numpy as np
import pytest
import torch
from PIL import Image
from diffusers import ConsistencyDecoderVAE, StableDiffusionPipeline, StableDiffusionXLPipeline

from diffusers_stepbatch import SchedulerConfig, StepBatched
from diffusers_stepbatch.toy import load_pipeline

from .dropin_helpers import call_kwargs, pipe_for, run
from .references import TOLERANCE, max_diff, seeded, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")
FAMILY_PROGRAMS = ["flux", "sd3-tiny", "qwen-tiny", "sdxl-euler", "sd-euler"]


def embeds_for(name, pipe):
    """(prompt_embeds, pooled or None) as the family's encode_prompt returns them for one prompt."""
    if name == "flux":
        embeds, pooled, _ = pipe.encode_prompt("a cat", prompt_2=None, max_sequence_length=16)
        return embeds, pooled
    if name.startswith("qwen"):
        return pipe.encode_prompt("a cat", device="cpu")[0], None
    if name.startswith("sd3"):
        out = pipe.encode_prompt("a cat", None, None, do_classifier_free_guidance=False, max_sequence_length=16)
        return out[0], out[2]
    if name.startswith("sdxl"):
        out = pipe.encode_prompt("a cat", do_classifier_free_guidance=False)
        return out[0], out[2]
    return pipe.encode_prompt("a cat", "cpu", 1, False)[0], None


def not_a_dict(view, i, t, callback_kwargs):
    return None


BAD_INPUTS = [
    ("guidance_scale", "3.5", TypeError), ("guidance_scale", float("nan"), ValueError),
    ("guidance_scale", float("inf"), ValueError), ("generator", 5, TypeError), ("prompt", [], ValueError),
    ("prompt", ["ok", 5], ValueError), ("callback_on_step_end", "not callable", TypeError),
    ("sigmas", "abc", TypeError), ("height", "32", TypeError), ("height", 0, ValueError),
    ("height", -16, ValueError), ("width", 32.5, ValueError), ("num_inference_steps", 0, ValueError),
    ("latents", torch.empty(1, 4, 4, 4, device="meta"), ValueError),
]


@pytest.mark.parametrize("name", FAMILY_PROGRAMS)
@pytest.mark.parametrize("argument, value, error", BAD_INPUTS, ids=[f"{a}={v!r}"[:30] for a, v, _ in BAD_INPUTS])
def test_bad_inputs_fail_in_the_caller_naming_the_argument(name, argument, value, error):
    pipe = pipe_for(name)
    sb = StepBatched(pipe)
    try:
        if argument == "sigmas" and name.startswith(("sd-", "sdxl")):
            argument = "timesteps"
        kwargs = call_kwargs(name, **{argument: value})
        if argument == "generator":
            kwargs.pop("seed")
        with pytest.raises(error, match=argument):
            sb.submit(**seeded(kwargs))
        assert sb.engine._thread is None  # nothing reached the engine
    finally:
        sb.close()


@pytest.mark.parametrize("name", ["flux", "sd3-tiny", "qwen-tiny"])
def test_max_sequence_length_must_be_positive(name):
    with StepBatched(pipe_for(name)) as sb, pytest.raises(ValueError, match="max_sequence_length"):
        sb.submit(**seeded(call_kwargs(name, max_sequence_length=-1)))


@pytest.mark.parametrize("name", FAMILY_PROGRAMS)
def test_given_embeddings_of_the_wrong_width_dtype_or_rank(name):
    pipe = pipe_for(name)
    embeds, pooled = embeds_for(name, pipe)
    extra = {} if pooled is None else {"pooled_prompt_embeds": pooled}
    bad = {"width": embeds[..., :-1], "dtype": embeds.to(torch.int64), "rank": embeds[0]}
    with StepBatched(pipe) as sb:
        for value in bad.values():
            kwargs = call_kwargs(name, prompt=None, prompt_embeds=value, guidance_scale=1.0, **extra)
            with pytest.raises(ValueError, match="prompt_embeds"):
                sb.submit(**seeded(kwargs))
        if pooled is not None:
            kwargs = call_kwargs(name, prompt=None, prompt_embeds=embeds, pooled_prompt_embeds=pooled[..., :-1],
                                 guidance_scale=1.0)
            with pytest.raises(ValueError, match="pooled_prompt_embeds"):
                sb.submit(**seeded(kwargs))
        # and the right ones give the plain output
        kwargs = call_kwargs(name, prompt=None, prompt_embeds=embeds, guidance_scale=1.0, **extra)
        assert max_diff(run(sb, kwargs), run(pipe, kwargs)) <= TOLERANCE


@pytest.mark.parametrize("name", ["flux", "sd-euler"])
def test_a_callback_that_returns_no_dict_fails_its_request_clearly(name):
    with StepBatched(pipe_for(name)) as sb:
        future = sb.submit(**seeded(call_kwargs(name, callback_on_step_end=not_a_dict)))
        error = future.exception(timeout=120)
        assert isinstance(error, TypeError) and "callback_on_step_end returned NoneType" in str(error)


def test_image_size_limit_names_the_limit():
    pipe = pipe_for("flux")
    with StepBatched(pipe) as sb, pytest.raises(ValueError, match=r"max_pixels"):
        sb.submit(**seeded(call_kwargs("flux", height=100000, width=100000)))
    with StepBatched(pipe, scheduler=SchedulerConfig(max_pixels=32 * 32)) as sb:
        with pytest.raises(ValueError, match=r"1536 pixels .* limit of 1024 \(SchedulerConfig\(max_pixels"):
            sb.submit(**seeded(call_kwargs("flux", height=32, width=48)))
        assert max_diff(run(sb, call_kwargs("flux")), run(pipe, call_kwargs("flux"))) <= TOLERANCE
    with pytest.raises(ValueError, match="max_pixels"):
        SchedulerConfig(max_pixels=0)


@pytest.mark.parametrize("name, height", [("flux", 34), ("qwen-tiny", 36)])
def test_sizes_diffusers_resizes_are_resized_with_its_warning(name, height, caplog):
    pipe = pipe_for(name)
    kwargs = call_kwargs(name, height=height)
    expected = run(pipe, kwargs)
    with StepBatched(pipe) as sb, caplog.at_level(logging.WARNING):
        caplog.clear()
        got = run(sb, kwargs)
        assert "Dimensions will be resized accordingly" in caplog.text
    assert got.shape == expected.shape and max_diff(got, expected) <= TOLERANCE


@pytest.mark.parametrize("name", ["flux", "qwen-tiny", "toy"])
@pytest.mark.parametrize("side", ["height", "width"])
def test_a_side_below_one_latent_patch_fails_in_the_caller(name, side):
    # NOTE: Flux and Qwen-Image round sides down to vae_scale_factor x 2; below that the plain pipeline fails
    # inside a model (a RuntimeError from a conv or a reshape), wrapped it fails in the caller, naming the side.
    pipe = load_pipeline() if name == "toy" else pipe_for(name)
    pipe.set_progress_bar_config(disable=True)
    smallest = pipe.vae_scale_factor * 2
    kwargs = call_kwargs("flux" if name == "toy" else name, num_inference_steps=2, **{side: smallest - 1})
    with pytest.raises(RuntimeError):
        run(pipe, kwargs)
    sb = StepBatched(pipe)
    try:
        with pytest.raises(ValueError, match=rf"{side}={smallest - 1} is below .*smallest image side, {smallest} "):
            sb.submit(**seeded(kwargs))
        assert sb.engine._thread is None  # nothing reached the engine
        kwargs[side] = smallest  # the smallest side the pipeline makes works, with the plain output
        expected = run(pipe, kwargs)
        got = run(sb, kwargs)
        assert got.shape == expected.shape and max_diff(got, expected) <= TOLERANCE
    finally:
        sb.close()


@pytest.mark.parametrize("name", ["sd3-tiny", "sdxl-euler", "sd-euler"])
def test_sizes_the_pipeline_refuses_raise_its_own_error(name):
    pipe = pipe_for(name)
    kwargs = call_kwargs(name, height=33)
    with pytest.raises(ValueError) as plain:
        run(pipe, kwargs)
    with StepBatched(pipe) as sb, pytest.raises(ValueError) as wrapped:
        sb.submit(**seeded(kwargs))
    assert str(wrapped.value) == str(plain.value)


@pytest.mark.parametrize("name", FAMILY_PROGRAMS)
def test_legacy_output_type_numpy_is_np_as_in_diffusers(name):
    pipe = pipe_for(name)
    kwargs = call_kwargs(name, output_type="numpy")
    with pytest.warns(FutureWarning, match="outdated"):
        expected = run(pipe, kwargs)
    with StepBatched(pipe) as sb, pytest.warns(FutureWarning, match="outdated"):
        got = run(sb, kwargs)
    assert isinstance(got, np.ndarray) and got.shape == expected.shape
    assert np.abs(got - expected).max() <= TOLERANCE


def test_flux_one_pooled_row_for_several_prompt_embeds():
    pipe = pipe_for("flux")
    embeds, pooled, _ = pipe.encode_prompt(["a cat", "a dog"], prompt_2=None, max_sequence_length=16)
    kwargs = call_kwargs("flux", prompt=None, prompt_embeds=embeds, pooled_prompt_embeds=pooled[:1])
    expected = run(pipe, kwargs)
    with StepBatched(pipe) as sb:
        got = run(sb, kwargs)
    assert got.shape[0] == 2 and max_diff(got, expected) <= TOLERANCE


def consistency_vae():
    torch.manual_seed(0)
    return ConsistencyDecoderVAE(  # the config of diffusers' tests (get_consistency_vae_config)
        encoder_block_out_channels=[4, 4], encoder_in_channels=3, encoder_out_channels=4,
        encoder_down_block_types=["DownEncoderBlock2D"] * 2, decoder_add_attention=False,
        decoder_block_out_channels=[4, 4], decoder_down_block_types=["ResnetDownsampleBlock2D"] * 2,
        decoder_downsample_padding=1, decoder_in_channels=7, decoder_layers_per_block=1, decoder_norm_eps=1e-05,
        decoder_norm_num_groups=1, encoder_norm_num_groups=1, decoder_num_train_timesteps=1024,
        decoder_out_channels=6, decoder_resnet_time_scale_shift="scale_shift", decoder_time_embedding_type="learned",
        decoder_up_block_types=["ResnetUpsampleBlock2D"] * 2, scaling_factor=1, latent_channels=4).eval()


@pytest.mark.parametrize("name, pipeline_class", [("sdxl-euler", StableDiffusionXLPipeline),
                                                  ("sd-euler", StableDiffusionPipeline)])
def test_consistency_decoder_vae_gets_the_generator_as_the_pipeline_passes_it(name, pipeline_class):
    """SDXL decodes without the call's generator (a sampling VAE draws from the global RNG); SD passes it."""
    pipe = pipeline_class(**{**pipe_for(name).components, "vae": consistency_vae()})
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt="a cat", height=32, width=32, num_inference_steps=2, output_type="pt")
    generators = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)]
    torch.manual_seed(123)
    expected = pipe(**kwargs, generator=generators[0]).images
    with StepBatched(pipe) as sb:
        torch.manual_seed(123)
        got = sb(**kwargs, generator=generators[1]).images
    assert max_diff(got, expected) <= TOLERANCE
    assert torch.equal(generators[0].get_state(), generators[1].get_state())


def test_meta_device_latents_of_the_right_shape():
    pipe = pipe_for("flux")
    latents = torch.empty(1, 64, pipe.transformer.config.in_channels, device="meta")  # 32x32: 8x8 packed tokens
    with StepBatched(pipe) as sb, pytest.raises(ValueError, match="latents is on the meta device"):
        sb.submit(**seeded(call_kwargs("flux", latents=latents)))


@pytest.mark.parametrize("value, valid", [
    ([[Image.new("RGB", (8, 8)), None], [Image.new("RGB", (8, 8)), None]], True),  # VisualCloze: None is a target
    ([Image.new("RGB", (8, 8)), torch.zeros(1, 3, 8, 8)], True),
    ([[torch.zeros(3, 8, 8)], [np.zeros((8, 8, 3))]], True),
    ("a cat.png", False), ([Image.new("RGB", (8, 8)), "a cat.png"], False), ([], False), ([[]], False),
])
def test_image_arguments_accept_what_diffusers_takes_and_name_what_it_does_not(value, valid):
    from diffusers_stepbatch.errors import InvalidArgumentType
    from diffusers_stepbatch.programs.checks.call import check_image_input

    if valid:
        check_image_input("image", value)
    else:
        with pytest.raises(InvalidArgumentType, match="image must be a PIL image"):
            check_image_input("image", value)
