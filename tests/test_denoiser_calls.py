"""Every program's denoiser calls go through the one runner (`models/denoiser_calls.py`): each call of the model's
own forward through `model_forward`, each packed call of several sizes through `packed_forward`."""

import functools

import pytest
import torch
from diffusers import FluxKontextPipeline

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.engine.scheduler import SchedulerConfig
from diffusers_stepbatch.models import denoiser_calls
from diffusers_stepbatch.testing import tiny_flux_pipeline, tiny_qwenimage_pipeline, tiny_sd3_pipeline
from diffusers_stepbatch.testing import tiny_sdxl_pipeline

from .references import in_lockstep, max_diff, seeded, single_thread  # noqa: F401  (single_thread is a fixture)

pytestmark = pytest.mark.usefixtures("single_thread")
PACK_ALWAYS = SchedulerConfig(max_batch_size=16, cost_aware=False)


def kontext_pipeline():
    return FluxKontextPipeline(**tiny_flux_pipeline(guidance_embeds=True).components)


def requests(sizes, **extra):
    return [dict(prompt=f"a shape {i}", height=h, width=w, num_inference_steps=2 + i % 2, seed=i, output_type="pt",
                 **extra) for i, (h, w) in enumerate(sizes)]


def kontext_requests():
    calls = requests([(32, 32), (32, 48)], max_sequence_length=16, guidance_scale=3.5)
    for i, kwargs in enumerate(calls):
        kwargs.update(image=torch.rand(1, 3, kwargs["height"], kwargs["width"],
                                       generator=torch.Generator().manual_seed(i)),
                      _auto_resize=False, max_area=kwargs["height"] * kwargs["width"])
    return calls


# program -> (tiny pipeline, requests, whether their sizes share packed calls)
CASES = {
    "flux": (tiny_flux_pipeline, lambda: requests([(32, 32), (32, 48), (32, 32)], max_sequence_length=16,
                                                  negative_prompt="blurry", true_cfg_scale=2.0), True),
    "sd3": (tiny_sd3_pipeline, lambda: requests([(32, 32), (32, 48)], skip_guidance_layers=[0],
                                                 skip_layer_guidance_stop=0.9), True),
    "qwenimage": (tiny_qwenimage_pipeline, lambda: requests([(32, 32), (32, 64)]), True),
    "sdxl": (tiny_sdxl_pipeline, lambda: requests([(32, 32), (32, 32)]), False),
    "generic": (kontext_pipeline, kontext_requests, True),
}


class Counted:
    """Calls of the runner's two model entry points (models/denoiser_calls.py) and of the model's own forward."""

    def __init__(self, model, monkeypatch):
        self.model, self.through, self.packed, self.forwards = model, [], [], []
        monkeypatch.setattr(denoiser_calls, "model_forward", self._counted(denoiser_calls.model_forward, self.through))
        monkeypatch.setattr(denoiser_calls, "packed_forward",
                            self._counted(denoiser_calls.packed_forward, self.packed))
        self.handle = model.register_forward_pre_hook(lambda *_: self.forwards.append(1))

    @staticmethod
    def _counted(function, seen):
        @functools.wraps(function)
        def counted(*args, **kwargs):
            seen.append(args[:2])
            return function(*args, **kwargs)

        return counted


@pytest.mark.parametrize("program", list(CASES))
def test_every_denoiser_call_goes_through_the_runner(program, monkeypatch):
    builder, make_requests, packs = CASES[program]
    pipe = builder()
    pipe.set_progress_bar_config(disable=True)
    model = pipe.transformer if hasattr(pipe, "transformer") else pipe.unet
    calls = make_requests()
    expected = [pipe(**seeded(kwargs)).images for kwargs in calls]
    counted = Counted(model, monkeypatch)
    try:
        with StepBatched(pipe, scheduler=PACK_ALWAYS) as sb:
            got = in_lockstep(sb, calls)
    finally:
        counted.handle.remove()
    for image, want in zip(got, expected):
        assert max_diff(image, want) <= 1e-4
    # each forward of the model came through model_forward, and nothing else went through it for this model
    assert counted.forwards and len(counted.forwards) == sum(1 for target, *_ in counted.through
                                                             if target is model)
    assert all(model_ is model for _, model_ in counted.packed)
    assert bool(counted.packed) == packs, counted.packed
