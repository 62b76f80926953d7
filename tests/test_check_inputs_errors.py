"""A pipeline's own `check_inputs` errors name their argument: `InvalidArgument.argument` where one argument
explains the error (found by what the check does), the server's message match only where none does."""

from __future__ import annotations

import threading

import pytest
import torch
from PIL import Image

from diffusers_stepbatch import StepBatched, testing
from diffusers_stepbatch.errors import InvalidArgument
from diffusers_stepbatch.serve import ServeConfig
from diffusers_stepbatch.serve.errors import engine_error

IMAGE = Image.new("RGB", (64, 64), (200, 30, 30))


def plain_error(pipe, **kwargs) -> str:
    """The message of the unwrapped pipeline's own error for the same call."""
    with pytest.raises(ValueError) as caught:
        pipe(**kwargs)
    return str(caught.value)


def submit_error(sb, **kwargs) -> ValueError:
    finished = sum(sb.stats()["requests_finished"].values())
    with pytest.raises(ValueError) as caught:
        sb.submit(**kwargs)  # NOTE: raised by submit, in the caller: nothing is queued
    assert sum(sb.stats()["requests_finished"].values()) == finished
    return caught.value


@pytest.fixture(scope="module")
def sd_img2img():
    from diffusers import AutoPipelineForImage2Image

    pipe = AutoPipelineForImage2Image.from_pipe(testing.tiny_sd_pipeline())
    with StepBatched(pipe) as sb:
        yield pipe, sb


@pytest.mark.parametrize(("extra", "argument"), [
    ({"strength": 1.5}, "strength"),  # "The value of strength should in [0.0, 1.0] but is 1.5"
    ({"negative_prompt": "blurry", "negative_prompt_embeds": torch.zeros(1, 77, 32)}, "negative_prompt"),
])
def test_a_check_inputs_error_one_argument_explains_names_it(sd_img2img, extra, argument):
    pipe, sb = sd_img2img
    call = {"prompt": "a cat", "image": IMAGE, "num_inference_steps": 2, "strength": 0.5, **extra}
    error = submit_error(sb, **call)
    assert isinstance(error, InvalidArgument) and error.argument == argument
    assert str(error) == plain_error(pipe, **call)  # the pipeline's own words
    answer = engine_error(error, ServeConfig(), call)
    assert answer.status == 400 and answer.param == argument and answer.code == "invalid_value"


def test_a_family_program_names_the_argument_too():
    pipe = testing.tiny_flux_pipeline()
    call = {"prompt": "a cat", "height": 32, "width": 32, "num_inference_steps": 2, "max_sequence_length": 600}
    with StepBatched(pipe) as sb:
        error = submit_error(sb, **call)
    assert isinstance(error, InvalidArgument) and error.argument == "max_sequence_length"
    assert str(error) == plain_error(pipe, **call)


def test_an_error_no_single_argument_explains_keeps_its_type_and_the_server_reads_the_message():
    """A size the model can't take: neither height nor width alone has a default that passes (the pipeline
    derives it), so the error stays the pipeline's `ValueError`; the server finds `height` in its words."""
    pipe = testing.tiny_sd_pipeline()
    call = {"prompt": "a cat", "num_inference_steps": 2, "height": 36, "width": 64}
    with StepBatched(pipe) as sb:
        error = submit_error(sb, **call)
    assert type(error) is ValueError and str(error) == plain_error(pipe, **call)
    assert engine_error(error, ServeConfig(), call).param == "size"
    assert engine_error(error, ServeConfig(), {"prompt": "a cat"}).param is None  # named, but not sent


def test_over_http_a_size_the_model_cannot_take_is_a_400_naming_size():
    openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")

    from .serve_helpers import Served

    with Served(testing.tiny_sd_pipeline(), "tiny-sd") as served:
        before = served.finished()
        with pytest.raises(openai.BadRequestError) as caught:
            served.client.images.generate(model=served.name, prompt="a cat", size="36x36",
                                          extra_body={"num_inference_steps": 2})
        assert served.finished() == before
        ok = served.client.images.generate(model=served.name, prompt="a cat", size="32x32",
                                           extra_body={"num_inference_steps": 2})
    error = caught.value.body
    assert error["param"] == "size" and error["code"] == "invalid_value", error
    assert "divisible by 8" in error["message"] and "36" in error["message"]
    assert ok.size == "32x32"


def _multi_controlnet_pipeline(xl: bool):
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionXLControlNetPipeline
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    base = testing.tiny_sdxl_pipeline() if xl else testing.tiny_sd_pipeline()
    nets = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        nets.append(ControlNetModel.from_unet(base.unet, conditioning_embedding_out_channels=(16, 32)).eval())
    components = {name: value for name, value in base.components.items()
                  if name not in ("safety_checker", "feature_extractor", "image_encoder")}
    cls = StableDiffusionXLControlNetPipeline if xl else StableDiffusionControlNetPipeline
    extra = {} if xl else dict(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe = cls(**components, controlnet=MultiControlNetModel(nets), **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("xl", [False, True])
def test_multi_controlnet_calls_with_scalar_guidance_windows_run_wrapped_as_plain(xl):
    # NOTE: __call__ repeats a scalar control_guidance_start / _end once per ControlNet before its check_inputs
    pipe = _multi_controlnet_pipeline(xl)
    conditions = [torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def call(seed, **extra):
        return dict(prompt="a cat", image=conditions, height=32, width=32, num_inference_steps=2, guidance_scale=5.0,
                    output_type="pt", generator=torch.Generator().manual_seed(seed), **extra)

    def requests():
        return [call(0), call(1, control_guidance_end=0.5), call(2, control_guidance_start=[0.0, 0.5])]

    expected = [pipe(**request).images for request in requests()]
    with StepBatched(pipe) as sb:
        got = [future.result(300).images for future in [sb.submit(**request) for request in requests()]]
        error = submit_error(sb, **call(3, control_guidance_start=[0.0]))  # one window for two ControlNets
    assert max(float((a - b).abs().max()) for a, b in zip(got, expected)) <= 1e-4
    assert "control_guidance_start" in str(error)


@pytest.mark.parametrize("xl", [False, True])
def test_multi_controlnet_img2img_checks_its_control_image_in_the_caller(xl):
    # NOTE: the img2img __call__ passes `control_image` as its check's `image`: the caller's check must too (it
    # once read the init image there and refused a one-image list, as diffusers' num_images_per_prompt test sends)
    from diffusers import StableDiffusionControlNetImg2ImgPipeline, StableDiffusionXLControlNetImg2ImgPipeline

    cls = StableDiffusionXLControlNetImg2ImgPipeline if xl else StableDiffusionControlNetImg2ImgPipeline
    pipe = cls.from_pipe(_multi_controlnet_pipeline(xl))
    pipe.set_progress_bar_config(disable=True)
    conditions = [torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def call(seed, init_images=1, **extra):
        init = [torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(10 + seed))] * init_images
        return dict(prompt=["a cat"] * init_images, image=init, control_image=conditions, height=32, width=32,
                    strength=0.8, num_inference_steps=3, guidance_scale=5.0, output_type="pt",
                    generator=torch.Generator().manual_seed(seed), **extra)

    def requests():
        return [call(0), call(1, init_images=2), call(2, controlnet_conditioning_scale=[1.0, 0.5])]

    expected = [pipe(**request).images for request in requests()]
    with StepBatched(pipe) as sb:
        got = [future.result(300).images for future in [sb.submit(**request) for request in requests()]]
        wrong = dict(call(3), control_image=conditions[:1])  # one condition for two ControlNets
        error = submit_error(sb, **wrong)
    assert max(float((a - b).abs().max()) for a, b in zip(got, expected)) <= 1e-4
    assert str(error) == plain_error(pipe, **wrong)


@pytest.mark.parametrize("name, renamed", [
    ("StableDiffusionControlNetImg2ImgPipeline", {"image": "control_image"}),
    ("StableDiffusionXLControlNetInpaintPipeline", {"image": "control_image"}),
    ("StableDiffusionAttendAndExcitePipeline", {"indices": "token_indices"}),
    ("StableDiffusionDiffEditPipeline", {"strength": "inpaint_strength"}),
    ("StableDiffusionControlNetPipeline", {}),
    ("FluxPipeline", {}),
])
def test_check_arguments_are_read_from_the_pipelines_own_call(name, renamed):
    import diffusers

    from diffusers_stepbatch.programs.checks.pipeline import renamed_check_arguments

    assert renamed_check_arguments(getattr(diffusers, name)) == renamed


def test_concurrent_first_calls_parse_one_at_a_time(monkeypatch):
    # CPython 3.11's AST constructor shares its recursion depth between threads: requests submitted at once from
    # several threads raised "SystemError: AST constructor recursion depth mismatch" in the parse
    import ast
    import time

    import diffusers

    from diffusers_stepbatch.programs.checks import pipeline as pipeline_checks

    inside, most, lock = [0], [0], threading.Lock()
    parse = ast.parse

    def slow_parse(*args, **kwargs):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.01)
        try:
            return parse(*args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(pipeline_checks.ast, "parse", slow_parse)
    classes = [diffusers.StableDiffusionControlNetImg2ImgPipeline, diffusers.StableDiffusionDiffEditPipeline,
               diffusers.FluxControlNetInpaintPipeline, diffusers.WanPipeline]
    expected = {cls: pipeline_checks._renamed_check_arguments.__wrapped__(cls) for cls in classes}
    pipeline_checks._renamed_check_arguments.cache_clear()
    barrier, found = threading.Barrier(4), {}

    def first_calls(shift):
        barrier.wait()
        for cls in classes[shift:] + classes[:shift]:
            found[shift, cls] = pipeline_checks.renamed_check_arguments(cls)

    threads = [threading.Thread(target=first_calls, args=(shift,)) for shift in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1
    assert found == {(shift, cls): expected[cls] for shift in range(4) for cls in classes}


class _RenamingPipeline:
    """A pipeline whose __call__ passes its `inpaint_strength` as the check's `strength` (as DiffEdit does)."""

    def __call__(self, prompt, inpaint_strength=0.8):
        self.check_inputs(prompt, inpaint_strength)

    def check_inputs(self, prompt, strength):
        if not 0 <= strength <= 1:
            raise ValueError(f"strength should be in [0.0, 1.0] but is {strength}")


class _HookedRenamingPipeline(_RenamingPipeline):  # as hook mode swaps the class: a __call__ of its own
    _stepbatch_original_class = _RenamingPipeline

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs)


@pytest.mark.parametrize("cls", [_RenamingPipeline, _HookedRenamingPipeline])
def test_a_check_error_names_the_call_argument_the_check_reads(cls):
    from diffusers_stepbatch.programs.checks.pipeline import run_check_inputs

    with pytest.raises(InvalidArgument) as caught:
        run_check_inputs(cls(), "a cat", 1.5)
    assert caught.value.argument == "inpaint_strength"
    assert str(caught.value) == "strength should be in [0.0, 1.0] but is 1.5"
