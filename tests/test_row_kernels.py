"""Merged calls give each request's rows the GEMM kernel of its solo call, and its activations the rounding of its
solo call (`models/row_kernels.py`).

A Kandinsky 2.2 UNet (image-embedding conditioning) amplifies the rounding between a GEMM of 2 rows and one of 8
past 1e-4 over a few DDIM steps: merged requests differed from their solo runs until each request's per-row
embeddings ran at their solo row count. The combined Kandinsky pipelines amplified the rounding of a CLIP encoder's
`quick_gelu` in the same way: a tensor's last elements take a scalar path that rounds `exp` differently."""

import random

import pytest
import torch

from diffusers_stepbatch import SchedulerConfig, StepBatched
from diffusers_stepbatch.models.row_kernels import invariant_rows, solo_kernels

from .references import TOLERANCE, count_forwards, max_diff


class _Embedder(torch.nn.Module):
    def __init__(self, features: int, hidden: int):
        super().__init__()
        self.first, self.second = torch.nn.Linear(features, hidden), torch.nn.Linear(hidden, features)

    def forward(self, x):
        return self.second(torch.nn.functional.silu(self.first(x)))


@pytest.mark.parametrize("features, hidden", [(32, 128), (48, 320), (256, 1280)])
@pytest.mark.parametrize("rows", [[1, 1, 1, 1], [2, 2, 2, 2], [1, 3, 2], [2, 5, 1, 8]])
@pytest.mark.parametrize("tokens", [None, 1, 3, 7])
def test_each_request_of_a_merged_call_equals_its_solo_call_bit_for_bit(features, hidden, rows, tokens):
    torch.manual_seed(0)
    model = _Embedder(features, hidden)
    shape = (sum(rows), features) if tokens is None else (sum(rows), tokens, features)
    x = torch.randn(shape)
    solo, start = [], 0
    for count in rows:
        solo.append(model(x[start:start + count]))
        start += count
    with torch.no_grad(), solo_kernels(model, rows):
        merged = model(x)
    assert not [name for name, _ in model.named_modules() if "forward" in vars(_)]  # the swap is undone
    start = 0
    for count, want in zip(rows, solo):
        assert torch.equal(merged[start:start + count], want.detach())
        start += count


@pytest.mark.parametrize("features, hidden", [(32, 64), (320, 1280)])
def test_the_measured_limit_is_where_rows_stop_depending_on_the_row_count(features, hidden):
    layer = torch.nn.Linear(features, hidden)
    limit = invariant_rows(layer)
    x = torch.randn(16, features)
    full = layer(x)
    for m in range(limit, 16):
        assert torch.equal(layer(x[:m]), full[:m])
    if limit > 1:
        assert not torch.equal(layer(x[:limit - 1]), full[:limit - 1])


def _tiny_kandinsky22(embed_dim: int, seed: int = 0):
    from diffusers import DDIMScheduler, KandinskyV22Pipeline, UNet2DConditionModel, VQModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        in_channels=4, out_channels=8, addition_embed_type="image", encoder_hid_dim=embed_dim,
        encoder_hid_dim_type="image_proj", cross_attention_dim=32, attention_head_dim=4,
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn", block_out_channels=(32, 64), layers_per_block=1,
        resnet_time_scale_shift="scale_shift", class_embed_type=None)
    torch.manual_seed(seed)
    movq = VQModel(block_out_channels=[32, 64], down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"],
                   up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"], in_channels=3, out_channels=3,
                   latent_channels=4, layers_per_block=1, norm_num_groups=8, norm_type="spatial",
                   num_vq_embeddings=12, vq_embed_dim=4)
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=0.00085, beta_end=0.012,
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1, prediction_type="epsilon")
    pipe = KandinskyV22Pipeline(unet=unet.eval(), scheduler=scheduler, movq=movq.eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _embeds(dim: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([[rng.random() for _ in range(dim)]])


@pytest.mark.parametrize("embed_dim, side", [(32, 64), (24, 48)])
def test_kandinsky22_requests_sharing_forwards_equal_their_plain_runs(embed_dim, side):
    pipe = _tiny_kandinsky22(embed_dim)
    requests = [dict(image_embeds=_embeds(embed_dim, seed), negative_image_embeds=_embeds(embed_dim, seed + 1),
                     height=side, width=side, num_inference_steps=steps, guidance_scale=guidance, output_type="pt",
                     generator=torch.Generator().manual_seed(seed))
                for seed, steps, guidance in [(0, 2, 4.0), (1, 2, 4.0), (2, 3, 4.0), (3, 2, 5.5)]]

    def fresh(kwargs):
        return dict(kwargs, generator=torch.Generator().manual_seed(kwargs["generator"].initial_seed()))

    plain_rows, handle = count_forwards(pipe.unet)
    expected = [pipe(**fresh(kwargs)).images for kwargs in requests]
    handle.remove()
    with StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=8, cost_aware=False)) as sb:
        wrapped_rows, handle = count_forwards(pipe.unet)
        futures = [sb.submit(**fresh(kwargs)) for kwargs in requests]
        results = [future.result(300).images for future in futures]
        handle.remove()
    assert len(wrapped_rows) < len(plain_rows) and max(wrapped_rows) > 2  # requests shared forwards
    for got, want in zip(results, expected):
        assert max_diff(got, want) <= TOLERANCE


def _activations():
    from transformers.activations import ACT2FN

    return {"silu": torch.nn.SiLU, "silu-inplace": lambda: torch.nn.SiLU(inplace=True),
            "gelu": torch.nn.GELU, "gelu-tanh": lambda: torch.nn.GELU(approximate="tanh"), "sigmoid": torch.nn.Sigmoid,
            "quick_gelu": lambda: ACT2FN["quick_gelu"], "mish": torch.nn.Mish}


@pytest.mark.parametrize("activation", _activations())
@pytest.mark.parametrize("rows", [[1, 1, 1, 1], [2, 2, 2, 2], [1, 3, 2], [2, 5, 1, 8]])
@pytest.mark.parametrize("block", [(5,), (3, 13), (7, 37), (2, 64)])
def test_each_request_of_a_merged_activation_rounds_as_its_solo_call(activation, rows, block):
    layer = _activations()[activation]()
    model = torch.nn.Sequential(layer)
    x = torch.randn(sum(rows), *block, generator=torch.Generator().manual_seed(len(rows)))
    with torch.no_grad():
        solo = torch.cat([model(part.clone()) for part in x.split(rows)])
        with solo_kernels(model, rows):
            merged = model(x.clone())
    assert "forward" not in vars(layer)  # the swap is undone
    assert torch.equal(merged, solo)


@pytest.mark.parametrize("rows, block", [([1, 1, 1, 1], (37,)), ([2, 2, 2], (3, 13)), ([3, 3], (5,))])
def test_equal_requests_share_one_activation_call_each_as_its_own_row(monkeypatch, rows, block):
    from diffusers_stepbatch.models import row_kernels

    layer, calls = torch.nn.SiLU(), []
    model = torch.nn.Sequential(layer)
    x = torch.randn(sum(rows), *block, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        solo = torch.cat([model(part.clone()) for part in x.split(rows)])
        with solo_kernels(model, rows):
            model(x)  # the one-time probes
        forward = torch.nn.SiLU.forward
        monkeypatch.setattr(torch.nn.SiLU, "forward", lambda self, input: calls.append(1) or forward(self, input))
        with solo_kernels(model, rows):
            merged = model(x.clone())
    assert row_kernels._rows_match_blocks(layer, len(rows), rows[0] * x[0].numel(), x.dtype)
    assert len(calls) == 1 and torch.equal(merged, solo)


@pytest.mark.parametrize("rows, tokens", [([1, 1, 1, 1], None), ([2, 2, 2], None), ([1] * 8, 3)])
def test_equal_small_requests_share_one_batched_linear_call_without_a_gather(monkeypatch, rows, tokens):
    from diffusers_stepbatch.models import row_kernels

    model = _Embedder(24, 96)
    shape = (sum(rows), 24) if tokens is None else (sum(rows), tokens, 24)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        solo = [model(part) for part in x.split(rows)]
        monkeypatch.setattr(row_kernels, "_gathered", lambda *_: pytest.fail("equal requests were gathered"))
        with solo_kernels(model, rows):
            merged = model(x)
    assert invariant_rows(model.first) > rows[0] * (tokens or 1)  # the rows do need their solo kernel
    assert torch.equal(merged, torch.cat(solo))


def test_merged_activations_on_odd_widths_round_apart_without_the_solo_path():
    from transformers.activations import ACT2FN

    rows, layer = [2, 1, 2, 2], ACT2FN["quick_gelu"]
    x = torch.randn(sum(rows), 3, 13, generator=torch.Generator().manual_seed(0))
    solo = torch.cat([layer(part) for part in x.split(rows)])
    assert not torch.equal(layer(x), solo)  # what the solo path is for
    with solo_kernels(torch.nn.Sequential(layer), rows):
        assert torch.equal(layer(x), solo)


def _tiny_kandinsky22_prior(hidden: int, intermediate: int, image: int):
    from diffusers import KandinskyV22PriorPipeline, PriorTransformer, UnCLIPScheduler
    from transformers import (CLIPImageProcessor, CLIPTextConfig, CLIPTextModelWithProjection, CLIPVisionConfig,
                              CLIPVisionModelWithProjection)

    from diffusers_stepbatch.testing import tiny_clip_tokenizer

    tokenizer = tiny_clip_tokenizer()
    torch.manual_seed(0)  # NOTE: CLIP's default activation is quick_gelu; an odd intermediate width gives tails
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, pad_token_id=1, hidden_size=hidden, projection_dim=hidden,
        intermediate_size=intermediate, num_attention_heads=4, num_hidden_layers=3, vocab_size=tokenizer.vocab_size))
    torch.manual_seed(0)
    prior = PriorTransformer(num_attention_heads=2, attention_head_dim=12, embedding_dim=hidden, num_layers=1)
    prior.clip_std = torch.nn.Parameter(torch.ones(prior.clip_std.shape))
    torch.manual_seed(0)
    image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=hidden, image_size=image, projection_dim=hidden, intermediate_size=intermediate,
        num_attention_heads=4, num_channels=3, num_hidden_layers=3, patch_size=8))
    processor = CLIPImageProcessor(crop_size=image, size=image, do_center_crop=True, do_normalize=True,
                                   do_resize=True, resample=3)
    scheduler = UnCLIPScheduler(variance_type="fixed_small_log", prediction_type="sample", num_train_timesteps=1000,
                                clip_sample=True, clip_sample_range=10.0)
    pipe = KandinskyV22PriorPipeline(prior=prior.eval(), image_encoder=image_encoder.eval(),
                                     text_encoder=text_encoder.eval(), tokenizer=tokenizer, scheduler=scheduler,
                                     image_processor=processor)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("hidden, intermediate, image", [(24, 53, 48), (32, 37, 32), (40, 61, 40)])
def test_kandinsky22_prior_requests_sharing_encoders_equal_their_plain_runs_bit_for_bit(hidden, intermediate, image):
    pipe = _tiny_kandinsky22_prior(hidden, intermediate, image)
    requests = [dict(prompt=f"a horse {seed}", num_inference_steps=steps, guidance_scale=guidance, output_type="pt",
                     generator=torch.Generator().manual_seed(seed))
                for seed, steps, guidance in [(0, 2, 4.0), (1, 2, 4.0), (2, 3, 4.0), (3, 2, 5.0)]]

    def fresh(kwargs):
        return dict(kwargs, generator=torch.Generator().manual_seed(kwargs["generator"].initial_seed()))

    expected = [pipe(**fresh(kwargs)) for kwargs in requests]
    with StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=8, cost_aware=False)) as sb:
        results = [future.result(300) for future in [sb.submit(**fresh(kwargs)) for kwargs in requests]]
        histogram = sb.stats()["rows_histogram"]
    assert max(histogram["encode"]) > 2 and max(histogram["denoise"]) > 2  # requests shared encoder calls
    for got, want in zip(results, expected):
        assert torch.equal(got.image_embeds, want.image_embeds)
        assert torch.equal(got.negative_image_embeds, want.negative_image_embeds)


@pytest.mark.parametrize("dims, channels, size", [(2, 4, 16), (2, 96, 8), (3, 4, 8), (3, 12, 6)])
@pytest.mark.parametrize("padding_mode, stride", [("zeros", 1), ("reflect", 1), ("replicate", 2), ("zeros", 2)])
@pytest.mark.parametrize("rows", [[1, 1, 1, 1], [2, 1, 2], [1, 3], [2, 2]])
@pytest.mark.parametrize("own_kernel_faster", [True, False])  # the timed choice between two exact paths
def test_each_request_of_a_merged_convolution_equals_its_solo_call_bit_for_bit(monkeypatch, dims, channels, size,
                                                                              padding_mode, stride, rows,
                                                                              own_kernel_faster):
    from diffusers_stepbatch.models import row_kernels

    monkeypatch.setattr(row_kernels, "_conv_paths", {})
    monkeypatch.setattr(row_kernels, "_own_kernel_is_faster", lambda *_: own_kernel_faster)
    conv = torch.nn.Conv3d if dims == 3 else torch.nn.Conv2d
    torch.manual_seed(0)
    model = torch.nn.Sequential(conv(channels, channels, 3, padding=1, padding_mode=padding_mode),
                                torch.nn.SiLU(), conv(channels, 8, 1, stride=stride))
    x = torch.randn(sum(rows), channels, *(size,) * dims)
    with torch.no_grad():
        solo = torch.cat([model(part) for part in x.split(rows)])
        with solo_kernels(model, rows):
            merged = model(x)
    assert not [name for name, module in model.named_modules() if {"forward", "_conv_forward"} & vars(module).keys()]
    assert torch.equal(merged, solo)


def test_a_merged_convolution_of_one_row_requests_rounds_apart_without_the_solo_path():
    torch.manual_seed(0)
    layer = torch.nn.Conv3d(4, 4, 3, padding=1)
    x = torch.randn(4, 4, 3, 8, 8)
    with torch.no_grad():
        solo = torch.cat([layer(part) for part in x.split(1)])
        assert not torch.equal(layer(x), solo)  # torch runs one small row on another kernel than several
        with solo_kernels(torch.nn.Sequential(layer), [1, 1, 1, 1]):
            assert torch.equal(layer(x), solo)


@pytest.mark.parametrize("heads, head_dim", [(2, 12), (3, 8)])
def test_wan_requests_sharing_forwards_and_decodes_equal_their_plain_runs_bit_for_bit(heads, head_dim):
    from diffusers_stepbatch.toy.video import tiny_wan_pipeline

    pipe = tiny_wan_pipeline(heads=heads, head_dim=head_dim, layers=2)
    pipe.set_progress_bar_config(disable=True)
    shapes = [(9, 32, 32), (5, 32, 48), (13, 48, 32)]  # (frames, height, width)
    requests = [dict(prompt=f"a ball {i}", negative_prompt="blurry", num_frames=shapes[i % 3][0],
                     height=shapes[i % 3][1], width=shapes[i % 3][2], num_inference_steps=3 if i == 5 else 2,
                     guidance_scale=5.0, output_type="pt", max_sequence_length=16,
                     generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def fresh(kwargs):
        return dict(kwargs, generator=torch.Generator().manual_seed(kwargs["generator"].initial_seed()))

    expected = [pipe(**fresh(kwargs)).frames for kwargs in requests]
    with StepBatched(pipe, max_batch_size=12, mixed_resolution=False,
                     scheduler=SchedulerConfig(cost_aware=False)) as sb:
        results = [future.result(300).frames for future in [sb.submit(**fresh(kwargs)) for kwargs in requests]]
        histogram = sb.stats()["rows_histogram"]
    assert max(histogram["denoise"]) > 2 and max(histogram["decode"]) > 1  # shared forwards and decodes
    for got, want in zip(results, expected):
        assert torch.equal(got, want)
