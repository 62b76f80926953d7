"""PiD early exit for the pipelines the generic program serves: FLUX.2 klein and Z-Image (FLUX.2 dev shares klein's
latent code, tested at the hand-over).

The reference decodes follow nv-tlabs/PiD (`pipeline_registry.extract_latent`, `step_capture.XtCaptureCallback`):
the unwrapped pipeline at 1/sr_scale, its latents after K steps as its step callback shows them (FLUX.2: packed
tokens laid back onto their row-major grid, still batch-normalised; Z-Image: as is), `scheduler.sigmas[K]`, PiD
alone at the requested size.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from diffusers import (
    Flux2KleinKVPipeline,
    Flux2KleinPipeline,
    Flux2Pipeline,
    FlowMatchHeunDiscreteScheduler,
    ZImageImg2ImgPipeline,
)

from diffusers_stepbatch import PiDDecoder, PiDDecoding, SchedulerConfig, StepBatched
from diffusers_stepbatch.decoders.pid import decode
from diffusers_stepbatch.programs.pid.families import pid_family
from diffusers_stepbatch.testing.image_models import tiny_flux2_klein_pipeline, tiny_z_image_pipeline

from .flux2_cases import reference_image
from .pid_helpers import perturb_
from .references import in_lockstep, max_diff, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

TOLERANCE = 1e-4
SR = 4
_TINY_PID = dict(
    num_groups=2, hidden_size=32, pixel_hidden_size=8, pixel_attn_hidden_size=16, pixel_num_groups=2, patch_depth=2,
    pixel_depth=1, patch_size=16, txt_max_length=16, rope_ref_h=64, rope_ref_w=64, lq_hidden_dim=16,
    lq_num_res_blocks=1, sr_scale=SR,
)  # fmt: skip
_V1PT5 = dict(lq_conv_padding_mode="replicate", lq_gate_type="sigma_aware_per_token", pit_lq_inject=True,
              lq_aux_rgb_head=True, rope_ref_h=128, rope_ref_w=128)


@functools.cache
def _klein(seed: int = 0, pipeline_class=Flux2KleinPipeline):
    """Tiny klein whose VAE batch-norm statistics are not 0 / 1, so handing PiD de-normalised latents would differ."""
    pipe = tiny_flux2_klein_pipeline(seed=seed, pipeline_class=pipeline_class)
    channels = pipe.vae.bn.running_mean.numel()
    pipe.vae.bn.running_mean.copy_(torch.linspace(-0.5, 0.7, channels))
    pipe.vae.bn.running_var.copy_(torch.linspace(0.3, 2.5, channels))
    return pipe


@functools.cache
def _flux2_dev():
    """FLUX.2 dev's pipeline on klein's tiny transformer and VAE; its Mistral-3 text encoder has no tiny offline
    processor, so calls pass `prompt_embeds`."""
    klein = _klein()
    pipe = Flux2Pipeline(scheduler=klein.scheduler, vae=klein.vae, text_encoder=None, tokenizer=None,
                         transformer=klein.transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@functools.cache
def _zimage(seed: int = 0):
    return tiny_z_image_pipeline(seed=seed)


# name: (pipeline, PiD overrides, PiD text: "pipeline" or a caption encoder width)
FAMILIES = {
    # v1-style: the packed 4C-channel latent at vae_scale_factor * 2, read as is
    "klein-v1": (_klein, dict(lq_latent_channels=4, latent_spatial_down_factor=2, txt_embed_dim=16), "pipeline"),
    # v1.5-style: PiD unpatchifies the 2x2 patches itself (lq_latent_unpatchify_factor=2)
    "klein-v1pt5": (lambda: _klein(1), dict(lq_latent_channels=4, latent_spatial_down_factor=2,
                                            lq_latent_unpatchify_factor=2, txt_embed_dim=24, **_V1PT5), 24),
    # klein KV: its reference images' keys and values cached after the first step
    "klein-kv-v1": (lambda: _klein(2, Flux2KleinKVPipeline), dict(lq_latent_channels=4, latent_spatial_down_factor=2,
                                                                  txt_embed_dim=16), "pipeline"),
    "flux2-dev": (_flux2_dev, dict(lq_latent_channels=4, latent_spatial_down_factor=2, lq_latent_unpatchify_factor=2,
                                   txt_embed_dim=16), "pipeline"),
    "zimage-v1": (_zimage, dict(lq_latent_channels=16, latent_spatial_down_factor=2, txt_embed_dim=24), 24),
    "zimage-v1pt5": (lambda: _zimage(1), dict(lq_latent_channels=16, latent_spatial_down_factor=2,
                                              txt_embed_dim=24, **_V1PT5), 24),
}


class _FakeCaptionEncoder:
    """A stand-in for Gemma: one fixed embedding per character, every caption the same length."""

    def __init__(self, dim: int, length: int = 16):
        self.table = torch.randn(256, dim, generator=torch.Generator().manual_seed(7))
        self.length = length

    def encode(self, prompts):
        codes = [[ord(c) % 256 for c in p[: self.length].ljust(self.length)] for p in prompts]
        return self.table[torch.tensor(codes)]


def decoding_for(name: str, seed: int = 1, **overrides) -> PiDDecoding:
    _, config, text = FAMILIES[name]
    torch.manual_seed(seed)
    decoder = perturb_(PiDDecoder(**{**_TINY_PID, **config, **overrides}), seed).eval()
    return PiDDecoding(decoder, text if text == "pipeline" else _FakeCaptionEncoder(text))


def call(name: str, prompt="a red circle", seed=0, steps=4, height=64, width=96, **kwargs) -> dict:
    """A guided call at the requested size."""
    extra = dict(text_encoder_out_layers=(1,), max_sequence_length=16) if name.startswith("klein") else {}
    if name == "flux2-dev":  # no tiny text encoder: embeddings made from the prompt's characters
        extra, prompt = dict(prompt_embeds=_FakeCaptionEncoder(16, 8).encode([prompt])), None
    defaults = dict(prompt=prompt, height=height, width=width, num_inference_steps=steps, guidance_scale=4.0,
                    output_type="pt", seed=seed, **extra)
    merged = {**defaults, **kwargs}
    if name.startswith("klein-kv"):  # NOTE: klein KV is distilled: its pipeline takes no guidance
        merged.pop("guidance_scale")
    return merged


def _seeded(kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    kwargs["generator"] = torch.Generator().manual_seed(kwargs.pop("seed"))
    return kwargs


def hand_over(name: str, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The latent PiD reads, computed by hand from the callback's latents."""
    if name.startswith(("klein", "flux2")):  # packed [B, h*w, 4C], tokens row-major over the latent grid
        h, w = height // 2, width // 2  # tiny klein: vae_scale_factor 1, 2x2 patches
        return latents.reshape(latents.shape[0], h, w, latents.shape[-1]).permute(0, 3, 1, 2)
    return latents


def reference(name: str, pipe, decoding: PiDDecoding, kwargs: dict, exit_step: int, callback=None) -> torch.Tensor:
    """The plain pipeline at 1/SR for all its steps, x_t kept after step K, then PiD alone: images in [0, 1]."""
    kwargs = _seeded(kwargs)
    height, width = kwargs["height"], kwargs["width"]
    kept = {}

    def keep(step_pipe, i, _t, tensors):
        if callback is not None:
            tensors = {**tensors, **callback(step_pipe, i, _t, {"latents": tensors["latents"]})}
        if i == exit_step - 1:
            kept.update(latents=tensors["latents"].clone(), text=tensors["prompt_embeds"],
                        sigma=float(step_pipe.scheduler.sigmas[exit_step]))
        return tensors

    pipe(**{**kwargs, "height": height // SR, "width": width // SR, "callback_on_step_end": keep,
            "callback_on_step_end_tensor_inputs": ["latents", "prompt_embeds"]})
    latent = hand_over(name, kept["latents"], height // SR, width // SR)
    images = latent.shape[0]
    if decoding.uses_pipeline_text:
        text = kept["text"]
    else:
        prompts = [kwargs["prompt"]] if isinstance(kwargs["prompt"], str) else kwargs["prompt"]
        text = decoding.text_encoder.encode(prompts).repeat_interleave(images // len(prompts), dim=0)
    # NOTE: the generator was only drawn from for the initial noise; PiD continues its stream
    image = decode(decoding.decoder, latent, kept["sigma"], text, generator=[kwargs["generator"]] * images,
                   height=height, width=width)
    return (image / 2 + 0.5).clamp(0, 1)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_concurrent_early_exits_equal_the_hand_made_reference_and_share_pid_calls(name):
    """Different sizes, seeds, step counts and prompts, planned together with a decoder=None call: every request
    equals the plain pipeline's x_t after K steps decoded by PiD alone, and the two same-size requests' PiD rows run
    in one call."""
    pipe, decoding = FAMILIES[name][0](), decoding_for(name)
    calls = [
        call(name, "a red circle", seed=1, steps=3),
        call(name, "a blue square on a gray background", seed=2, steps=5),
        call(name, "a cat", seed=3, steps=4, height=96, width=64, guidance_scale=2.5),
    ]
    plain = call(name, "a dog", seed=4, steps=3, height=16, width=24)  # decoder=None: all steps, VAE decode
    scheduler = SchedulerConfig(cost_aware=False, max_batch_size=16)
    with StepBatched(pipe, decoder=decoding, pid_exit_step=2, scheduler=scheduler) as sb:
        *got, got_plain = in_lockstep(sb, [*calls, {**plain, "decoder": None}])
        histogram = sb.stats()["rows_histogram"]["pid"]
    assert histogram == Counter({2: 1, 1: 1}), histogram  # 64 x 96 (two requests) and 96 x 64
    assert max_diff(got_plain, pipe(**_seeded(plain)).images) <= TOLERANCE
    for kwargs, images in zip(calls, got):
        assert images.shape == (1, 3, kwargs["height"], kwargs["width"])
        assert max_diff(images, reference(name, pipe, decoding, kwargs, exit_step=2)) <= TOLERANCE
    assert max_diff(got[0], got[1]) > 1e-2  # the requests really differ


@pytest.mark.parametrize("exit_step", [1, 2])
def test_klein_kv_requests_with_reference_images_exit_early(exit_step):
    """klein KV requests with 0-2 reference images of other sizes (their first step fills the KV cache, the later
    ones read it) exit after K steps: each equals the plain pipeline's x_t decoded by PiD alone."""
    name = "klein-kv-v1"
    pipe, decoding = FAMILIES[name][0](), decoding_for(name)
    calls = [call(name, "a red circle", seed=1, steps=3, image=reference_image(64, 64, 0)),
             call(name, "a cat", seed=2, steps=4, image=[reference_image(64, 96, 1), reference_image(80, 64, 2)]),
             call(name, "a dog", seed=3, steps=3, height=96, width=64)]
    scheduler = SchedulerConfig(cost_aware=False, max_batch_size=16)
    with StepBatched(pipe, decoder=decoding, pid_exit_step=exit_step, scheduler=scheduler) as sb:
        got = in_lockstep(sb, calls)
    for kwargs, images in zip(calls, got):
        assert images.shape == (1, 3, kwargs["height"], kwargs["width"])
        assert max_diff(images, reference(name, pipe, decoding, kwargs, exit_step=exit_step)) <= TOLERANCE
    assert max_diff(got[0], got[1]) > 1e-2  # the requests really differ


@pytest.mark.parametrize("name", ["klein-v1", "flux2-dev", "zimage-v1"])
@pytest.mark.parametrize("exit_step, steps", [(1, 3), (3, 3)])
def test_exit_at_the_first_and_last_step_and_several_images(name, exit_step, steps):
    """K = 1 and K = N (sigma 0: the clean latent), two images per prompt; the main model ran K forwards."""
    pipe, decoding = FAMILIES[name][0](), decoding_for(name)
    kwargs = call(name, steps=steps, num_images_per_prompt=2, height=64, width=64)
    forwards = []
    handle = pipe.transformer.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with StepBatched(pipe, decoder=decoding, pid_exit_step=exit_step) as sb:
            got = sb(**_seeded(kwargs)).images
    finally:
        handle.remove()
    # NOTE: klein calls cond and uncond in turn; Z-Image both rows at once; FLUX.2 dev is guidance-distilled
    guided = 2 if name.startswith("klein") else 1
    assert len(forwards) == exit_step * guided
    assert got.shape == (2, 3, 64, 64)
    assert max_diff(got, reference(name, pipe, decoding, kwargs, exit_step)) <= TOLERANCE


@pytest.mark.parametrize("name", ["klein-v1pt5", "zimage-v1pt5"])
def test_the_callers_step_callback_runs_up_to_the_exit_and_can_change_latents(name):
    pipe, decoding = FAMILIES[name][0](), decoding_for(name)
    seen = []

    def damp(step_pipe, i, _t, tensors):
        seen.append((i, sorted(tensors)))
        return {"latents": tensors["latents"] * 0.8} if i == 0 else tensors

    kwargs = call(name, steps=4, callback_on_step_end_tensor_inputs=["latents"])
    with StepBatched(pipe, decoder=decoding, pid_exit_step=2) as sb:
        got = sb(**_seeded(kwargs), callback_on_step_end=damp).images
    assert seen == [(0, ["latents"]), (1, ["latents"])]  # only what it asked for, only before the exit
    assert max_diff(got, reference(name, pipe, decoding, kwargs, 2, callback=damp)) <= TOLERANCE
    assert max_diff(got, reference(name, pipe, decoding, kwargs, 2)) > 1e-3  # the damping mattered

    def interrupt(step_pipe, i, _t, tensors):
        step_pipe._interrupt = True
        return tensors

    with StepBatched(pipe, decoder=decoding, pid_exit_step=3) as sb:
        with pytest.raises(RuntimeError, match=r"ended before step pid_exit_step=3 \(was it interrupted\?\)"):
            sb(**_seeded(kwargs), callback_on_step_end=interrupt)


@pytest.mark.parametrize("name", ["klein-v1pt5", "zimage-v1"])
@pytest.mark.parametrize("output_type, return_dict", [("pil", True), ("np", False)])
def test_output_comes_back_in_the_pipelines_own_type(name, output_type, return_dict):
    pipe, decoding = FAMILIES[name][0](), decoding_for(name)
    with StepBatched(pipe, decoder=decoding, pid_exit_step=2) as sb:
        as_pt = sb(**_seeded(call(name, steps=3))).images
        out = sb(**_seeded(call(name, steps=3, output_type=output_type, return_dict=return_dict)))
    plain = pipe(**_seeded(call(name, steps=1, height=32, width=32, output_type=output_type,
                                return_dict=return_dict)))
    assert type(out) is type(plain)
    images = out.images if return_dict else out[0]
    if output_type == "pil":
        assert images[0].size == (96, 64)
        got = torch.from_numpy(np.array(images[0])).float() / 255
    else:
        assert images.shape == (1, 64, 96, 3)
        got = torch.as_tensor(images[0])
    assert max_diff(got, as_pt[0].permute(1, 2, 0)) <= 1 / 255 + 1e-6


@pytest.mark.parametrize("name", ["klein-v1", "zimage-v1pt5"])
def test_decoder_none_per_call_gives_the_plain_vae_output(name):
    pipe, decoding = FAMILIES[name][0](), decoding_for(name)
    kwargs = call(name, steps=3, height=32, width=48)
    with StepBatched(pipe, decoder=decoding, pid_exit_step=2) as sb:
        got = sb(**_seeded(kwargs), decoder=None).images
    expected = pipe(**_seeded(kwargs)).images
    assert got.shape == expected.shape == (1, 3, 32, 48)
    assert max_diff(got, expected) <= TOLERANCE


@pytest.mark.parametrize("name", ["klein-v1", "zimage-v1"])
@pytest.mark.parametrize("bad", ["height", "width", "exit_beyond_steps", "latent_output"])
def test_bad_calls_raise_in_the_caller(name, bad):
    pipe = FAMILIES[name][0]()
    multiple = math.lcm(pid_family(pipe).size_multiple(pipe) * SR, 16)  # main-model multiple x SR, PiD patches
    assert multiple == 16
    kwargs, match = {
        "height": (dict(height=multiple + 8), rf"height={multiple + 8} must be divisible by {multiple} for PiD"),
        "width": (dict(width=multiple // 2), rf"width={multiple // 2} must be divisible by {multiple} for PiD"),
        "exit_beyond_steps": (dict(steps=2), r"pid_exit_step=3 is beyond num_inference_steps=2"),
        "latent_output": (dict(output_type="latent"), r"output_type='latent' skips decoding"),
    }[bad]
    with StepBatched(pipe, decoder=decoding_for(name), pid_exit_step=3) as sb:
        with pytest.raises(ValueError, match=match):
            sb.submit(**_seeded(call(name, **kwargs)))
        assert sb.stats()["requests_finished"] == {}  # nothing entered the engine


def test_construction_refuses_what_the_exit_cannot_read():
    zimage, klein = _zimage(), _klein()
    with pytest.raises(ValueError, match=r"text_encoder='pipeline' is not supported for ZImagePipeline"):
        StepBatched(zimage, decoder=PiDDecoding(decoding_for("zimage-v1").decoder, "pipeline"))
    with pytest.raises(ValueError, match=r"reads 16-channel latents, Flux2KleinPipeline's VAE has 4"):
        StepBatched(klein, decoder=decoding_for("klein-v1", lq_latent_channels=16))
    with pytest.raises(ValueError, match=r"latent_spatial_down_factor=1 differs from the pipeline's latent "
                                         r"downsampling 2 \(from its vae_scale_factor=1\)"):
        StepBatched(klein, decoder=decoding_for("klein-v1", latent_spatial_down_factor=1))
    heun = type(zimage)(**{**zimage.components, "scheduler": FlowMatchHeunDiscreteScheduler()})
    with pytest.raises(ValueError, match=r"holds for FlowMatchEulerDiscreteScheduler .* got "
                                         r"FlowMatchHeunDiscreteScheduler"):
        StepBatched(heun, decoder=decoding_for("zimage-v1"))
    img2img = tiny_z_image_pipeline(pipeline_class=ZImageImg2ImgPipeline)
    with pytest.raises(ValueError, match=r"PiD decoding is implemented for \[.*'Flux2Pipeline', 'Flux2KleinPipeline', "
                                         r"'Flux2KleinKVPipeline', 'ZImagePipeline'\], not ZImageImg2ImgPipeline"):
        StepBatched(img2img, decoder=decoding_for("zimage-v1"))


@pytest.mark.parametrize("pipeline_class", [Flux2Pipeline, Flux2KleinPipeline, Flux2KleinKVPipeline])
def test_flux2_hand_over_is_the_batch_normalised_patchified_grid(pipeline_class):
    """FLUX.2's x_t as PiD reads it: the packed tokens on their grid, still batch-normalised. De-normalised and
    unpatchified as the pipeline's tail does, it is the VAE's latent; PiD's unpatchify factor 2 undoes the same
    2x2 patches."""
    pipe = _klein()
    view = pipeline_class.__new__(pipeline_class)  # the family reads only these, as the pipeline's own helpers
    view.__dict__.update(vae_scale_factor=pipe.vae_scale_factor, scheduler=pipe.scheduler)
    pipe.scheduler.set_timesteps(sigmas=[1.0, 0.7, 0.4], mu=0.0)
    gen = torch.Generator().manual_seed(0)
    packed = torch.randn(2, 4 * 6, 4, generator=gen)  # 8 x 12 px at vae_scale_factor 1: a 4 x 6 grid of 2x2 patches
    lq, sigma = pid_family(view).to_pid(view, packed, 2, 8, 12)
    assert lq.shape == (2, 4, 4, 6)
    assert torch.equal(lq, hand_over("klein", packed, 8, 12))
    assert torch.equal(sigma, torch.full((2,), float(pipe.scheduler.sigmas[2])))
    bn = pipe.vae.bn
    raw = pipeline_class._unpatchify_latents(lq * (bn.running_var.view(1, -1, 1, 1) + bn.eps).sqrt()
                                             + bn.running_mean.view(1, -1, 1, 1))
    expected = torch.empty(2, 8, 12)
    for y in range(8):
        for x in range(12):
            c = 2 * (y % 2) + x % 2  # pixel (dy, dx) of a 2x2 patch is channel dy * 2 + dx of its grid cell
            expected[:, y, x] = lq[:, c, y // 2, x // 2] * (bn.running_var[c] + bn.eps).sqrt() + bn.running_mean[c]
    assert max_diff(raw[:, 0], expected) <= 1e-6
    adapter = PiDDecoder(**{**_TINY_PID, "lq_latent_channels": 4, "latent_spatial_down_factor": 2, "sr_scale": 16,
                            "lq_latent_unpatchify_factor": 2}).lq_proj  # one latent pixel per PiD patch
    assert torch.equal(adapter.align(lq, (8, 12)), pipeline_class._unpatchify_latents(lq))


def test_zimage_hand_over_is_the_flow_matching_latent_and_its_sigma():
    """Z-Image's transformer sees 1 - sigma and predicts -velocity; its scheduler still holds
    x_t = (1 - sigma) x0 + sigma noise, so PiD reads the latent as is with scheduler.sigmas[K]."""
    pipe = _zimage()
    pipe.scheduler.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=0.5)
    view = type("View", (), {"scheduler": pipe.scheduler})()
    latents = torch.randn(3, 16, 4, 6, generator=torch.Generator().manual_seed(0))
    lq, sigma = pid_family(pipe).to_pid(view, latents, 2, 8, 12)
    assert lq is latents
    assert torch.equal(sigma, torch.full((3,), float(pipe.scheduler.sigmas[2])))
    lq, sigma = pid_family(pipe).to_pid(view, latents, 4, 8, 12)
    assert float(sigma[0]) == 0.0  # K = N: the clean latent


@pytest.mark.parametrize("name, checkpoint, real", [
    ("klein-v1", "PiD_res2k_sr4x_official_flux2_distill_4step", (128, 16)),
    ("zimage-v1", "PiD_res2k_sr4x_official_flux_distill_4step", (16, 8)),
])  # fmt: skip
def test_pid_by_name_picks_the_released_checkpoint(monkeypatch, name, checkpoint, real):
    from diffusers_stepbatch.decoders.pid.configs import get_official_config
    from diffusers_stepbatch.decoders.registry import resolve_decoder

    pipe, asked = FAMILIES[name][0](), []

    def fake_from_pretrained(repo, checkpoint=None, **_):
        asked.append((repo, checkpoint))
        return decoding_for(name).decoder

    monkeypatch.setattr(PiDDecoder, "from_pretrained", staticmethod(fake_from_pretrained))
    assert isinstance(resolve_decoder("pid", pipe), PiDDecoding)
    assert asked == [("nvidia/PiD", checkpoint)]
    released = get_official_config(checkpoint)
    assert pid_family(pipe).name in released.families
    # NOTE: the released config reads the real pipeline's latent: FLUX.2's 32-channel VAE latent in 2x2 patches
    # (4 x 32 channels at 8 x 2 downsampling), Z-Image's 16-channel one at 8
    assert (released.constructor["lq_latent_channels"], released.constructor["latent_spatial_down_factor"]) == real
