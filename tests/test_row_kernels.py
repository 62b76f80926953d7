"""Merged calls give each request's rows the GEMM kernel of its solo call (`models/row_kernels.py`).

A Kandinsky 2.2 UNet (image-embedding conditioning) amplifies the rounding between a GEMM of 2 rows and one of 8
past 1e-4 over a few DDIM steps: merged requests differed from their solo runs until each request's per-row
embeddings ran at their solo row count."""

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
