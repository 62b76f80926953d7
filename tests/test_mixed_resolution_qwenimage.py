"""Mixed resolutions for QwenImagePipeline: rows of different grids and text lengths in one packed forward.

The packed forward (`models/qwenimage/packing.py`) must equal `QwenImageTransformer2DModel.forward` per row, with text
padding dropped instead of masked; through StepBatched, requests of different sizes share transformer calls
and each still equals its solo unwrapped run.
"""

import functools
import time

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusers_stepbatch import SchedulerConfig, StepBatched
from diffusers_stepbatch.models.qwenimage.packing import (
    QwenImagePart,
    qwenimage_packed_forward,
    qwenimage_packing_unsupported,
)

from .references import (  # noqa: F401  (single_thread is a fixture)
    TOLERANCE,
    family_pipe,
    max_diff,
    seeded,
    single_thread,
    submit_all,
)

pytestmark = pytest.mark.usefixtures("single_thread")

# (heads, head dim, layers, axes_dims_rope, joint_attention_dim)
TRANSFORMERS = {
    "2x16-1layer": (2, 16, 1, (4, 6, 6), 12),
    "4x8-2layers": (4, 8, 2, (2, 2, 4), 8),
    "3x24-2layers": (3, 24, 2, (8, 6, 10), 20),
}

# Per part: the grid (frames, rows, columns) and each row's valid text length; rows are padded to `padded`.
# 2x2 next to 8x8 (16x the tokens), 2x6 and 6x2 (equal token counts, different RoPE), an odd 5x3 grid.
PARTS = [((1, 2, 2), [3, 7], 7), ((1, 8, 8), [4], 4), ((1, 2, 6), [2, 6, 1], 6), ((1, 6, 2), [2], 5),
         ((1, 5, 3), [5, 5], 9)]


def tiny_transformer(name):
    heads, head_dim, layers, rope, text_dim = TRANSFORMERS[name]
    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=layers, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=text_dim, axes_dims_rope=rope,
    ).eval()


def random_part(transformer, grid, lengths, padded, generator):
    rows, tokens = len(lengths), grid[0] * grid[1] * grid[2]
    text_dim = transformer.config.joint_attention_dim
    mask = torch.zeros(rows, padded, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return QwenImagePart(
        hidden_states=torch.randn(rows, tokens, transformer.config.in_channels, generator=generator),
        timestep=torch.rand(rows, generator=generator),
        text=torch.randn(rows, padded, text_dim, generator=generator), text_mask=mask, img_shapes=[grid],
    )


def model_forward(transformer, hidden, timestep, text, mask, grid):
    return transformer(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text,
                       encoder_hidden_states_mask=mask, img_shapes=[[grid]] * hidden.shape[0], return_dict=False)[0]


@pytest.mark.parametrize("name", list(TRANSFORMERS))
@torch.no_grad()
def test_unpadded_rows_equal_padded_masked_rows(name):
    """Each row alone without padding (no mask) == the same row padded and masked, in the model and packed."""
    transformer = tiny_transformer(name)
    generator = torch.Generator().manual_seed(2)
    parts = [random_part(transformer, grid, lengths, padded, generator) for grid, lengths, padded in PARTS]
    packed = qwenimage_packed_forward(transformer, parts)
    for part, packed_rows in zip(parts, packed):
        for row in range(part.hidden_states.shape[0]):
            length = int(part.text_mask[row].sum())
            args = (part.hidden_states[row:row + 1], part.timestep[row:row + 1])
            unpadded = model_forward(transformer, *args, part.text[row:row + 1, :length], None, part.img_shapes[0])
            padded = model_forward(transformer, *args, part.text[row:row + 1], part.text_mask[row:row + 1],
                                   part.img_shapes[0])
            assert max_diff(unpadded, padded) <= TOLERANCE
            assert max_diff(packed_rows[row:row + 1], unpadded) <= TOLERANCE


@torch.no_grad()
def test_mask_with_holes_keeps_each_text_token_position():
    """A mask that is not a prefix (given prompt_embeds_mask): kept tokens keep their positions in the text."""
    transformer = tiny_transformer("2x16-1layer")
    generator = torch.Generator().manual_seed(3)
    holed = random_part(transformer, (1, 2, 4), [6, 6], 6, generator)
    holed.text_mask[0, 1] = 0
    holed.text_mask[1, :2] = 0
    other = random_part(transformer, (1, 4, 4), [3], 5, generator)
    got = qwenimage_packed_forward(transformer, [holed, other])
    for part, output in zip([holed, other], got):
        want = model_forward(transformer, part.hidden_states, part.timestep, part.text, part.text_mask,
                             part.img_shapes[0])
        assert max_diff(output, want) <= TOLERANCE


def test_unsupported_transformers_are_named():
    transformer = tiny_transformer("2x16-1layer")
    assert qwenimage_packing_unsupported(transformer) is None

    class OtherProcessor(QwenDoubleStreamAttnProcessor2_0):
        pass

    transformer.transformer_blocks[0].attn.set_processor(OtherProcessor())
    assert "OtherProcessor" in qwenimage_packing_unsupported(transformer)
    torch.manual_seed(0)
    zero_cond = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=12,
                                            axes_dims_rope=(4, 6, 6), zero_cond_t=True)
    assert "zero_cond_t" in qwenimage_packing_unsupported(zero_cond)


def record_calls(transformer):
    """Per transformer call (one img_in each): packed or not, its image tokens, the grids RoPE was built for."""
    calls = []

    def on_img_in(_module, args):
        # NOTE: the model's own forward embeds [rows, tokens, channels]; a packed call embeds [tokens, channels].
        calls.append({"packed": args[0].dim() == 2, "tokens": args[0].shape[-2], "grids": set()})

    def on_pos_embed(_module, args, kwargs):
        calls[-1]["grids"].update(tuple(shape) for shape in args[0][0])

    return calls, [transformer.img_in.register_forward_pre_hook(on_img_in),
                   transformer.pos_embed.register_forward_pre_hook(on_pos_embed, with_kwargs=True)]


def mixed_requests():
    """7 requests over 4 sizes (16x16 next to 64x64: 16x the tokens; 16x48 and 40x24 non-square)."""
    return [
        dict(prompt="x", height=16, width=16, num_inference_steps=2, seed=1, true_cfg_scale=1.0),
        dict(prompt="a blue square at the top left of a gray field", negative_prompt="noise", true_cfg_scale=5.0,
             height=64, width=64, num_inference_steps=4, seed=2),
        dict(prompt=["a cat", "a cat sitting on a very long red sofa"], negative_prompt=["dog", "x"],
             true_cfg_scale=1.5, height=16, width=48, num_inference_steps=3, seed=3),
        dict(prompt="a green cross", negative_prompt="a long, long, long negative prompt", true_cfg_scale=3.0,
             height=40, width=24, num_inference_steps=5, seed=4),
        dict(prompt="a tiny red dot on white", height=64, width=64, num_inference_steps=3, seed=5),
        dict(prompt="two birds", negative_prompt="blur", true_cfg_scale=2.0, height=16, width=16,
             num_inference_steps=4, seed=6),
        dict(prompt="a house by a lake at night", height=16, width=48, num_inference_steps=2, seed=7,
             true_cfg_scale=4.0, negative_prompt="daylight, sun, many clouds"),
    ]


@pytest.mark.parametrize("name", ["qwen-tiny", "qwen-wide"])
def test_requests_of_different_sizes_share_calls_and_equal_solo_runs(name):
    pipe = family_pipe(name)
    requests = [dict(kwargs, output_type="pt") for kwargs in mixed_requests()]
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    calls, handles = record_calls(pipe.transformer)
    try:
        with StepBatched(pipe, scheduler=SchedulerConfig(cost_aware=False), max_batch_size=16) as sb:
            results = submit_all(sb, requests)
            mixed = sb.stats()["mixed"]
    finally:
        for handle in handles:
            handle.remove()
    for kwargs, got, want in zip(requests, results, expected):
        assert got.images.shape == want.shape
        assert max_diff(got.images, want) <= TOLERANCE, kwargs
    assert mixed["calls"] > 0 and mixed["sizes_per_call"] >= 2
    grid_tokens = {grid: grid[0] * grid[1] * grid[2] for call in calls for grid in call["grids"]}
    packed = [call for call in calls if call["packed"] and len(call["grids"]) >= 2]
    assert packed, "no transformer call carried the tokens of requests of different sizes"
    for call in packed:
        assert call["tokens"] >= sum(grid_tokens[grid] for grid in call["grids"])
    assert any({(1, 2, 2), (1, 8, 8)} <= call["grids"] for call in packed), "16x16 and 64x64 never shared a call"


def test_unsupported_processor_runs_per_size_and_equals_solo_runs():
    pipe = family_pipe("qwen-tiny")

    class OtherProcessor(QwenDoubleStreamAttnProcessor2_0):
        pass

    requests = [dict(kwargs, output_type="pt") for kwargs in mixed_requests()[:4]]
    processors = pipe.transformer.attn_processors
    pipe.transformer.set_attn_processor(OtherProcessor())
    try:
        expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
        with StepBatched(pipe, scheduler=SchedulerConfig(cost_aware=False)) as sb:
            results = submit_all(sb, requests)
            mixed = sb.stats()["mixed"]
    finally:
        pipe.transformer.set_attn_processor(processors)
    assert mixed["calls"] == 0
    for got, want in zip(results, expected):
        assert max_diff(got.images, want) <= TOLERANCE


def test_mixed_resolution_false_runs_one_call_per_size():
    pipe = family_pipe("qwen-tiny")
    requests = [dict(kwargs, output_type="pt") for kwargs in mixed_requests()[:4]]
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    with StepBatched(pipe, scheduler=SchedulerConfig(cost_aware=False), mixed_resolution=False) as sb:
        results = submit_all(sb, requests)
        assert sb.stats()["mixed"]["calls"] == 0
    for got, want in zip(results, expected):
        assert max_diff(got.images, want) <= TOLERANCE


SIZES = [(16, 16), (64, 64), (16, 48), (40, 24), (32, 32)]


@functools.cache
def solo_reference(size, steps, cfg, prompt, seed):
    return family_pipe("qwen-tiny")(**seeded(random_kwargs(size, steps, cfg, prompt, seed))).images


def random_kwargs(size, steps, cfg, prompt, seed):
    return dict(prompt=prompt, negative_prompt="blur, noise" if cfg > 1 else None, true_cfg_scale=cfg,
                height=size[0], width=size[1], num_inference_steps=steps, seed=seed, output_type="pt")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.fixed_dictionaries({
    "size": st.sampled_from(SIZES), "steps": st.integers(1, 4), "cfg": st.sampled_from([1.0, 2.5]),
    "prompt": st.sampled_from(["a", "a red square", "a cat on a long sofa under a lamp"]), "seed": st.integers(0, 2),
    "delay_ms": st.integers(0, 10),
}), min_size=2, max_size=5))
def test_random_size_mixes_and_arrivals_equal_solo(requests):
    keys = [(r["size"], r["steps"], r["cfg"], r["prompt"], r["seed"]) for r in requests]
    expected = [solo_reference(*key) for key in keys]
    with StepBatched(family_pipe("qwen-tiny"), scheduler=SchedulerConfig(cost_aware=False)) as sb:
        futures = []
        for request, key in zip(requests, keys):
            time.sleep(request["delay_ms"] / 1000)
            futures.append(sb.submit(**seeded(random_kwargs(*key))))
        results = [future.result(timeout=300).images for future in futures]
    for got, want in zip(results, expected):
        assert max_diff(got, want) <= TOLERANCE
