"""Text encoders of video pipelines batch across requests: Gemma 3 (LTX-2) and Qwen2.5-VL (HunyuanVideo 1.5) return
their key-value cache beside the hidden states, which is split by rows like the rest of the output."""

import pytest
import torch
from transformers import DynamicCache

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.models.calls import NotRowWise, cut, max_difference
from diffusers_stepbatch.testing.hunyuan_video_models import tiny_hunyuan_video15_pipeline
from diffusers_stepbatch.testing.ltx_models import LTX2_PLAIN, tiny_ltx2_pipeline

from .references import TOLERANCE, max_diff, seeded, submit_all, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


def _encoder_rows(pipe, requests):
    rows = []
    handle = pipe.text_encoder.register_forward_hook(lambda _m, args, kwargs, out: rows.append(
        (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[0]), with_kwargs=True)
    try:
        with StepBatched(pipe, max_batch_size=8) as sb:
            results = submit_all(sb, requests)
            splits = sb.stats()["splits"]
    finally:
        handle.remove()
    return results, rows, splits


@pytest.mark.parametrize("lengths", [(16, 16, 16), (16, 24, 16)])
def test_ltx2_gemma_encodes_of_several_requests_share_a_call(lengths):
    pipe = tiny_ltx2_pipeline()
    requests = [dict(LTX2_PLAIN, prompt=f"a robot {i}", height=32, width=32, num_frames=9, frame_rate=25.0,
                     num_inference_steps=2, guidance_scale=1.0, max_sequence_length=length, output_type="pt",
                     seed=i) for i, length in enumerate(lengths)]
    expected = [pipe(**seeded(kwargs)) for kwargs in requests]
    results, rows, splits = _encoder_rows(pipe, requests)
    for got, want in zip(results, expected):
        assert max(max_diff(got.frames, want.frames), max_diff(got.audio, want.audio)) <= TOLERANCE
    assert max(rows) >= 2, (rows, splits)
    assert not any("can't be split by rows" in reason for reason in splits), splits


@pytest.mark.parametrize("prompts", [("a cat", "a dog", "a cow"), ("a cat", 'a sign "open"', "a red ball")])
def test_hunyuan_video15_qwen_encodes_of_several_requests_share_a_call(prompts):
    pipe = tiny_hunyuan_video15_pipeline()
    requests = [dict(prompt=prompt, negative_prompt="blurry", height=16, width=16, num_frames=5,
                     num_inference_steps=2, output_type="pt", seed=i) for i, prompt in enumerate(prompts)]
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    results, rows, splits = _encoder_rows(pipe, requests)
    assert max(max_diff(got.frames, want) for got, want in zip(results, expected)) <= TOLERANCE
    assert max(rows) >= 2, (rows, splits)
    assert not any("can't be split by rows" in reason for reason in splits), splits


def test_a_cache_is_cut_per_row_and_compared_by_its_keys_and_values():
    cache = DynamicCache()
    keys, values = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    cache.update(keys, values, layer_idx=0)
    part = cut(cache, 1, 3, 3)
    assert torch.equal(part.layers[0].keys, keys[1:3]) and torch.equal(part.layers[0].values, values[1:3])
    assert torch.equal(cache.layers[0].keys, keys)  # the merged cache is left as it was
    assert max_difference(part, cut(cache, 1, 3, 3)) == 0.0
    other = DynamicCache()
    other.update(keys[1:3] + 1, values[1:3], layer_idx=0)
    assert max_difference(part, other) > 0.1
    with pytest.raises(NotRowWise):
        cut(cache, 0, 1, 4)
