"""Row rules the model layer declares per denoiser class, and per-request copies of stateful components.

Each test fails without its rule: AnimateDiff's per-frame text blocks, ControlNet residuals and scalar timestep
(merged calls used to fail; residuals kept requests apart), rows on another dimension (HiDream's Llama states: a
merged call re-split one request's states), the unCLIP priors' scalar timestep (requests of other step counts
never shared a forward), a guider's step state (HunyuanImage: one request's `set_state` changed another's),
combined pipelines (their sub-pipelines' denoisers were never shared).
"""

import pytest
import torch
from PIL import Image
from diffusers import DDIMScheduler, DiffusionPipeline

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.models import ModelSupport, register_model

from .references import TOLERANCE, count_forwards, max_diff, seeded, single_thread, submit_all  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


def _batched(pipe, requests, model):
    """The requests submitted together; (their results, the batch size of every forward of `model`)."""
    rows, hook = count_forwards(model)
    try:
        with StepBatched(pipe) as sb:
            return submit_all(sb, requests), rows
    finally:
        hook.remove()


def _animatediff(frames_channels: tuple[int, int], controlnet: bool = False):
    from diffusers import (
        AnimateDiffControlNetPipeline,
        AnimateDiffPipeline,
        AutoencoderKL,
        ControlNetModel,
        MotionAdapter,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffusers_stepbatch.testing import tiny_clip_tokenizer

    channels, heads = frames_channels
    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(channels, channels), layers_per_block=1, sample_size=8,
                                in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=8,
                                norm_num_groups=2)
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(channels, channels), in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        latent_channels=4, norm_num_groups=2)
    tokenizer = tiny_clip_tokenizer()
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(CLIPTextConfig(hidden_size=8, intermediate_size=37, num_attention_heads=4,
                                                num_hidden_layers=2, vocab_size=len(tokenizer)))
    torch.manual_seed(0)
    adapter = MotionAdapter(block_out_channels=(channels, channels), motion_layers_per_block=1,
                            motion_norm_num_groups=2, motion_num_attention_heads=heads)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="linear", clip_sample=False)
    components = dict(vae=vae, text_encoder=text_encoder.eval(), tokenizer=tokenizer, unet=unet,
                      motion_adapter=adapter, scheduler=scheduler, feature_extractor=None, image_encoder=None)
    if controlnet:
        torch.manual_seed(0)
        components["controlnet"] = ControlNetModel(
            block_out_channels=(channels, channels), layers_per_block=1, in_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), cross_attention_dim=8,
            conditioning_embedding_out_channels=(8, 8), norm_num_groups=1).eval()
        with torch.no_grad():  # NOTE: its zero-initialised output convolutions would give every request zero residuals
            for parameter in components["controlnet"].parameters():
                if not parameter.any():
                    parameter.normal_(0, 0.1)
    pipe = (AnimateDiffControlNetPipeline if controlnet else AnimateDiffPipeline)(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("channels_heads", [(8, 4), (16, 2)])
def test_animatediff_requests_share_forwards_across_steps_and_prompts(channels_heads):
    pipe = _animatediff(channels_heads)
    requests = [dict(prompt=f"a squirrel {'eating ' * i}", num_frames=4, height=16, width=16,
                     num_inference_steps=2 + i % 2, guidance_scale=1.0 + 2 * i, output_type="pt", seed=i)
                for i in range(4)]
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    rows, hook = count_forwards(pipe.unet)
    try:
        with StepBatched(pipe, max_batch_size=16) as sb:
            results = submit_all(sb, requests)
            stats = sb.stats()
    finally:
        hook.remove()
    assert max(max_diff(got.frames, want) for got, want in zip(results, expected)) <= TOLERANCE
    assert max(rows) > 2, f"no forward held several requests' rows: {rows}"
    assert not any("raised" in reason for reason in stats["splits"]), stats["splits"]


@pytest.mark.parametrize("frames", [2, 4])
@pytest.mark.parametrize("channels_heads", [(8, 4), (16, 2)])
def test_animatediff_controlnet_residuals_are_per_frame_rows(channels_heads, frames):
    pipe = _animatediff(channels_heads, controlnet=True)
    requests = [dict(prompt=f"a squirrel {'eating ' * i}", num_frames=frames, height=16, width=16,
                     conditioning_frames=[Image.new("RGB", (16, 16), (40 * i + 20 * f, 90, 200 - 30 * f))
                                          for f in range(frames)],
                     num_inference_steps=2 + i % 2, guidance_scale=1.0 + 2 * i, output_type="pt", seed=i)
                for i in range(4)]
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    results, rows = _batched(pipe, requests, pipe.unet)
    assert max(max_diff(got.frames, want) for got, want in zip(results, expected)) <= TOLERANCE
    # each request's residuals differ: without them as rows its calls would never share a forward
    assert max(rows) > 2, f"no forward held several requests' rows: {rows}"


def _kandinsky_prior(width: int):
    from diffusers import KandinskyV22PriorPipeline, PriorTransformer, UnCLIPScheduler
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    from diffusers_stepbatch.testing import tiny_clip_text_encoder, tiny_clip_tokenizer

    tokenizer = tiny_clip_tokenizer()
    torch.manual_seed(0)
    prior = PriorTransformer(num_attention_heads=2, attention_head_dim=12, embedding_dim=width, num_layers=1).eval()
    with torch.no_grad():  # NOTE: a zero clip_std would make every output embedding zero
        prior.clip_std.fill_(1.0)
    torch.manual_seed(0)
    image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=width, image_size=28, projection_dim=width, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, patch_size=14)).eval()
    pipe = KandinskyV22PriorPipeline(
        prior=prior, image_encoder=image_encoder, tokenizer=tokenizer,
        text_encoder=tiny_clip_text_encoder(tokenizer, hidden_size=width, projection_dim=width),
        image_processor=CLIPImageProcessor(crop_size=28, size=28),
        scheduler=UnCLIPScheduler(variance_type="fixed_small_log", prediction_type="sample",
                                  num_train_timesteps=1000, clip_sample=True, clip_sample_range=10.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("width", [32, 48])
def test_prior_calls_at_other_timesteps_share_forwards(width):
    """The priors' one timestep per call becomes a per-row vector: requests of other step counts share forwards."""
    pipe = _kandinsky_prior(width)
    requests = [dict(prompt=prompt, num_inference_steps=steps, guidance_scale=4.0 + i, output_type="pt", seed=i)
                for i, (prompt, steps) in enumerate((("a horse", 2), ("a red cat", 3), ("an owl", 4), ("a dog", 5)))]
    expected = [pipe(**seeded(kwargs)).image_embeds for kwargs in requests]
    timesteps = []
    hook = pipe.prior.register_forward_pre_hook(
        lambda _m, args, kwargs: timesteps.append(torch.as_tensor(
            args[1] if len(args) > 1 else kwargs["timestep"]).unique().numel()),
        with_kwargs=True)
    try:
        results, _ = _batched(pipe, requests, pipe.prior)
    finally:
        hook.remove()
    assert max(max_diff(got.image_embeds, want) for got, want in zip(results, expected)) <= TOLERANCE
    assert max(timesteps) > 1, f"no forward held rows at different timesteps: {timesteps}"


class _LayersFirst(torch.nn.Module):
    """Text states [layers, batch, tokens, dim], flattened per row with `.view`, as HiDream's forward does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, hidden_states, timestep, text_states):
        batch = hidden_states.shape[0]
        text = text_states.sum(0).view(batch, -1, 4).mean(1)
        return self.proj(hidden_states) * timestep[:, None] + text


class _ToyPipeline(DiffusionPipeline):
    def __init__(self, unet, scheduler):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler)

    @torch.no_grad()
    def __call__(self, prompt_seed: int = 0, num_inference_steps: int = 3, generator=None):
        self.scheduler.set_timesteps(num_inference_steps)
        text = torch.randn(3, 1, 6, 4, generator=torch.Generator().manual_seed(prompt_seed))
        x = torch.randn(1, 4, generator=generator)
        for t in self.scheduler.timesteps:
            x = x - 0.1 * self.unet(x, t.float().reshape(1) / 1000, text)
        return x


@register_model(_LayersFirst)
def _layers_first() -> ModelSupport:
    return ModelSupport(row_dims={"text_states": 1}, trusted=True)


def test_rows_on_another_dimension_merge_by_that_dimension():
    pipe = _ToyPipeline(_LayersFirst(), DDIMScheduler())
    requests = [dict(prompt_seed=i % 2, num_inference_steps=3, seed=i) for i in range(4)]
    expected = [pipe(**seeded(kwargs)) for kwargs in requests]
    results, rows = _batched(pipe, requests, pipe.unet)
    assert all(max_diff(got, want) <= TOLERANCE for got, want in zip(results, expected))
    assert max(rows) > 2  # requests with different text states share forwards


class _GuidedPipeline(DiffusionPipeline):
    """Guidance switched on for the first half of the steps by a diffusers guider, which keeps the step."""

    def __init__(self, unet, scheduler, guider):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler, guider=guider)

    @torch.no_grad()
    def __call__(self, num_inference_steps: int = 4, generator=None):
        self.scheduler.set_timesteps(num_inference_steps)
        x = torch.randn(1, 4, generator=generator)
        for i, t in enumerate(self.scheduler.timesteps):
            self.guider.set_state(step=i, num_inference_steps=num_inference_steps, timestep=t)
            out = self.unet(x, t.float().reshape(1) / 1000, torch.zeros(1, 1, 1, 4))
            scale = self.guider.guidance_scale if self.guider._is_cfg_enabled() else 1.0  # reads its own step
            x = x - 0.1 * scale * out
        return x


def test_every_request_has_its_own_guider_state():
    from diffusers import ClassifierFreeGuidance

    pipe = _GuidedPipeline(_LayersFirst(), DDIMScheduler(), ClassifierFreeGuidance(guidance_scale=5.0, stop=0.5))
    requests = [dict(num_inference_steps=4 + 2 * i, seed=i) for i in range(4)]
    expected = [pipe(**seeded(kwargs)) for kwargs in requests]
    with StepBatched(pipe) as sb:
        results = submit_all(sb, requests)
    assert all(max_diff(got, want) <= TOLERANCE for got, want in zip(results, expected))


def test_combined_pipelines_share_their_sub_pipelines_forwards():
    from diffusers import FluxImg2ImgPipeline

    from .references import flux_pipe

    class TwoStage(DiffusionPipeline):  # a text-to-image pass, then an img2img pass on its output
        def __init__(self, first, second):
            super().__init__()
            self.register_modules(transformer=first.transformer, scheduler=first.scheduler)
            self.first, self.second = first, second

        def __call__(self, prompt: str = "a cat", first_seed: int = 0, **kwargs):
            image = self.first(prompt, generator=torch.Generator().manual_seed(first_seed), output_type="pt",
                               **kwargs)
            return self.second(prompt, image=image.images, strength=0.6, output_type="pt",
                               generator=torch.Generator().manual_seed(first_seed + 1), **kwargs).images

    base = flux_pipe("dev-tiny")
    pipe = TwoStage(base, FluxImg2ImgPipeline(**base.components))
    pipe.second.set_progress_bar_config(disable=True)
    common = dict(height=32, width=32, max_sequence_length=16)
    requests = [dict(prompt=f"a shape {i}", first_seed=i, num_inference_steps=3 + i % 2, **common) for i in range(3)]
    expected = [pipe(**kwargs) for kwargs in requests]
    results, rows = _batched(pipe, requests, base.transformer)
    assert all(max_diff(got, want) <= TOLERANCE for got, want in zip(results, expected))
    assert max(rows) > 1


class _Signatures(torch.nn.Module):
    def forward(self, hidden_states, timestep=None, *extra, scale: float = 1.0, **options):
        return hidden_states


class _PositionalOnly(torch.nn.Module):
    def forward(self, hidden_states, /, timestep, return_dict=True):
        return hidden_states


@pytest.mark.parametrize("model, args, kwargs", [
    (_Signatures(), (), {"timestep": 1, "hidden_states": 2}),
    (_Signatures(), (), {"hidden_states": 2, "scale": 0.5}),
    (_Signatures(), (), {"hidden_states": 2, "mask": 3, "timestep": 1}),  # an extra keyword: into **options
    (_Signatures(), (2,), {"timestep": 1}),
    (_Signatures(), (2, 1, 7), {}),
    (_Signatures(), (), {"timestep": 1}),  # a required argument missing: not bound
    (_PositionalOnly(), (), {"hidden_states": 2, "timestep": 1}),
    (_PositionalOnly(), (2,), {"timestep": 1}),
])
def test_a_call_is_named_as_signature_bind_names_it(model, args, kwargs):
    import inspect

    from diffusers_stepbatch.models.calls import _arguments

    signature = inspect.signature(type(model).forward)
    try:
        bound = signature.bind(model, *args, **kwargs)
    except TypeError:
        want = (None, {**{f"__arg{i}": value for i, value in enumerate(args)}, **kwargs})
    else:
        named = dict(bound.arguments)
        named.pop("self")
        want = (signature, named)
    got = _arguments(model, "forward", args, kwargs)
    assert got == want and list(got[1]) == list(want[1])  # the same names, in the same order
