"""The generic program packs FLUX.1 calls of different sizes through the model layer, exactly.

FluxImg2ImgPipeline, FluxInpaintPipeline and FluxKontextPipeline have no dedicated program; their transformer
calls are intercepted and, where the sizes differ, packed into one call (`models/flux/packing.py`). Text encoder
and VAE calls of several requests share calls too.
"""

import pytest
import torch
from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, FluxKontextPipeline

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.programs import generic, program_for

from .references import TOLERANCE, flux_pipe, max_diff, seeded, single_thread, submit_all  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

SIZES = [(32, 32), (32, 64), (64, 32), (48, 48)]


def _image(height, width, seed):
    return torch.rand(1, 3, height, width, generator=torch.Generator().manual_seed(seed))


def _requests(pipeline_class, sizes):
    requests = []
    for i, (height, width) in enumerate(sizes):
        kwargs = dict(prompt=f"a shape {i}", image=_image(height, width, i), height=height, width=width,
                      num_inference_steps=3 + i % 3, guidance_scale=2.0 + i, output_type="pt",
                      max_sequence_length=16, seed=i)
        if pipeline_class is FluxInpaintPipeline:
            mask = torch.zeros(1, 1, height, width)
            mask[..., height // 4: height // 2, :] = 1.0
            kwargs.update(mask_image=mask, strength=0.9)
        elif pipeline_class is FluxImg2ImgPipeline:
            kwargs.update(strength=0.7 + 0.1 * (i % 3))
        else:
            kwargs.update(_auto_resize=False, max_area=height * width)
        requests.append(kwargs)
    return requests


@pytest.mark.parametrize("config", ["dev-tiny", "dev-wide"])
@pytest.mark.parametrize("pipeline_class", [FluxImg2ImgPipeline, FluxInpaintPipeline, FluxKontextPipeline])
def test_requests_of_different_sizes_pack_and_equal_their_solo_runs(pipeline_class, config):
    pipe = pipeline_class(**flux_pipe(config).components)
    pipe.set_progress_bar_config(disable=True)
    assert program_for(pipe) is generic.plan_generic
    requests = _requests(pipeline_class, SIZES)
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    with StepBatched(pipe, max_batch_size=8) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    differences = [max_diff(got.images, want) for got, want in zip(results, expected)]
    assert max(differences) <= TOLERANCE, differences
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]
    assert max(stats["rows_histogram"]["encode"]) > 1, "the text encoders never ran several requests' prompts"


def test_an_other_attention_processor_keeps_sizes_apart_and_exact():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    class OwnProcessor(FluxAttnProcessor):  # a custom processor: a packed call would bypass it
        pass

    pipe = FluxKontextPipeline(**flux_pipe("dev-tiny").components)
    pipe.set_progress_bar_config(disable=True)
    requests = _requests(FluxKontextPipeline, SIZES[:3])
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    pipe.transformer.set_attn_processor(OwnProcessor())
    try:
        with StepBatched(pipe, max_batch_size=8) as sb:
            results = submit_all(sb, [dict(kwargs, joint_attention_kwargs={"scale": 1.0}) for kwargs in requests])
            stats = sb.stats()
    finally:
        pipe.transformer.set_attn_processor(FluxAttnProcessor())
    assert max(max_diff(got.images, want) for got, want in zip(results, expected)) <= TOLERANCE
    assert stats["mixed"]["calls"] == 0


def test_teacache_in_shared_packed_forwards_equals_teacache_alone():
    from diffusers_stepbatch.cache import TeaCacheConfig

    pipe = FluxKontextPipeline(**flux_pipe("dev-tiny").components)
    pipe.set_progress_bar_config(disable=True)
    requests = [dict(kwargs, num_inference_steps=12 + i)
                for i, kwargs in enumerate(_requests(FluxKontextPipeline, SIZES))]
    requests[1]["teacache"] = None  # this one computes every step, beside the others
    exact = [pipe(**seeded({k: v for k, v in kwargs.items() if k != "teacache"})).images for kwargs in requests]
    teacache = TeaCacheConfig(threshold=0.5)
    with StepBatched(pipe, teacache=teacache) as sb:
        solo = [sb(**seeded(kwargs)).images for kwargs in requests]
    with StepBatched(pipe, teacache=teacache, max_batch_size=8) as sb:
        batched = submit_all(sb, requests)
        stats = sb.stats()
    assert max(max_diff(got.images, want) for got, want in zip(batched, solo)) <= TOLERANCE
    assert stats["mixed"]["calls"] > 0
    assert max_diff(solo[1], exact[1]) <= TOLERANCE  # teacache=None: every step computed
    assert min(max_diff(solo[i], exact[i]) for i in (0, 2, 3)) > 10 * TOLERANCE, "TeaCache skipped no step"


@pytest.mark.parametrize("config", ["qwen-tiny", "qwen-wide"])
def test_qwenimage_img2img_requests_of_different_grids_and_prompt_lengths_pack(config):
    from diffusers import QwenImageImg2ImgPipeline

    from .references import family_pipe

    base = family_pipe(config)
    pipe = QwenImageImg2ImgPipeline(**base.components)
    pipe.set_progress_bar_config(disable=True)
    pipe.prompt_template_encode = base.prompt_template_encode  # the tiny tokenizer's short template
    pipe.prompt_template_encode_start_idx = base.prompt_template_encode_start_idx
    requests = [dict(prompt="a red circle " * (i + 1), image=_image(height, width, i), height=height, width=width,
                     strength=0.8, num_inference_steps=3 + i, true_cfg_scale=1.0 if i == 0 else 2.0 + i,
                     negative_prompt="blurry", output_type="pt", seed=i)
                for i, (height, width) in enumerate([(32, 32), (32, 48), (48, 32), (48, 48)])]
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    with StepBatched(pipe, max_batch_size=8) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    assert max(max_diff(got.images, want) for got, want in zip(results, expected)) <= TOLERANCE
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]


def test_teacache_with_model_offload_is_refused_in_the_caller():
    from diffusers_stepbatch.cache import TeaCacheConfig

    pipe = FluxKontextPipeline(**flux_pipe("dev-tiny").components)
    pipe.transformer._hf_hook = object()  # NOTE: what enable_model_cpu_offload leaves on the model
    try:
        with StepBatched(pipe) as sb, pytest.raises(ValueError, match="bypasses its model offload hook"):
            sb.submit(**seeded(dict(_requests(FluxKontextPipeline, SIZES[:1])[0], num_inference_steps=12,
                                    teacache=TeaCacheConfig(threshold=0.4))))
    finally:
        del pipe.transformer._hf_hook
