"""optimum-quanto: a quantized transformer still batches, and batched equals solo quantized output."""

import pytest
import torch

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.engine.scheduler import SchedulerConfig
from diffusers_stepbatch.quantize import quantize_transformer
from diffusers_stepbatch.testing import tiny_flux_pipeline

from .references import TOLERANCE, count_forwards, max_diff, seeded


def calls():
    base = dict(height=32, width=32, output_type="pt", max_sequence_length=16)
    return [
        dict(base, prompt="a red circle", seed=1, num_inference_steps=3),
        dict(base, prompt="a blue square", seed=2, num_inference_steps=5, guidance_scale=6.0,
             negative_prompt="noise", true_cfg_scale=2.0),
        dict(base, prompt="a cat", seed=3, num_inference_steps=4, num_images_per_prompt=2),
    ]


@pytest.mark.parametrize("weights", ["qint8", "qfloat8", "qint4"])
def test_quantized_batched_equals_solo_quantized(weights):
    from optimum.quanto import QLinear

    pipe = tiny_flux_pipeline(guidance_embeds=True, seed=11)  # a private pipeline: quantization is in place
    sb = StepBatched(pipe, quantize=weights, scheduler=SchedulerConfig(max_batch_size=16, cost_aware=False))
    assert isinstance(pipe.transformer.transformer_blocks[0].attn.to_q, QLinear)
    with torch.no_grad():
        solo = [pipe(**seeded(kwargs)).images for kwargs in calls()]
    # NOTE: every call is planned before the engine runs a step and the engine is driven here, so the
    # requests share their forwards deterministically.
    requests = [sb._make_request((), seeded(kwargs), 0, None) for kwargs in calls()]
    for request in requests:
        sb.engine.scheduler.add(request)
    sizes, hook = count_forwards(pipe.transformer)
    try:
        with torch.no_grad():
            while sb.engine.scheduler.has_work():
                sb.engine.step()
    finally:
        hook.remove()
    assert max(sizes) == 5  # 1 row + 2 CFG rows + 2 images share the first forwards
    for request, expected in zip(requests, solo):
        assert max_diff(request.handle.result().images, expected) <= TOLERANCE


def test_recipe_without_the_option_and_bad_values():
    pipe = tiny_flux_pipeline(seed=12)
    assert quantize_transformer(pipe, weights="qint8") is pipe
    with pytest.raises(ValueError, match="quantize='int3'"):
        StepBatched(tiny_flux_pipeline(seed=13), quantize="int3")
    with pytest.raises(ValueError, match="has no transformer"):
        quantize_transformer(object(), weights="qint8")
