"""The model layer's contract, for every registered model with a packed forward, a TeaCache forward or LoRA rows:
packed calls of several sizes equal the model's forward per call, the TeaCache forward at threshold 0 equals the
model's forward (at a first step and at a later one) and a skipping step adds its residual, and a call under per-row
LoRA equals each row run alone with its own adapters set on the model. The calls are those real tiny pipelines make
(two sizes, two rows each), and for the TeaCache forwards also calls made by hand (`MADE_CALLS`)."""

import dataclasses
import functools

import pytest
import torch
from diffusers import SD3Transformer2DModel

from diffusers_stepbatch import models
from diffusers_stepbatch.adapters.lora import per_row_lora
from diffusers_stepbatch.cache.teacache import TeaCacheState
from diffusers_stepbatch.models.calls import ModelCall, cut, describe_call, fill, run_call, slice_rows
from diffusers_stepbatch.testing import add_random_lora_adapters, tiny_flux_pipeline, tiny_qwenimage_pipeline
from diffusers_stepbatch.models.packing import layout as layout_module
from diffusers_stepbatch.testing import FluxSize, tiny_flux_transformer, tiny_sd3_pipeline, tiny_sd_pipeline
from diffusers_stepbatch.testing.hunyuan_video_models import (
    HunyuanVideo15Size,
    tiny_hunyuan_video15_pipeline,
    tiny_hunyuan_video15_transformer,
)
from diffusers_stepbatch.testing.image_models import tiny_flux2_klein_pipeline, tiny_qwenimage21_pipeline
from diffusers_stepbatch.testing.image_models import tiny_z_image_pipeline
from diffusers_stepbatch.testing.ltx_models import LTX2_PLAIN, LTX2Size, tiny_ltx2_pipeline, tiny_ltx2_transformer
from diffusers_stepbatch.toy.video import tiny_wan_pipeline, tiny_wan_transformer

from .flux2_cases import CONFIGS as FLUX2_CONFIGS, flux2_call, flux2_transformer
from .test_flux2_packing import flux2_parts
from .test_hunyuan_video15_packing import CONFIGS as HV15_CONFIGS, hv15_call as hv15_packing_call
from .test_ltx2_packing import CONFIGS as LTX2_CONFIGS, ltx2_call as ltx2_packing_call
from .test_mixed_resolution_qwenimage import PARTS as QWENIMAGE_PARTS, TRANSFORMERS as QWENIMAGE_TRANSFORMERS
from .test_mixed_resolution_qwenimage import random_part as qwenimage_part, tiny_transformer as qwenimage_transformer
from .test_wan_packing import wan_parts
from .references import ROW_ADAPTERS as REFERENCE_ROW_ADAPTERS
from .references import TOLERANCE, add_lora_everywhere, call_row, flux_pipe, max_diff, with_adapters
from .references import single_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("single_thread")
PACKED_TOLERANCE = 1e-5  # packed and TeaCache forwards reorder a few sums against the model's own forward
TWO = dict(prompt=["a red cat", "a much longer blue dog"])

# model module -> (tiny pipeline builder, the call arguments of each size); each call holds two rows or more
CASES = {
    "flux": (functools.partial(tiny_flux_pipeline, guidance_embeds=True),
             [dict(TWO, height=32, width=32, max_sequence_length=16),
              dict(TWO, height=32, width=64, max_sequence_length=16)]),
    "flux2": (tiny_flux2_klein_pipeline,
              [dict(TWO, height=32, width=32, max_sequence_length=16, text_encoder_out_layers=(1,)),
               dict(TWO, height=64, width=32, max_sequence_length=16, text_encoder_out_layers=(1,))]),
    "qwenimage": (tiny_qwenimage_pipeline, [dict(TWO, height=32, width=32), dict(TWO, height=32, width=64)]),
    "qwenimage21": (tiny_qwenimage21_pipeline,
                    [dict(TWO, height=64, width=64, output_resolution=64, use_kv_cache=False),
                     dict(TWO, height=64, width=96, output_resolution=64, use_kv_cache=False)]),
    "sd3": (tiny_sd3_pipeline, [dict(TWO, height=32, width=32), dict(TWO, height=32, width=64)]),
    "unet": (tiny_sd_pipeline, [dict(TWO, height=32, width=32), dict(TWO, height=32, width=64)]),
    "z_image": (tiny_z_image_pipeline, [dict(TWO, height=32, width=32, max_sequence_length=16),
                                        dict(TWO, height=32, width=64, max_sequence_length=16)]),
    "wan": (tiny_wan_pipeline, [dict(TWO, height=16, width=16, num_frames=5),
                                dict(TWO, height=16, width=32, num_frames=5)]),
    "ltx2": (tiny_ltx2_pipeline, [dict(LTX2_PLAIN, **TWO, height=32, width=32, num_frames=9, frame_rate=25.0),
                                  dict(LTX2_PLAIN, **TWO, height=32, width=64, num_frames=9, frame_rate=25.0)]),
    "hunyuan_video15": (functools.partial(tiny_hunyuan_video15_pipeline, guidance_scale=3.0),
                        # NOTE: its pipeline makes one video per call: two runs' calls are joined into one
                        [dict(prompt=("a red cat", "a much longer blue dog"), height=16, width=16, num_frames=5),
                         dict(prompt=("a red cat", "a much longer blue dog"), height=16, width=32, num_frames=5)]),
}


def _with_contract(feature) -> list[str]:
    return sorted({module for cls, module in models.registered_models().items() if feature(models._SUPPORT[cls])})


PACKING = _with_contract(lambda support: support.packing is not None)
TEACACHE = _with_contract(lambda support: support.teacache_forward is not None)
LORA_ROWS = _with_contract(lambda support: support.lora_rows)


def test_every_model_module_registers_a_class():
    registered = set(models.registered_models().values())
    assert [module for module in models.model_modules() if module not in registered] == []


def test_every_model_with_a_contract_has_a_case():
    assert set(PACKING + TEACACHE + LORA_ROWS) <= set(CASES), set(PACKING + TEACACHE + LORA_ROWS) - set(CASES)


@functools.lru_cache(maxsize=None)
def pipe_of(module: str):
    return CASES[module][0]()


def calls_of(pipe, module: str) -> list[ModelCall]:
    """The first denoiser call of a one-step plain run at each size, described as rows (a tuple of prompts: one
    run per prompt, their calls joined)."""
    calls = []
    for size in CASES[module][1]:
        prompts = size["prompt"] if isinstance(size["prompt"], tuple) else (size["prompt"],)
        calls.append(joined([first_call(pipe, dict(size, prompt=prompt)) for prompt in prompts]))
    assert all(call.rows >= 2 for call in calls), [call.rows for call in calls]
    return calls


def first_call(pipe, kwargs: dict) -> ModelCall:
    model, seen = denoiser(pipe), []
    handle = model.register_forward_pre_hook(lambda _m, args, kw: seen.append((args, dict(kw))), with_kwargs=True)
    try:
        pipe(num_inference_steps=1, output_type="pt", generator=torch.Generator().manual_seed(0), **kwargs)
    finally:
        handle.remove()
    return describe_call(model, *seen[0])


def joined(calls: list[ModelCall]) -> ModelCall:
    """One call of all the calls' rows."""
    if len(calls) == 1:
        return calls[0]
    parts = list(zip(*(call.row_inputs for call in calls)))
    row_inputs = [sum(part, []) if isinstance(part[0], list) else torch.cat(part) for part in parts]
    return dataclasses.replace(calls[0], row_inputs=row_inputs, rows=sum(call.rows for call in calls))


def by_name(call: ModelCall) -> dict:
    """The call's arguments by name, as the engine hands them to a packed or TeaCache forward."""
    return fill(call.template, rows_of(call))


def rows_of(call: ModelCall) -> dict:
    return {f"row{i}": value for i, value in enumerate(call.row_inputs)}


def denoiser(pipe):
    return pipe.transformer if hasattr(pipe, "transformer") else pipe.unet


def first_tensor(output):
    while not isinstance(output, torch.Tensor):
        output = output[0] if isinstance(output, (tuple, list)) else output.sample
    return output


@pytest.mark.parametrize("module", PACKING)
def test_packed_calls_equal_the_model_forward_per_call(module):
    pipe = pipe_of(module)
    model, calls = denoiser(pipe), calls_of(pipe, module)
    packing = models.support_for(model).packing
    assert packing.unsupported(model) is None
    if packing.key is not None:  # None: only the model's dedicated program packs its calls (it keys them itself)
        keys = [packing.key(by_name(call)) for call in calls]
        assert None not in keys and keys[0][0] == keys[1][0], keys  # the two sizes pack together
    with torch.no_grad():
        packed = packing.run(model, [by_name(call) for call in calls], "auto", [None] * len(calls))
        own = [first_tensor(run_call(model, call, rows_of(call))) for call in calls]
    for got, want in zip(packed, own):
        assert first_tensor(got).shape == want.shape
        assert max_diff(first_tensor(got), want) <= PACKED_TOLERANCE
    assert min(float(out.abs().mean()) for out in own) > 1e-3  # a mix-up of rows would show


@pytest.mark.parametrize("module", TEACACHE)
def test_teacache_at_threshold_zero_equals_the_model_forward(module):
    """Rows with a state each, then a row without state (it always computes) beside rows that share one state (a
    request's rows): at threshold 0 every step computes, and a step that skips adds the residual the state kept,
    so with the same inputs its output is the computed one."""
    pipe = pipe_of(module)
    model, (call, _) = denoiser(pipe), calls_of(pipe, module)
    support = models.support_for(model)
    states = [TeaCacheState(0.0, support.teacache_coefficients, num_steps=10) for _ in range(call.rows)]
    shared = TeaCacheState(0.0, support.teacache_coefficients, num_steps=10)
    beside = [None] + [shared] * (call.rows - 1)
    with torch.no_grad():
        want = first_tensor(run_call(model, call, rows_of(call)))
        for step in (0, 1):  # a first step computes by rule; a later one computes as the threshold never skips
            for row_states in (states, beside):
                for state in row_states:
                    if state is not None:
                        state.step = step
                got = support.teacache_forward(model, row_states, by_name(call))
                assert got is not None
                assert max_diff(first_tensor(got), want) <= PACKED_TOLERANCE, (step, row_states is beside)
        shared.step, shared.threshold = 2, 1e9
        skipped = support.teacache_forward(model, beside, by_name(call))
    assert {(state.computed_steps, state.skipped_steps) for state in states} == {(2, 0)}
    assert (shared.computed_steps, shared.skipped_steps) == (2, 1)
    read = pipeline_reads(module, by_name(call))
    assert max_diff(read(first_tensor(skipped)), read(want)) <= PACKED_TOLERANCE


def pipeline_reads(module: str, arguments: dict):
    """The part of the model's output its pipeline reads (Qwen-Image 2.1 returns its context tokens first, and a
    skipping row's residual covers the target image's tokens only)."""
    if module == "qwenimage21":
        return lambda output: output[:, -arguments["hidden_states"].shape[1]:]
    return lambda output: output


# ------------------------------------------------------------------------------ TeaCache forwards on made calls
def flux_call():
    transformer = flux_pipe("dev-wide").transformer
    generator = torch.Generator().manual_seed(0)
    rows, tokens, text = 3, 15, 7
    return transformer, dict(
        hidden_states=torch.randn(rows, tokens, transformer.config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(rows, text, transformer.config.joint_attention_dim, generator=generator),
        pooled_projections=torch.randn(rows, transformer.config.pooled_projection_dim, generator=generator),
        timestep=torch.tensor([0.9, 0.5, 0.1]), guidance=torch.tensor([1.0, 3.5, 7.0]),
        img_ids=torch.randn(tokens, 3, generator=generator), txt_ids=torch.zeros(text, 3), joint_attention_kwargs={},
        return_dict=False)


def flux2_made_call(config, guidance_embeds):
    model = flux2_transformer(config, guidance_embeds)
    return model, flux2_call(model)


HV15_SIZE = HunyuanVideo15Size(heads=4, head_dim=8, layers=2)


def hv15_teacache_call(batch=2, frames=3, height=4, width=6):
    model, generator = tiny_hunyuan_video15_transformer(HV15_SIZE), torch.Generator().manual_seed(1)
    config = model.config
    return model, dict(
        hidden_states=torch.randn(batch, config.in_channels, frames, height, width, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, 7, config.text_embed_dim, generator=generator),
        encoder_attention_mask=torch.tensor([[1] * 7, [1] * 4 + [0] * 3][:batch]),
        encoder_hidden_states_2=torch.randn(batch, 5, config.text_embed_2_dim, generator=generator),
        encoder_attention_mask_2=torch.tensor([[1] * 5, [1] * 2 + [0] * 3][:batch]),
        image_embeds=torch.zeros(batch, 3, config.image_embed_dim), return_dict=False)


def ltx2_teacache_call(frames=2, height=2, width=3, audio_frames=5):
    model, generator = tiny_ltx2_transformer(LTX2Size()), torch.Generator().manual_seed(1)
    config = model.config
    return model, dict(
        hidden_states=torch.randn(2, frames * height * width, config.in_channels, generator=generator),
        audio_hidden_states=torch.randn(2, audio_frames, config.audio_in_channels, generator=generator),
        encoder_hidden_states=torch.randn(2, 6, config.caption_channels, generator=generator),
        audio_encoder_hidden_states=torch.randn(2, 6, config.caption_channels, generator=generator),
        timestep=torch.rand(2, generator=generator), encoder_attention_mask=torch.tensor([[1] * 6, [1] * 3 + [0] * 3]),
        audio_encoder_attention_mask=torch.tensor([[1] * 6, [1] * 4 + [0] * 2]), num_frames=frames, height=height,
        width=width, fps=25.0, audio_num_frames=audio_frames, return_dict=False)


def wan_call(rows=2, frames=3, height=4, width=4):
    model, generator = tiny_wan_transformer(heads=3, head_dim=8), torch.Generator().manual_seed(1)
    timestep = torch.rand(rows, 1, generator=generator)[:, 0] * 1000  # NOTE: drawn as the packing tests draw it
    text = torch.randn(rows, 16, 32, generator=generator)
    video = torch.randn(rows, model.config.in_channels, frames, height, width, generator=generator)
    return model, dict(hidden_states=video, timestep=timestep, encoder_hidden_states=text, return_dict=False)


# case -> (a model and a call of its, each row's state (equal numbers: one state; None: no state), the threshold at
# the computing step (0: the next step computes too), whether the residual the state keeps fits the call, tolerance)
MADE_CALLS = {
    "flux": (flux_call, [0, 0, 1], 0.4, lambda model, call, residual: residual.shape[0] == 2, 0.0),
    **{f"flux2-{config}-{'guidance' if guidance else 'plain'}": (
        functools.partial(flux2_made_call, config, guidance), [None, 0, 0], 0.0,
        # the reference tokens included
        lambda model, call, residual: residual.shape == (2, call["hidden_states"].shape[1], model.inner_dim), 1e-5)
       for config in sorted(FLUX2_CONFIGS) for guidance in (False, True)},
    "hunyuan_video15": (hv15_teacache_call, [0, None], 0.4, lambda model, call, residual: residual.shape == (
        3 * 4 * 6, HV15_SIZE.heads * HV15_SIZE.head_dim), 1e-5),
    "ltx2": (ltx2_teacache_call, [None, 0], 0.4, lambda model, call, residual: residual[0].shape[0] == 2 * 2 * 3, 1e-5),
    "wan": (wan_call, [0, 0], 0.4, lambda model, call, residual: residual.shape == (2, 3 * 2 * 2, 24), 1e-5),
}


def outputs(output) -> list[torch.Tensor]:
    return list(output) if isinstance(output, tuple) else [first_tensor(output)]


@pytest.mark.parametrize("case", sorted(MADE_CALLS))
def test_teacache_forward_with_every_row_computing_equals_the_model_forward(case):
    """A step whose states compute (the first, by rule) equals the model's forward, rows without state beside;
    each state keeps a residual of its own rows; at threshold 0 the next step computes too, even where the signal
    did not move; a skipping step adds the residual, so with the same inputs its output is the computed one."""
    build, rows, threshold, residual_fits, tolerance = MADE_CALLS[case]
    model, call = build()
    support = models.support_for(model)
    states = {}
    row_states = [None if row is None else states.setdefault(
        row, TeaCacheState(threshold, support.teacache_coefficients, num_steps=10)) for row in rows]
    with torch.no_grad():
        want = outputs(model(**call))
        got = outputs(support.teacache_forward(model, row_states, call))
        assert max(max_diff(a, b) for a, b in zip(got, want)) <= tolerance
        assert [state.computed_steps for state in states.values()] == [1] * len(states)
        assert residual_fits(model, call, next(iter(states.values())).residual)
        step = 1
        if threshold == 0.0:
            for state in states.values():
                state.step = step
            again = outputs(support.teacache_forward(model, row_states, call))
            assert [(state.computed_steps, state.skipped_steps) for state in states.values()] == [(2, 0)] * len(states)
            assert max(max_diff(a, b) for a, b in zip(again, want)) <= 1e-5
            step = 2
        for state in states.values():
            state.step, state.threshold = step, 1e9
        skipped = outputs(support.teacache_forward(model, row_states, call))
    assert [state.skipped_steps for state in states.values()] == [1] * len(states)
    assert max(max_diff(a, b) for a, b in zip(skipped, want)) <= 1e-5


# ------------------------------------------------------------------------------ packed forwards on made calls
def ltx2_packed_calls(config, per_token=None):
    """Calls of other grids, audio lengths and prompts (`per_token`: per-token video timesteps, with cross-attention
    timesteps or without), or None for the plain set."""
    model = tiny_ltx2_transformer(LTX2_CONFIGS[config])
    if per_token is None:
        return model, [ltx2_packing_call(model, 2, (2, 2, 2), 5, 16, 0, valid=[10, 16]),  # two rows, a padded prompt
                       ltx2_packing_call(model, 1, (3, 2, 4), 9, 16, 1, valid=[3]),  # non-square, more frames and audio
                       ltx2_packing_call(model, 1, (1, 4, 2), 3, 8, 2, coords=False, fps=24.0),  # RoPE from numbers
                       ltx2_packing_call(model, 3, (2, 2, 2), 5, 16, 3)]  # the first call's token counts, other rows
    return model, [ltx2_packing_call(model, 2, (2, 2, 2), 5, 16, 0, per_token=True, cross_timestep=per_token),
                   ltx2_packing_call(model, 1, (3, 2, 4), 9, 16, 1, per_token=True, cross_timestep=per_token),
                   # per row, beside per-token rows
                   ltx2_packing_call(model, 1, (2, 2, 2), 5, 16, 2, cross_timestep=per_token)]


def hv15_packed_calls(config):
    model = tiny_hunyuan_video15_transformer(HV15_CONFIGS[config][0])
    return model, [hv15_packing_call(2, (2, 4, 4), [5, 12], [0, 3], 0),  # two rows, padded prompts, one without glyphs
                   hv15_packing_call(1, (3, 4, 8), [7], [8], 1),  # non-square, more frames
                   hv15_packing_call(1, (1, 8, 4), [2], [1], 2, image=True),  # image-conditioned: image tokens kept
                   hv15_packing_call(3, (2, 4, 4), [5, 5, 4], [0, 0, 2], 3)]  # the first call's grid, other prompts


def image_ids(height, width):
    ids = torch.zeros(height, width, 3)
    ids[..., 1] = torch.arange(height)[:, None]
    ids[..., 2] = torch.arange(width)[None, :]
    return ids.reshape(-1, 3)


# (rows, latent grid, text tokens): non-square grids, text lengths that differ, and a 16x token ratio
PART_SHAPES = [(2, (2, 2), 8), (1, (2, 8), 5), (3, (8, 8), 8), (1, (4, 2), 3)]
FLUX_SIZES = {
    "default": (FluxSize(), True),
    "wide-text": (FluxSize(num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=4,
                           joint_attention_dim=24, pooled_projection_dim=40, in_channels=8), False),
    "single-blocks": (FluxSize(num_layers=1, num_single_layers=3, attention_head_dim=8, num_attention_heads=3), True),
}
SD3_CONFIGS = {
    "patch1": dict(patch_size=1, num_layers=2, attention_head_dim=8, num_attention_heads=2, in_channels=4),
    "patch2-dual": dict(patch_size=2, num_layers=3, attention_head_dim=4, num_attention_heads=4, in_channels=8,
                        dual_attention_layers=(0, 1), qk_norm="rms_norm"),
}
WAN_CASES = ["t2v", "t2v-flex", "text-lengths", "per-token", "i2v", "i2v-image-kv", "flf2v"]


def flux_packed_calls(size_name):
    size, guidance = FLUX_SIZES[size_name]
    transformer = tiny_flux_transformer(size, guidance_embeds=guidance, seed=3)
    generator = torch.Generator().manual_seed(0)
    return transformer, [
        dict(hidden_states=torch.randn(rows, h * w, size.in_channels, generator=generator),
             encoder_hidden_states=torch.randn(rows, text, size.joint_attention_dim, generator=generator),
             pooled_projections=torch.randn(rows, size.pooled_projection_dim, generator=generator),
             timestep=torch.rand(rows, generator=generator),
             guidance=torch.rand(rows, generator=generator) * 5 if guidance else None,
             txt_ids=torch.zeros(text, 3), img_ids=image_ids(h, w), return_dict=False)
        for rows, (h, w), text in PART_SHAPES]


def sd3_packed_calls(config_name, skip_layers):
    config = SD3_CONFIGS[config_name]
    torch.manual_seed(1)
    transformer = SD3Transformer2DModel(sample_size=32, out_channels=config["in_channels"], joint_attention_dim=32,
                                        caption_projection_dim=16, pooled_projection_dim=32, **config).eval()
    generator, patch = torch.Generator().manual_seed(0), config["patch_size"]
    return transformer, [
        dict(hidden_states=torch.randn(rows, config["in_channels"], 2 * h * patch, 2 * w * patch, generator=generator),
             encoder_hidden_states=torch.randn(rows, text, 32, generator=generator),
             pooled_projections=torch.randn(rows, 32, generator=generator),
             timestep=torch.rand(rows, generator=generator) * 1000, skip_layers=skip_layers, return_dict=False)
        for rows, (h, w), text in PART_SHAPES]


def wan_packed_calls(case):
    image_dim = 4 if case.startswith(("i2v", "flf2v")) else None
    # NOTE: first-last-frame-to-video: two image embeddings per video, folded by the model's image pos_embed
    model = tiny_wan_transformer(36 if image_dim else 16, heads=3, head_dim=8, layers=2, image_dim=image_dim,
                                 image_kv=case == "i2v-image-kv", pos_embed_seq_len=10 if case == "flf2v" else None)
    shapes = [(2, 3, 4, 4), (1, 2, 4, 6), (1, 3, 6, 4), (2, 1, 8, 8)]  # rows, frames, height, width (latent)
    text_lengths = {"text-lengths": [16, 8, 16, 24], "i2v-image-kv": [512] * 4}.get(case)
    parts = wan_parts(model, shapes, torch.Generator().manual_seed(0), per_token=case == "per-token",
                      image_tokens=5 if image_dim else None, text_lengths=text_lengths,
                      image_blocks=2 if case == "flf2v" else 1)
    return model, [dict(hidden_states=part.hidden_states, timestep=part.timestep,
                        encoder_hidden_states=part.encoder_hidden_states,
                        encoder_hidden_states_image=part.encoder_hidden_states_image, return_dict=False)
                   for part in parts]


def flux2_packed_calls(config, guidance_embeds):
    model = flux2_transformer(config, guidance_embeds)
    parts = flux2_parts([(2, (4, 4), [], 8), (1, (2, 6), [(3, 3)], 5), (3, (6, 2), [(2, 2), (4, 3)], 12)])
    if guidance_embeds:
        for part in parts:
            part.guidance = 4 * torch.rand(part.hidden_states.shape[0])
    return model, [dict(hidden_states=p.hidden_states, encoder_hidden_states=p.encoder_hidden_states,
                        timestep=p.timestep, guidance=p.guidance,
                        img_ids=p.img_ids[None].expand(len(p.timestep), -1, -1), txt_ids=p.txt_ids, return_dict=False)
                   for p in parts]


def qwenimage_packed_calls(name):
    """Grids 16x apart in tokens, equal token counts of other RoPE, an odd grid; padded text with its mask."""
    transformer, generator = qwenimage_transformer(name), torch.Generator().manual_seed(1)
    parts = [qwenimage_part(transformer, grid, lengths, padded, generator) for grid, lengths, padded in QWENIMAGE_PARTS]
    return transformer, [dict(hidden_states=part.hidden_states, timestep=part.timestep,
                              encoder_hidden_states=part.text, encoder_hidden_states_mask=part.text_mask,
                              img_shapes=[part.img_shapes] * part.hidden_states.shape[0], return_dict=False)
                         for part in parts]


def outputs_not_near_zero(expected) -> bool:  # outputs that a mix-up of rows would change
    return min(float(out[0].abs().mean()) for out in expected) > 1e-2


def first_rows_differ(expected) -> bool:  # a row that read another's positions or modulation would show
    return max_diff(expected[0][0][0], expected[0][0][1]) > 1e-2


# case -> (a model and its calls of other sizes, the packed attention method, whether AdaLN values broadcast per
# part (long rows' default) or go per token (the tiny shapes' default), the tolerance, a check of the outputs)
MADE_PACKS = {
    **{f"flux-{size}-{'broadcast' if broadcast else 'per-token'}-{method}": (
        functools.partial(flux_packed_calls, size), method, broadcast, 1e-5, None)
       for size in FLUX_SIZES for broadcast in (False, True) for method in ("recover_scatter", "flex")},
    **{f"sd3-{config}-skip{skip}-{'broadcast' if broadcast else 'per-token'}-{method}": (
        functools.partial(sd3_packed_calls, config, skip), method, broadcast, 1e-5, None)
       for config in SD3_CONFIGS for skip in (None, [1])
       for broadcast, method in ((False, "recover_scatter"), (True, "recover_scatter"), (True, "flex"))},
    **{f"wan-{case}": (functools.partial(wan_packed_calls, case), "flex" if case == "t2v-flex" else "auto", None, 1e-5,
                       outputs_not_near_zero) for case in WAN_CASES},
    **{f"flux2-{config}-{'guidance' if guidance else 'plain'}-{method}": (
        functools.partial(flux2_packed_calls, config, guidance), method, None, 1e-5, first_rows_differ)
       for config in sorted(FLUX2_CONFIGS) for guidance in (False, True) for method in ("recover_scatter", "flex")},
    **{f"qwenimage-{name}-{'broadcast' if broadcast else 'per-token'}-{method}": (
        functools.partial(qwenimage_packed_calls, name), method, broadcast, TOLERANCE, None)
       for name in QWENIMAGE_TRANSFORMERS
       for broadcast, method in ((False, "recover_scatter"), (True, "recover_scatter"), (True, "flex"))},
    **{f"ltx2-{config}-{method}": (functools.partial(ltx2_packed_calls, config), method, None, 1e-5, None)
       for config in LTX2_CONFIGS for method in ("recover_scatter", "flex")},
    **{f"ltx2-{config}-per-token-{'cross' if cross else 'plain'}": (
        functools.partial(ltx2_packed_calls, config, cross), "recover_scatter", None, 1e-5, None)
       for config in LTX2_CONFIGS for cross in (True, False)},
    **{f"hunyuan_video15-{config}-{method}": (functools.partial(hv15_packed_calls, config), method, None, 1e-5,
                                                  None)
       for config in HV15_CONFIGS for method in ("recover_scatter", "flex")},
}


@pytest.mark.parametrize("case", sorted(MADE_PACKS))
def test_packed_forward_on_made_calls_equals_the_model_per_call(case, monkeypatch):
    build, method, broadcast, tolerance, check = MADE_PACKS[case]
    if broadcast is not None:
        monkeypatch.setattr(layout_module, "_BROADCAST_MIN_TOKENS", 0 if broadcast else 10**9)
    model, calls = build()
    packing = models.support_for(model).packing
    if packing.key is not None:  # None: only the model's dedicated program packs its calls (it keys them itself)
        keys = [packing.key(call) for call in calls]
        assert None not in keys and len({key for key, _ in keys}) == 1  # all of them pack together
    with torch.no_grad():
        expected = [outputs(model(**call)) for call in calls]
        packed = [outputs(output) for output in packing.run(model, calls, method, [None] * len(calls))]
    differences = [max_diff(got, want) for pair in zip(packed, expected) for got, want in zip(*pair)]
    assert len(packed) == len(calls)
    assert max(differences) <= tolerance, differences
    assert [[tuple(o.shape) for o in out] for out in packed] == [[tuple(o.shape) for o in out] for out in expected]
    assert check is None or check(expected)


# ------------------------------------------------------------------------------ LoRA rows on made calls
def wan_row(call: dict, row: int, rows: int) -> dict:
    """`call_row`, with the row's image embeddings (several per row for first-last-frame-to-video)."""
    one, image = call_row(call, row, rows), call.get("encoder_hidden_states_image")
    if image is not None:
        blocks = image.shape[0] // rows
        one["encoder_hidden_states_image"] = image[row * blocks:(row + 1) * blocks]
    return one


def ltx2_lora_calls(per_token):
    model = tiny_ltx2_transformer(LTX2_CONFIGS["ltx2-23"])
    return model, [ltx2_packing_call(model, 1, (3, 2, 4), 9, 16, 1, per_token=per_token),  # sorts after the next
                   ltx2_packing_call(model, 2, (2, 2, 2), 5, 16, 0, valid=[10, 16], per_token=per_token),
                   ltx2_packing_call(model, 2, (1, 4, 2), 3, 8, 2, coords=False, fps=24.0)]


def hv15_lora_calls(config):
    model = tiny_hunyuan_video15_transformer(HV15_CONFIGS[config][0])
    return model, [hv15_packing_call(1, (3, 4, 8), [7], [8], 1),  # sorts after the next call's rows
                   hv15_packing_call(2, (2, 4, 4), [5, 12], [0, 3], 0),  # rows of one call in another packed order
                   hv15_packing_call(1, (1, 8, 4), [2], [1], 2, image=True),
                   hv15_packing_call(3, (2, 4, 4), [5, 5, 4], [0, 0, 2], 3)]


EVERY_LAYER_ADAPTERS = [{"all": 0.5}, {"a": 1.0, "all": 0.3}, {}, {"b": 0.5, "c": 0.6}]
# case -> (a model and its calls, the packed attention method, the row of a call) for each forward (packed or the
# model's own) and adapters (the test adapters, or one more on every Linear and Conv layer)
MADE_LORA = {
    **{f"wan-{case}": (functools.partial(wan_packed_calls, case), "auto", wan_row)
       for case in ("t2v", "per-token", "i2v-image-kv", "flf2v")},
    **{f"ltx2-{'per-token' if per_token else 'per-row'}": (functools.partial(ltx2_lora_calls, per_token),
                                                           "recover_scatter", call_row)
       for per_token in (False, True)},
    **{f"hunyuan_video15-{config}": (functools.partial(hv15_lora_calls, config), "recover_scatter", call_row)
       for config in HV15_CONFIGS},
}


@pytest.mark.parametrize("everywhere", [False, True], ids=["adapters", "every-layer"])
@pytest.mark.parametrize("forward", ["packed", "plain"])
@pytest.mark.parametrize("case", sorted(MADE_LORA))
def test_lora_rows_on_made_calls_equal_set_adapters_per_row(case, forward, everywhere):
    """Per-row LoRA in the model's own forward (rows on dim 0, or the token streams the model joins itself) and in
    its packed forward (over the packed token streams, each shape's own steps on its rows): every row as its plain
    forward after set_adapters."""
    build, method, row_of = MADE_LORA[case]
    model, calls = build()
    add_random_lora_adapters(model)
    if everywhere:
        add_lora_everywhere(model)
    support = models.support_for(model)
    counts = [call["hidden_states"].shape[0] for call in calls]
    sets = EVERY_LAYER_ADAPTERS if everywhere else REFERENCE_ROW_ADAPTERS
    row_adapters = [sets[r % len(sets)] for r in range(sum(counts))]
    with torch.no_grad():
        if forward == "packed":
            with per_row_lora(model, row_adapters, token_rows=support.packing.token_rows(model, calls)):
                results = [outputs(out) for out in support.packing.run(model, calls, method, [None] * len(calls))]
        else:
            results, first = [], 0
            for call, count in zip(calls, counts):
                streams = support.lora_token_rows(call) if support.lora_token_rows is not None else None
                with per_row_lora(model, row_adapters[first:first + count], token_rows=streams):
                    results.append(outputs(model(**call)))
                first += count
        first = 0
        for call, count, result in zip(calls, counts, results):
            for r in range(count):
                one = row_of(call, r, count)
                want = outputs(with_adapters(model, row_adapters[first + r], model, **one))
                for got, expected in zip(result, want):  # every output (LTX-2: video, then audio)
                    assert max_diff(got[r:r + 1], expected) <= TOLERANCE, (first + r, row_adapters[first + r])
                if first + r == 0:  # the adapters change the row
                    assert max_diff(want[0], outputs(with_adapters(model, {}, model, **one))[0]) > 1e-3
            first += count


# adapters {name: weight} of a call's rows, in turn
ROW_ADAPTERS = [{"a": 1.0}, {"b": 0.5, "c": 1.0}, {}, {"a": 0.3, "b": 1.0}]


@pytest.mark.parametrize("module", LORA_ROWS)
def test_lora_rows_apply_per_row(module):
    pipe = CASES[module][0]()  # NOTE: a pipeline of its own: the adapters stay on its model
    model, (call, _) = denoiser(pipe), calls_of(pipe, module)
    add_random_lora_adapters(model)
    support, rows = models.support_for(model), rows_of(call)
    adapters = [ROW_ADAPTERS[row % len(ROW_ADAPTERS)] for row in range(call.rows)]
    token_rows = support.lora_token_rows(by_name(call)) if support.lora_token_rows is not None else None
    with torch.no_grad():
        with per_row_lora(model, adapters, token_rows):
            together = support.lora_forward(model, by_name(call)) if support.lora_forward is not None else None
            together = run_call(model, call, rows) if together is None else together
        for row, row_adapters in enumerate(adapters):
            model.enable_lora() if row_adapters else model.disable_lora()
            model.set_adapters(list(row_adapters) or ["a"], list(row_adapters.values()) or [1.0])
            alone = first_tensor(run_call(model, call, slice_rows(rows, row, row + 1)))
            got = first_tensor(cut(together, row, row + 1, call.rows, support))
            assert max_diff(got, alone) <= TOLERANCE, (row, row_adapters)
        model.disable_lora()
        base = first_tensor(run_call(model, call, slice_rows(rows, 0, 1)))
        model.enable_lora()
    assert max_diff(base, first_tensor(cut(together, 0, 1, call.rows, support))) > 1e-3  # the adapters tell
