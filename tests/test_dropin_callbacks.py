"""Step callbacks that change guidance, as diffusers allows: `_guidance_scale` changes take effect at the next
step, and diffusers' own CFG-cutoff callbacks drop a request's unconditional rows from their step on. Each
output equals the plain pipeline's with the same callback, alone and next to requests that keep their CFG."""

import pytest
import torch
from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline
from diffusers.callbacks import (
    MultiPipelineCallbacks,
    SD3CFGCutoffCallback,
    SDCFGCutoffCallback,
    SDXLCFGCutoffCallback,
    SDXLControlnetCFGCutoffCallback,
)

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.testing import tiny_sdxl_pipeline

from .dropin_helpers import FAMILIES, call_kwargs, pipe_for, run
from .references import TOLERANCE, max_diff, seeded, single_thread, submit_all  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")
CUTOFFS = {"sd-euler": SDCFGCutoffCallback, "sd-dpm": SDCFGCutoffCallback, "sdxl-euler": SDXLCFGCutoffCallback,
           "sdxl-dpm": SDXLCFGCutoffCallback, "sd3-tiny": SD3CFGCutoffCallback}


def raise_guidance(view, i, t, callback_kwargs):
    view._guidance_scale += 1.0  # what diffusers' test_callback_cfg does
    return callback_kwargs


def images(output):
    return output[0] if isinstance(output, tuple) else output.images


# NOTE: PixArtSigmaPipeline has no callback_on_step_end (the generic program's callbacks: the ControlNet test below)
@pytest.mark.parametrize("name", [name for name in FAMILIES if not name.startswith("pixart")])
def test_guidance_changed_by_a_callback_matches_the_plain_pipeline(name):
    pipe = pipe_for(name)
    changed = call_kwargs(name, guidance_scale=2.0, num_inference_steps=4, callback_on_step_end=raise_guidance)
    steady = call_kwargs(name, guidance_scale=2.0, num_inference_steps=3, seed=1)
    expected = [run(pipe, changed), run(pipe, steady)]
    with StepBatched(pipe) as sb:
        got = [images(output) for output in submit_all(sb, [changed, steady])]
        alone = run(sb, changed)
    assert max_diff(got[0], expected[0]) <= TOLERANCE
    assert max_diff(got[1], expected[1]) <= TOLERANCE
    assert max_diff(alone, expected[0]) <= TOLERANCE


@pytest.mark.parametrize("name", sorted(CUTOFFS))
@pytest.mark.parametrize("cutoff", [dict(cutoff_step_ratio=0.25), dict(cutoff_step_ratio=None, cutoff_step_index=1)])
def test_cfg_cutoff_callbacks_equal_the_plain_pipeline(name, cutoff):
    pipe = pipe_for(name)
    callback = CUTOFFS[name](**cutoff)
    cut = call_kwargs(name, guidance_scale=7.0, num_inference_steps=4, callback_on_step_end=callback,
                      callback_on_step_end_tensor_inputs=callback.tensor_inputs)
    guided = call_kwargs(name, guidance_scale=3.0, num_inference_steps=4, seed=1)
    expected = [run(pipe, cut), run(pipe, guided)]
    # the cutoff changes the image by more than the tolerance, so the comparisons below can tell
    assert max_diff(expected[0], run(pipe, call_kwargs(name, guidance_scale=7.0, num_inference_steps=4))) > 2 * TOLERANCE
    with StepBatched(pipe) as sb:
        got = [images(output) for output in submit_all(sb, [cut, guided, cut])]
    assert max_diff(got[0], expected[0]) <= TOLERANCE
    assert max_diff(got[2], expected[0]) <= TOLERANCE
    assert max_diff(got[1], expected[1]) <= TOLERANCE


@pytest.mark.parametrize("name", ["sd-euler", "sdxl-euler", "sd3-tiny"])
def test_multi_pipeline_callbacks(name):
    pipe = pipe_for(name)
    steps = []

    def record(view, i, t, callback_kwargs):
        steps.append((i, view.guidance_scale))
        return callback_kwargs

    from diffusers.callbacks import PipelineCallback

    class Recorder(PipelineCallback):
        tensor_inputs = []

        def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
            return record(pipeline, step_index, timestep, callback_kwargs)

    def callbacks():
        return MultiPipelineCallbacks([CUTOFFS[name](cutoff_step_ratio=None, cutoff_step_index=2), Recorder()])

    plain = run(pipe, call_kwargs(name, guidance_scale=5.0, num_inference_steps=4, callback_on_step_end=callbacks()))
    plain_steps, steps[:] = list(steps), []
    with StepBatched(pipe) as sb:
        got = run(sb, call_kwargs(name, guidance_scale=5.0, num_inference_steps=4, callback_on_step_end=callbacks()))
    assert max_diff(got, plain) <= TOLERANCE
    assert steps == plain_steps and plain_steps[-1][1] == 0.0


def test_sdxl_controlnet_cfg_cutoff_through_the_generic_program():
    base = tiny_sdxl_pipeline()
    torch.manual_seed(0)
    controlnet = ControlNetModel.from_unet(base.unet, conditioning_embedding_out_channels=(16, 32))
    names = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "unet", "scheduler")
    pipe = StableDiffusionXLControlNetPipeline(**{k: base.components[k] for k in names}, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    kwargs = dict(prompt="a cat", image=image, height=32, width=32, num_inference_steps=4, guidance_scale=5.0,
                  output_type="pt", seed=0, callback_on_step_end=SDXLControlnetCFGCutoffCallback(cutoff_step_ratio=0.5))
    expected = run(pipe, kwargs)
    with StepBatched(pipe) as sb:
        got = [images(output) for output in submit_all(sb, [kwargs, dict(kwargs, seed=1), kwargs])]
    assert max_diff(got[0], expected) <= TOLERANCE and max_diff(got[2], expected) <= TOLERANCE
    assert max_diff(got[1], run(pipe, dict(kwargs, seed=1))) <= TOLERANCE
