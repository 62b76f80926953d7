"""Qwen-Image TeaCache per request (`models/qwenimage/teacache.py`): the same skips in shared (merged or packed)
forwards as alone, for Qwen-Image-Edit, Edit-Plus and img2img requests of other sizes, reference images and steps;
a request with `teacache=None` equals the plain pipeline, and calls the TeaCache forward can't reproduce
(`zero_cond_t`) compute as the model does."""

import functools
import types

import pytest
import torch
from diffusers import (QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImageImg2ImgPipeline, QwenImagePipeline,
                       QwenImageTransformer2DModel)

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.cache import TeaCacheConfig
from diffusers_stepbatch.cache.teacache import TeaCacheState
from diffusers_stepbatch.models import support_for
from diffusers_stepbatch.cache.teacache_fit import fit_coefficients
from diffusers_stepbatch.models.qwenimage.packing import pack_calls
from diffusers_stepbatch.models.qwenimage.teacache import QWENIMAGE_COEFFICIENTS, signal_hook, teacache_call
from diffusers_stepbatch.testing.image_models import tiny_qwenimage_edit_pipeline

from .references import (  # noqa: F401  (single_thread is a fixture)
    TOLERANCE, BlockTokenPasses, assert_polynomial_beats_a_constant, assert_teacache_shared_equals_alone,
    held_out_changes, max_diff, seeded, single_thread,
)
from .test_qwenimage_edit_e2e import CONFIGS, IMAGES, edit_pipe
from .test_row_states import captured_calls

pytestmark = pytest.mark.usefixtures("single_thread")
TEACACHE = TeaCacheConfig(threshold=0.15)


@functools.lru_cache(maxsize=None)
def sibling(config: str, pipeline_class):
    """A pipeline of `pipeline_class` over the models of `edit_pipe(config)`."""
    if pipeline_class is QwenImageImg2ImgPipeline:
        text_to_image = sibling(config, QwenImagePipeline)
        pipe = QwenImageImg2ImgPipeline(**text_to_image.components)
        pipe.set_progress_bar_config(disable=True)
        pipe.prompt_template_encode = text_to_image.prompt_template_encode  # the tiny tokenizer's short template
        pipe.prompt_template_encode_start_idx = text_to_image.prompt_template_encode_start_idx
        return pipe
    return tiny_qwenimage_edit_pipeline(pipeline_class, models_of=edit_pipe(config))


def _calls(config: str) -> dict:
    """Captured transformer calls: an edit call of two rows with reference-image tokens, and text-to-image calls
    whose two prompts of other lengths pad the text (with its mask)."""
    common = dict(num_inference_steps=2, true_cfg_scale=3.0)
    edit = captured_calls(edit_pipe(config), prompt="make it red", image=IMAGES[0], height=32, width=64,
                          num_images_per_prompt=2, negative_prompt="blurry", **common)
    text = captured_calls(sibling(config, QwenImagePipeline), prompt=["a cat", "a much longer dog"], height=64,
                          width=32, negative_prompt=["bad", "worse"], **common)
    return dict(edit=edit, text=text)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_teacache_forward_with_every_row_computing_is_the_model_forward(config):
    model = edit_pipe(config).transformer
    calls = _calls(config)
    assert calls["edit"][0]["img_shapes"][0][1:] and calls["text"][0]["encoder_hidden_states_mask"] is not None
    assert not bool(calls["text"][0]["encoder_hidden_states_mask"].all())  # padded text
    with torch.no_grad():
        for call in calls["edit"] + calls["text"]:
            (want,) = model(**call)
            state = TeaCacheState(0.0, QWENIMAGE_COEFFICIENTS, num_steps=10)
            (got,) = teacache_call(model, [None, state], call)
            assert max_diff(got, want) == 0.0
            assert state.computed_steps == 1 and state.residual.shape == (1, want.shape[1], model.inner_dim)
            # the packed forward decides on the same signal, and with every row computing is the packed forward
            packed_state = TeaCacheState(0.0, QWENIMAGE_COEFFICIENTS, num_steps=10)
            (packed,) = pack_calls(model, [call], "auto", [[None, packed_state]])[0]
            assert max_diff(packed, pack_calls(model, [call], "auto", [None])[0][0]) == 0.0
            assert max_diff(packed_state.previous_signal, state.previous_signal) <= 1e-6


@pytest.mark.parametrize("config", list(CONFIGS))
def test_skipping_rows_add_their_residual_beside_computing_rows(config):
    """With the same inputs at the next step, a skipping row's output is its computed one, in the plain forward
    and in a packed forward of two sizes where the skipping state's rows sit in two parts (text lengths)."""
    model = edit_pipe(config).transformer
    calls = _calls(config)
    edit, text = calls["edit"][0], calls["text"][0]
    states = [TeaCacheState(1e9, QWENIMAGE_COEFFICIENTS, num_steps=10) for _ in range(3)]
    with torch.no_grad():
        (want_edit,) = model(**edit)
        (want_text,) = model(**text)
        teacache_call(model, [states[0], states[0]], edit)
        pack_calls(model, [edit, text], "auto", [[states[1], None], [states[2], states[2]]])
        for state in states:
            state.step = 1
        (skipped,) = teacache_call(model, [states[0], states[0]], edit)
        (packed_edit,), (packed_text,) = pack_calls(model, [edit, text], "auto", [[states[1], None],
                                                                                 [states[2], states[2]]])
    assert [state.skipped_steps for state in states] == [1, 1, 1]
    assert max_diff(skipped, want_edit) <= 1e-5
    assert max(max_diff(packed_edit, want_edit), max_diff(packed_text, want_text)) <= 1e-5


def _requests(pipeline_class, steps=(10, 12, 11, 13)):
    """Requests of other output sizes, reference images and steps, one with true CFG (two calls a step, one
    state each); the second runs without TeaCache, beside the others."""
    shapes = [(32, 32), (64, 32), (32, 64), (64, 64)]
    references = {QwenImageEditPipeline: [IMAGES[0], IMAGES[1], IMAGES[2], IMAGES[3]],
                  QwenImageEditPlusPipeline: [[IMAGES[0]], [IMAGES[1], IMAGES[2]], [IMAGES[3]], [IMAGES[2]]],
                  QwenImageImg2ImgPipeline: [IMAGES[0], IMAGES[1], IMAGES[2], IMAGES[3]]}[pipeline_class]
    requests = []
    for i, ((height, width), image, count) in enumerate(zip(shapes, references, steps)):
        kwargs = dict(image=image, prompt=["make it red", "a dog on grass", "night", "add a hat"][i], height=height,
                      width=width, num_inference_steps=count, true_cfg_scale=1.0, output_type="latent", seed=i)
        if i == 2:
            kwargs.update(negative_prompt="blurry", true_cfg_scale=3.0)
        if pipeline_class is QwenImageImg2ImgPipeline:
            kwargs["strength"] = 0.9
        requests.append(kwargs)
    requests[1]["teacache"] = None
    return requests


def assert_shared_with_packed_skips_equals_alone(pipe, requests: list[dict]) -> None:
    """`assert_teacache_shared_equals_alone`, where packed forwards of several sizes ran and some of their rows
    skipped the blocks while others ran them."""
    blocker = dict(requests[0], prompt="a blocker", num_inference_steps=1, seed=9)
    model = pipe.transformer
    passes = BlockTokenPasses(model.img_in, model.transformer_blocks[0].attn.to_q)
    try:
        stats = assert_teacache_shared_equals_alone(pipe, requests, TEACACHE, blocker)
    finally:
        passes.remove()
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]
    assert passes.packed_with_skips > 0, passes.forwards


@pytest.mark.parametrize("pipeline_class, config", [(QwenImageEditPipeline, "edit-tiny"),
                                                    (QwenImageEditPlusPipeline, "edit-wide"),
                                                    (QwenImageImg2ImgPipeline, "edit-tiny")])
def test_teacache_in_shared_packed_forwards_equals_teacache_alone(pipeline_class, config):
    pipe = edit_pipe(config) if pipeline_class is QwenImageEditPipeline else sibling(config, pipeline_class)
    requests = _requests(pipeline_class)
    assert_shared_with_packed_skips_equals_alone(pipe, requests)


def test_fitted_coefficients_explain_the_output_change():
    pipe = edit_pipe("edit-tiny")
    call = dict(image=IMAGES[1], height=32, width=64, num_inference_steps=16, true_cfg_scale=1.0,
                output_type="latent")
    coefficients = fit_coefficients(pipe, ["make it red", "a dog on grass"], degree=2, signal=signal_hook, **call)
    assert_polynomial_beats_a_constant(coefficients, *held_out_changes(pipe, "add a yellow hat", signal_hook, **call))


def test_a_zero_cond_t_transformer_runs_as_the_model_does():
    """Qwen-Image-Edit-2511's `zero_cond_t` modulates reference tokens with timestep 0: the TeaCache forward doesn't
    reproduce it, so such calls run the model's forward, every step computed."""
    base = edit_pipe("edit-tiny")
    model = QwenImageTransformer2DModel.from_config(base.transformer.config, zero_cond_t=True).eval()
    model.load_state_dict(base.transformer.state_dict())
    models = types.SimpleNamespace(vae=base.vae, text_encoder=base.text_encoder, tokenizer=base.tokenizer,
                                   transformer=model)
    pipe = tiny_qwenimage_edit_pipeline(QwenImageEditPlusPipeline, models_of=models)
    request = dict(_requests(QwenImageEditPlusPipeline)[0], image=[IMAGES[1]])
    assert teacache_call(model, [None], captured_calls(pipe, **{k: v for k, v in request.items()
                                                               if k not in ("seed", "output_type")})[0]) is None
    want = pipe(**seeded(request)).images
    with StepBatched(pipe, teacache=TeaCacheConfig(threshold=1e9)) as sb:
        assert max_diff(sb(**seeded(request)).images, want) <= TOLERANCE
    assert support_for(model).teacache_forward is teacache_call


@pytest.mark.parametrize("config", list(CONFIGS))
def test_teacache_in_the_qwenimage_programs_shared_packed_forwards_equals_teacache_alone(config):
    """QwenImagePipeline runs its own step program, which takes the model layer's TeaCache forwards."""
    pipe = sibling(config, QwenImagePipeline)
    requests = [{k: v for k, v in kwargs.items() if k != "image"} for kwargs in _requests(QwenImageEditPipeline)]
    requests[3]["prompt"] = "a much longer prompt of a hat"  # text of another length in the same grid's call
    assert_shared_with_packed_skips_equals_alone(pipe, requests)
