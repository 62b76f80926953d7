"""HunyuanVideo 1.5 requests of different frame counts and sizes share packed transformer calls, exactly.

HunyuanVideo15Pipeline and HunyuanVideo15ImageToVideoPipeline run through the generic program; their transformer
calls merge by rows at equal sizes and pack through `models/hunyuan_video15/packing.py` at other sizes. Each
request must equal its solo unwrapped run.
"""

import functools

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.models import support_for
from diffusers_stepbatch.models.calls import describe_call
from diffusers_stepbatch.models.hunyuan_video15.packing import hunyuan_video15_packing_unsupported, pack_key
from diffusers_stepbatch.programs import generic, program_for
from diffusers_stepbatch.testing.hunyuan_video_models import (
    HunyuanVideo15Size,
    tiny_hunyuan_video15_pipeline,
    tiny_hunyuan_video15_transformer,
)

from .references import (  # noqa: F401
    TOLERANCE,
    max_diff,
    seeded,
    single_thread,
    submit_all,
)

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = {
    # name: (transformer, guider's guidance scale)
    "hv15-tiny": (HunyuanVideo15Size(), 1.0),
    "hv15-patch2-cfg": (HunyuanVideo15Size(heads=4, head_dim=8, layers=2, patch_size=2), 3.0),
}

# (height, width, num_frames): three frame counts, square and non-square
SIZES = [(16, 16, 5), (16, 32, 9), (32, 16, 5), (16, 16, 9), (32, 32, 1)]


@functools.cache
def hv15_pipe(config: str):
    size, guidance = CONFIGS[config]
    return tiny_hunyuan_video15_pipeline(size, guidance_scale=guidance)


def _requests(sizes):
    prompts = ["a cat", 'a sign that reads "open"', "a red ball on grass", 'a cat "hi"', "a dog"]
    return [dict(prompt=prompts[i % len(prompts)], negative_prompt="blurry", height=height, width=width,
                 num_frames=frames, num_inference_steps=2 + i % 2, output_type="pt", seed=i)
            for i, (height, width, frames) in enumerate(sizes)]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_requests_of_different_frame_counts_and_sizes_pack_and_equal_their_solo_runs(config):
    pipe = hv15_pipe(config)
    assert program_for(pipe) is generic.plan_generic
    requests = _requests(SIZES)
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    with StepBatched(pipe, max_batch_size=8) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    differences = [max_diff(got.frames, want) for got, want in zip(results, expected)]
    assert max(differences) <= TOLERANCE, differences
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]


def test_requests_of_equal_size_merge_by_rows_and_equal_their_solo_runs():
    pipe = hv15_pipe("hv15-patch2-cfg")
    requests = [dict(kwargs, height=16, width=32, num_frames=5) for kwargs in _requests(SIZES[:4])]
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    with StepBatched(pipe, max_batch_size=8) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    assert max(max_diff(got.frames, want) for got, want in zip(results, expected)) <= TOLERANCE
    assert max(stats["rows_histogram"]["denoise"]) > 2, stats["rows_histogram"]
    assert stats["mixed"]["calls"] == 0


def test_an_other_attention_processor_keeps_sizes_apart_and_exact():
    class OwnProcessor(HunyuanVideo15AttnProcessor2_0):  # a custom processor: a packed call would bypass it
        pass

    pipe = hv15_pipe("hv15-tiny")
    requests = _requests(SIZES[:3])
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    for block in pipe.transformer.transformer_blocks:
        block.attn.set_processor(OwnProcessor())
    try:
        assert "OwnProcessor" in hunyuan_video15_packing_unsupported(pipe.transformer)
        with StepBatched(pipe, max_batch_size=8) as sb:
            results = submit_all(sb, requests)
            stats = sb.stats()
    finally:
        for block in pipe.transformer.transformer_blocks:
            block.attn.set_processor(HunyuanVideo15AttnProcessor2_0())
    assert max(max_diff(got.frames, want) for got, want in zip(results, expected)) <= TOLERANCE
    assert stats["mixed"]["calls"] == 0


# ---------------------------------------------------------------------------------------------------------------
# The packed forward against the model's own forward, call by call.

def hv15_call(rows, grid, valid, valid_2, seed, image=False):
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = grid
    mask, mask_2 = torch.zeros(rows, 12, dtype=torch.long), torch.zeros(rows, 8, dtype=torch.long)
    for r in range(rows):
        mask[r, :valid[r]] = 1
        mask_2[r, :valid_2[r]] = 1
    image_embeds = torch.randn(rows, 4, 12, generator=generator) if image else torch.zeros(rows, 4, 12)
    return dict(hidden_states=torch.randn(rows, 9, frames, height, width, generator=generator),
                timestep=torch.rand(rows, generator=generator) * 1000,
                encoder_hidden_states=torch.randn(rows, 12, 16, generator=generator), encoder_attention_mask=mask,
                encoder_hidden_states_2=torch.randn(rows, 8, 32, generator=generator), encoder_attention_mask_2=mask_2,
                image_embeds=image_embeds, return_dict=False)


def test_text_to_video_and_image_conditioned_calls_never_merge_by_rows():
    # NOTE: the model reads text-to-video from all image embeds of a call at once
    model = tiny_hunyuan_video15_transformer()
    text_only = describe_call(model, (), hv15_call(2, (1, 2, 2), [3, 3], [1, 1], 0))
    with_image = describe_call(model, (), hv15_call(2, (1, 2, 2), [3, 3], [1, 1], 1, image=True))
    other_image = describe_call(model, (), hv15_call(2, (1, 2, 2), [3, 3], [1, 1], 2, image=True))
    assert text_only.signature != with_image.signature and with_image.signature == other_image.signature
    assert support_for(model).refusal is None
    assert pack_key(dict(hv15_call(1, (1, 2, 2), [3], [1], 0), attention_kwargs={"other": 1})) is None


def test_image_to_video_requests_of_different_sizes_pack_and_equal_their_solo_runs():
    pipe = tiny_hunyuan_video15_pipeline(CONFIGS["hv15-tiny"][0], guidance_scale=3.0, image_to_video=True)
    requests = []
    for i, kwargs in enumerate(_requests(SIZES)):
        height, width = kwargs.pop("height"), kwargs.pop("width")  # NOTE: the pipeline sizes the video by its image
        pixels = np.random.default_rng(i).integers(0, 255, (height, width, 3), dtype=np.uint8)
        requests.append(dict(kwargs, image=PIL.Image.fromarray(pixels)))
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    with StepBatched(pipe, max_batch_size=8) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    assert len({tuple(frames.shape) for frames in expected}) >= 3
    assert max(max_diff(got.frames, want) for got, want in zip(results, expected)) <= TOLERANCE
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]
