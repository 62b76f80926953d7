"""PiD early exit in the SD3, SDXL and Qwen-Image programs, each with a tiny PiD that reads its family's latent.

The reference decodes below follow nv-tlabs/PiD's conventions as written in its `pipeline_registry.py` (the
latent as the denoiser holds it; SDXL's Euler latents and sigmas divided by sqrt(sigma^2 + 1); Qwen-Image's frame
axis dropped), from tensors the unwrapped diffusers pipeline shows its step callback.
"""

from __future__ import annotations

import functools
import math
import threading
from types import SimpleNamespace

import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler

from diffusers_stepbatch import PiDDecoder, PiDDecoding, SchedulerConfig, StepBatched
from diffusers_stepbatch.decoders.pid import decode
from diffusers_stepbatch.decoders.registry import resolve_decoder
from diffusers_stepbatch.programs.pid.families import pid_family
from diffusers_stepbatch.testing import tiny_qwenimage_pipeline

from .pid_helpers import perturb_, single_thread
from .references import family_pipe, max_diff

TOLERANCE = 1e-4
SR = 4
HEIGHT, WIDTH = 64, 96  # requested output; the main model runs at 16 x 24
_TINY_PID = dict(
    num_groups=2, hidden_size=32, pixel_hidden_size=8, pixel_attn_hidden_size=16, pixel_num_groups=2, patch_depth=2,
    pixel_depth=1, patch_size=16, txt_max_length=16, rope_ref_h=64, rope_ref_w=64, lq_hidden_dim=16,
    lq_num_res_blocks=1, sr_scale=SR,
)  # fmt: skip


@functools.cache
def _qwen_normalised():
    """The tiny Qwen-Image pipeline with a VAE whose latents_mean / latents_std are not 0 / 1, so a decoder fed
    de-normalised latents would differ."""
    pipe = tiny_qwenimage_pipeline()
    pipe.vae.register_to_config(latents_mean=[0.3, -0.2, 0.1, 0.5], latents_std=[0.5, 2.0, 1.5, 0.8])
    return pipe


# name: (pipeline, PiD latent channels, latent_spatial_down_factor (= vae_scale_factor), pipeline text width)
FAMILIES = {
    "sd3-tiny": (lambda: family_pipe("sd3-tiny"), 4, 2, 64),
    "sd3-patch2": (lambda: family_pipe("sd3-patch2"), 8, 4, 64),
    "sdxl-euler": (lambda: family_pipe("sdxl-euler"), 4, 2, 64),
    "sdxl-dpm": (lambda: family_pipe("sdxl-dpm"), 4, 2, 64),
    "qwen-normalised": (_qwen_normalised, 4, 4, 32),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def pipe_for(name):
    return FAMILIES[name][0]()


def tiny_pid(name, seed=0, **overrides) -> PiDDecoder:
    _, channels, down, text = FAMILIES[name]
    config = dict(_TINY_PID, lq_latent_channels=channels, latent_spatial_down_factor=down, txt_embed_dim=text)
    torch.manual_seed(seed)
    return perturb_(PiDDecoder(**{**config, **overrides}), seed).eval()


def call(name, prompt="a red circle", seed=0, steps=4, **kwargs):
    """A guided call (CFG rows in every forward) for the requested HEIGHT x WIDTH."""
    guided = dict(true_cfg_scale=3.0, negative_prompt="blurry") if name.startswith("qwen") else dict(guidance_scale=4.0)
    extra = {} if name.startswith("qwen") else dict(max_sequence_length=16) if name.startswith("sd3") else {}
    defaults = dict(prompt=prompt, height=HEIGHT, width=WIDTH, num_inference_steps=steps, output_type="pt",
                    generator=torch.Generator().manual_seed(seed), **guided, **extra)
    return {**defaults, **kwargs}


class _FakeCaptionEncoder:
    """A stand-in for Gemma: one fixed embedding per character, so every caption has the same length."""

    def __init__(self, dim: int, length: int = 16):
        self.table = torch.randn(256, dim, generator=torch.Generator().manual_seed(7))
        self.length = length

    def encode(self, prompts):
        codes = [[ord(c) % 256 for c in p[: self.length].ljust(self.length)] for p in prompts]
        return self.table[torch.tensor(codes)]


def reference_pid_input(name, pipe, latents, sigma):
    """The latent and sigma PiD reads, per the reference's conventions (not through our pid_families)."""
    if name.startswith("sdxl"):
        scale = (sigma**2 + 1) ** 0.5
        ve_frame = isinstance(pipe.scheduler, EulerDiscreteScheduler)  # DPM-Solver already holds VP latents
        return (latents / scale if ve_frame else latents), sigma / scale
    if name.startswith("qwen"):
        unpacked = pipe._unpack_latents(latents, HEIGHT // SR, WIDTH // SR, pipe.vae_scale_factor)
        assert unpacked.shape[2] == 1  # [B, C, frames, h, w]
        return unpacked[:, :, 0], sigma
    return latents, sigma


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("exit_step, steps", [(2, 4), (3, 3)])
def test_early_exit_equals_pid_decode_of_the_pipelines_x_t(name, exit_step, steps):
    """The unwrapped pipeline at 1/sr_scale: its x_t after K steps, sigmas[K], positive prompt embeddings and
    random stream, decoded by PiD at the requested size, equal StepBatched's early exit."""
    pipe, decoder = pipe_for(name), tiny_pid(name, seed=1)
    captured = {}

    def capture(_pipe, i, _t, tensors):
        if i == exit_step - 1:
            captured["latents"] = tensors["latents"].clone()
            captured["sigma"] = float(_pipe.scheduler.sigmas[exit_step])
            captured["text"] = tensors["prompt_embeds"][-1:].clone()  # the positive row (last under CFG)
            captured["generator"] = generator.get_state()
        return tensors

    generator = torch.Generator().manual_seed(4)
    low = call(name, steps=steps, height=HEIGHT // SR, width=WIDTH // SR, generator=generator)
    pipe(**low, callback_on_step_end=capture, callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"])
    latent, sigma = reference_pid_input(name, pipe, captured["latents"], captured["sigma"])
    stream = torch.Generator().set_state(captured["generator"])
    image = decode(decoder, latent, sigma, captured["text"], generator=[stream], height=HEIGHT, width=WIDTH)
    expected = (image / 2 + 0.5).clamp(0, 1)

    with StepBatched(pipe, decoder=PiDDecoding(decoder, "pipeline"), pid_exit_step=exit_step) as sb:
        got = sb(**call(name, seed=4, steps=steps)).images
    assert (sigma == 0.0) == (exit_step == steps) and sigma < 1.0
    assert got.shape == (1, 3, HEIGHT, WIDTH)
    assert max_diff(got, expected) <= TOLERANCE


def _spatial(name, args, kwargs):
    """The size the main model saw: latent (h, w) for SD3 / SDXL, image tokens for Qwen-Image."""
    hidden = kwargs.get("hidden_states", kwargs.get("sample", args[0] if args else None))
    return int(hidden.shape[1]) if name.startswith("qwen") else tuple(hidden.shape[-2:])


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("exit_step, steps, expected", [(None, 5, 3), (0.5, 4, 2), (4, 4, 4)])
def test_main_model_runs_exactly_k_forwards_at_low_resolution(name, exit_step, steps, expected):
    pipe = pipe_for(name)
    denoiser = pipe.unet if name.startswith("sdxl") else pipe.transformer
    vae_scale = pipe.vae_scale_factor
    low = (HEIGHT // SR // vae_scale, WIDTH // SR // vae_scale)
    low = (low[0] // 2) * (low[1] // 2) if name.startswith("qwen") else low
    seen: list = []
    handle = denoiser.register_forward_pre_hook(lambda _m, a, kw: seen.append(_spatial(name, a, kw)),
                                                with_kwargs=True)
    try:
        with StepBatched(pipe, decoder=PiDDecoding(tiny_pid(name), "pipeline"), pid_exit_step=exit_step) as sb:
            out = sb(**call(name, steps=steps, num_images_per_prompt=2))
    finally:
        handle.remove()
    assert seen == [low] * expected
    assert out.images.shape == (2, 3, HEIGHT, WIDTH)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_pid_decodes_of_several_requests_batched_equal_each_alone(name):
    pipe = pipe_for(name)
    text = "pipeline" if not name.startswith("qwen") else _FakeCaptionEncoder(FAMILIES[name][3])
    decoding = PiDDecoding(tiny_pid(name), text)

    def calls():  # different prompts, seeds, guidance, images per prompt and step counts; all exit at step 3
        qwen = name.startswith("qwen")
        scale = "true_cfg_scale" if qwen else "guidance_scale"
        negatives = dict(negative_prompt=["blurry", "noise"]) if qwen else {}
        return [
            call(name, "a red circle", seed=1, steps=5, **{scale: 3.0}),
            call(name, "a blue square on a gray background", seed=2, steps=4, num_images_per_prompt=2),
            call(name, ["a cat", "a dog"], seed=3, steps=6, **{scale: 5.0}, **negatives),
        ]

    # NOTE: room for every request's CFG rows at once (12); cost_aware=False: the engine may otherwise split a group
    # it measured to be faster in parts.
    scheduler = SchedulerConfig(cost_aware=False, max_batch_size=16)
    with StepBatched(pipe, decoder=decoding, pid_exit_step=3, scheduler=scheduler) as sb:
        alone = [sb(**kwargs).images for kwargs in calls()]
        # NOTE: another request holds the engine in its first step's callback while the three are submitted, so
        # they are admitted in the same engine step and reach their exit together.
        entered, released = threading.Event(), threading.Event()

        def hold_engine(*_):
            entered.set()
            released.wait(60)
            return {}

        blocker = sb.submit(**call(name, height=32 * SR // 2, width=32 * SR // 2, steps=4,
                                   callback_on_step_end=hold_engine))
        assert entered.wait(60)
        handles = [sb.submit(**kwargs) for kwargs in calls()]
        released.set()
        together = [h.result(timeout=300).images for h in handles]
        blocker.result(timeout=300)
        histogram = sb.stats()["rows_histogram"]["pid"]
    assert 5 in histogram, f"the three requests' PiD rows (1 + 2 + 2) were not decoded in one call: {histogram}"
    for a, b in zip(alone, together):
        assert a.shape == b.shape and a.shape[-2:] == (HEIGHT, WIDTH)
        assert max_diff(a, b) <= TOLERANCE
    assert max_diff(together[2][0], together[2][1]) > 1e-2  # rows really differ


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("bad", ["height", "width", "exit_beyond_steps", "latent_output"])
def test_bad_calls_raise_in_the_caller(name, bad):
    pipe = pipe_for(name)
    # the main model's multiple x sr_scale, and PiD's 16-pixel patches
    multiple = math.lcm(pid_family(pipe).size_multiple(pipe) * SR, 16)
    kwargs, match = {
        "height": (dict(height=multiple + 8), rf"height={multiple + 8} must be divisible by {multiple} for PiD"),
        "width": (dict(width=multiple // 2), rf"width={multiple // 2} must be divisible by {multiple} for PiD"),
        "exit_beyond_steps": (dict(steps=2), r"pid_exit_step=3 is beyond num_inference_steps=2"),
        "latent_output": (dict(output_type="latent"), r"output_type='latent' skips decoding"),
    }[bad]
    with StepBatched(pipe, decoder=PiDDecoding(tiny_pid(name), "pipeline"), pid_exit_step=3) as sb:
        with pytest.raises(ValueError, match=match):
            sb.submit(**call(name, **kwargs))
        assert sb.stats()["requests_finished"] == {}  # nothing entered the engine


def test_sdxl_refiner_handoff_and_unknown_schedulers_raise():
    pipe = pipe_for("sdxl-euler")
    decoding = PiDDecoding(tiny_pid("sdxl-euler"), "pipeline")
    refused = pytest.raises(ValueError, match=r"denoising_end=0.8 hands the latent to a refiner")
    with StepBatched(pipe, decoder=decoding, pid_exit_step=2) as sb, refused:
        sb.submit(**call("sdxl-euler", denoising_end=0.8))
    ddim = DDIMScheduler.from_config(pipe.scheduler.config)
    swapped = type(pipe)(**{**pipe.components, "scheduler": ddim})
    with pytest.raises(ValueError, match=r"got DDIMScheduler"):
        StepBatched(swapped, decoder=decoding)
    with StepBatched(pipe, decoder=decoding, pid_exit_step=2) as sb:
        original = pipe.scheduler
        pipe.scheduler = ddim  # swapped after the engine was built: refused at submit
        try:
            with pytest.raises(ValueError, match=r"got DDIMScheduler"):
                sb.submit(**call("sdxl-euler"))
        finally:
            pipe.scheduler = original


@pytest.mark.parametrize("name", ["sd3-tiny", "sd3-patch2", "sdxl-euler", "qwen-normalised"])
@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(lq_latent_channels=16), r"reads 16-channel latents, \w+'s VAE has (4|8)"),
        (dict(latent_spatial_down_factor=8), r"latent_spatial_down_factor=8 differs .* vae_scale_factor=(2|4)"),
        (dict(txt_embed_dim=24), r"gives (64|32)-dim prompt embeddings but the PiD decoder expects txt_embed_dim=24"),
    ],
)
def test_construction_checks_the_decoder_reads_the_pipelines_latents(name, overrides, match):
    pipe = pipe_for(name)
    with pytest.raises(ValueError, match=match):
        StepBatched(pipe, decoder=PiDDecoding(tiny_pid(name, **overrides), "pipeline"))


def test_families_without_an_early_exit_program_are_refused():
    pipe = family_pipe("sd-euler")
    with pytest.raises(ValueError, match=r"PiD decoding is implemented for \['FluxPipeline', "
                                         r"'StableDiffusion3Pipeline', 'StableDiffusionXLPipeline', "
                                         r"'QwenImagePipeline', 'Flux2Pipeline', 'Flux2KleinPipeline', "
                                         r"'Flux2KleinKVPipeline', 'ZImagePipeline'\], not StableDiffusionPipeline"):
        StepBatched(pipe, decoder=PiDDecoding(tiny_pid("sdxl-euler"), "pipeline"))


@pytest.mark.parametrize(
    "name, checkpoint",
    [
        ("sd3-tiny", "PiD_res2k_sr4x_official_sd3_distill_4step"),
        ("sdxl-euler", "PiD_res2kto4k_sr4x_official_sdxl_distill_4step"),
        ("qwen-normalised", "PiD_v1pt5_res2kto4k_sr4x_official_qwenimage_distill_4step"),
        ("sd-euler", None),
        ("pixart-tiny", None),
    ],
)
def test_pid_by_name_picks_the_familys_released_checkpoint(monkeypatch, name, checkpoint):
    from diffusers_stepbatch.decoders.pid.configs import get_official_config

    pipe = pipe_for(name) if name in FAMILIES else family_pipe(name)
    asked = []

    def fake_from_pretrained(repo, checkpoint=None, **_):
        asked.append((repo, checkpoint))
        return tiny_pid("sdxl-euler")

    monkeypatch.setattr(PiDDecoder, "from_pretrained", staticmethod(fake_from_pretrained))
    if checkpoint is None:
        with pytest.raises(ValueError, match=rf"no released checkpoint for {type(pipe).__name__} \(released for: "
                                             r"FluxPipeline, StableDiffusion3Pipeline, StableDiffusionXLPipeline, "
                                             r"QwenImagePipeline"):
            resolve_decoder("pid", pipe)
        return
    decoding = resolve_decoder("pid", pipe)
    assert asked == [("nvidia/PiD", checkpoint)] and isinstance(decoding, PiDDecoding)
    released = get_official_config(checkpoint)
    assert pid_family(pipe).name in released.families
    # NOTE: the released config reads the real pipeline's latent: channels and VAE downsampling.
    real = {"sd3": (16, 8), "sdxl": (4, 8), "qwenimage": (16, 8)}[pid_family(pipe).name]
    assert (released.constructor["lq_latent_channels"], released.constructor["latent_spatial_down_factor"]) == real


def test_sdxl_fp16_latents_are_converted_to_the_vp_frame_in_float32():
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       timestep_spacing="leading", steps_offset=1)
    scheduler.set_timesteps(10)
    view = SimpleNamespace(scheduler=scheduler)
    latents = (torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)) * 9).half()
    lq, sigma = pid_family(family_pipe("sdxl-euler")).to_pid(view, latents, 1, 16, 16)
    s = float(scheduler.sigmas[1])
    expected = latents.double() / (s**2 + 1) ** 0.5
    assert lq.dtype == torch.float32 and sigma.dtype == torch.float32
    assert max_diff(lq.double(), expected) <= 1e-5
    assert max_diff((latents / (s**2 + 1) ** 0.5).double(), expected) > 1e-4  # fp16 arithmetic would not be
    assert torch.allclose(sigma, torch.full((2,), s / (s**2 + 1) ** 0.5))
    assert 0 < float(sigma[0]) < 1 < s
