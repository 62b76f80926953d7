"""LTX-2 requests of different frame counts, sizes and prompt lengths share packed transformer calls, exactly.

LTX2Pipeline runs through the generic program; its transformer calls (video + audio streams) merge by rows at
equal sizes and pack through `models/ltx2/packing.py` at other sizes. Each request's video and audio must equal
its solo unwrapped run.
"""

import functools

import pytest
import torch
from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoAttnProcessor

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.models import support_for
from diffusers_stepbatch.models.ltx2.packing import ltx2_packing_unsupported, pack_key
from diffusers_stepbatch.programs import generic, program_for
from diffusers_stepbatch.testing.ltx_models import LTX2_PLAIN, LTX2Size, tiny_ltx2_pipeline, tiny_ltx2_transformer

from .references import (  # noqa: F401
    ROW_ADAPTERS,
    TOLERANCE,
    call_row,
    max_diff,
    seeded,
    single_thread,
    submit_all,
    with_adapters,
)

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = {
    "ltx2-split": LTX2Size(),
    # interleaved RoPE, gated attention and LTX-2.3's timestep-modulated prompt and queries
    "ltx2-23": LTX2Size(heads=4, head_dim=8, audio_heads=2, audio_head_dim=8, rope_type="interleaved",
                        gated_attn=True, cross_attn_mod=True),
}

# (height, width, num_frames): three frame counts, square and non-square
SIZES = [(32, 32, 5), (32, 64, 9), (64, 32, 5), (32, 32, 9), (32, 64, 1)]


@functools.cache
def ltx2_pipe(config: str):
    return tiny_ltx2_pipeline(CONFIGS[config])


def _requests(sizes):
    requests = []
    for i, (height, width, frames) in enumerate(sizes):
        guided = i % 2 == 1
        requests.append(dict(LTX2_PLAIN, prompt="a robot " * (i + 1), negative_prompt="blurry", height=height,
                             width=width, num_frames=frames, frame_rate=25.0, num_inference_steps=2 + i % 2,
                             guidance_scale=2.0 + i if guided else 1.0, audio_guidance_scale=1.5 if guided else 1.0,
                             max_sequence_length=16 if i < 3 else 24, use_cross_timestep=i % 3 != 0,
                             output_type="pt", seed=i))
    return requests


@pytest.mark.parametrize("config", list(CONFIGS))
def test_requests_of_different_frame_counts_and_sizes_pack_and_equal_their_solo_runs(config):
    pipe = ltx2_pipe(config)
    assert program_for(pipe) is generic.plan_generic
    requests = _requests(SIZES)
    expected = [pipe(**seeded(kwargs)) for kwargs in requests]
    with StepBatched(pipe, max_batch_size=8) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    video = [max_diff(got.frames, want.frames) for got, want in zip(results, expected)]
    audio = [max_diff(got.audio, want.audio) for got, want in zip(results, expected)]
    assert max(video + audio) <= TOLERANCE, (video, audio)
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]


def test_image_to_video_requests_with_per_token_timesteps_pack_and_equal_their_solo_runs():
    from diffusers import LTX2ImageToVideoPipeline

    pipe = LTX2ImageToVideoPipeline(**ltx2_pipe("ltx2-split").components)
    pipe.set_progress_bar_config(disable=True)
    images = [torch.rand(1, 3, height, width, generator=torch.Generator().manual_seed(i))
              for i, (height, width, _) in enumerate(SIZES[:4])]
    # NOTE: image_crf=0: re-compression needs PIL images; tensors are the images here
    requests = [dict(kwargs, image_crf=0, image=image) for kwargs, image in zip(_requests(SIZES[:4]), images)]
    expected = [pipe(**seeded(kwargs)) for kwargs in requests]
    with StepBatched(pipe, max_batch_size=8) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    assert max(max(max_diff(got.frames, want.frames), max_diff(got.audio, want.audio))
               for got, want in zip(results, expected)) <= TOLERANCE
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]


def test_the_pipelines_default_guidance_terms_stay_exact_beside_packing():
    # NOTE: CFG, STG at a real block, modality-isolation guidance and rescaling: the STG calls don't pack (their
    # perturbation is not reproduced), the isolated-modality calls pack among themselves
    pipe = ltx2_pipe("ltx2-23")
    requests = [dict(prompt="a robot " * (i + 1), height=height, width=width, num_frames=frames, frame_rate=25.0,
                     num_inference_steps=2, spatio_temporal_guidance_blocks=[1], max_sequence_length=16,
                     output_type="pt", seed=i) for i, (height, width, frames) in enumerate(SIZES[:3])]
    expected = [pipe(**seeded(kwargs)) for kwargs in requests]
    with StepBatched(pipe, max_batch_size=8) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    assert max(max(max_diff(got.frames, want.frames), max_diff(got.audio, want.audio))
               for got, want in zip(results, expected)) <= TOLERANCE
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]


def test_requests_of_equal_size_merge_by_rows_and_equal_their_solo_runs():
    pipe = ltx2_pipe("ltx2-split")
    requests = [dict(kwargs, height=32, width=32, num_frames=5, max_sequence_length=16, use_cross_timestep=True)
                for kwargs in _requests(SIZES[:4])]
    expected = [pipe(**seeded(kwargs)) for kwargs in requests]
    with StepBatched(pipe, max_batch_size=8) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    assert max(max(max_diff(got.frames, want.frames), max_diff(got.audio, want.audio))
               for got, want in zip(results, expected)) <= TOLERANCE
    assert max(stats["rows_histogram"]["denoise"]) > 2, stats["rows_histogram"]
    assert stats["mixed"]["calls"] == 0


def test_an_other_attention_processor_keeps_sizes_apart_and_exact():
    class OwnProcessor(LTX2AudioVideoAttnProcessor):  # a custom processor: a packed call would bypass it
        pass

    pipe = ltx2_pipe("ltx2-split")
    requests = _requests(SIZES[:3])
    expected = [pipe(**seeded(kwargs)) for kwargs in requests]
    pipe.transformer.set_attn_processor(OwnProcessor())
    try:
        assert "OwnProcessor" in ltx2_packing_unsupported(pipe.transformer)
        with StepBatched(pipe, max_batch_size=8) as sb:
            results = submit_all(sb, requests)
            stats = sb.stats()
    finally:
        pipe.transformer.set_attn_processor(LTX2AudioVideoAttnProcessor())
    assert max(max(max_diff(got.frames, want.frames), max_diff(got.audio, want.audio))
               for got, want in zip(results, expected)) <= TOLERANCE
    assert stats["mixed"]["calls"] == 0


# ---------------------------------------------------------------------------------------------------------------
# The packed forward against the model's own forward, call by call.

def ltx2_call(model, rows, grid, audio_frames, text_length, seed, valid=None, coords=True, fps=25.0, per_token=False,
          cross_timestep=True):
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = grid
    timestep = torch.rand(rows, generator=generator) * 1000
    video_timestep = timestep
    if per_token:  # NOTE: as image-to-video conditions its first frame: timestep 0 on its tokens
        video_timestep = timestep[:, None].repeat(1, frames * height * width)
        video_timestep[:, :height * width] = 0.0
    mask = torch.ones(rows, text_length, dtype=torch.long)
    for r, length in enumerate(valid or []):
        mask[r, :text_length - length] = 0  # NOTE: left padding, as Gemma's tokenizer pads
    call = dict(hidden_states=torch.randn(rows, frames * height * width, 4, generator=generator),
                audio_hidden_states=torch.randn(rows, audio_frames, 4, generator=generator),
                encoder_hidden_states=torch.randn(rows, text_length, 32, generator=generator),
                audio_encoder_hidden_states=torch.randn(rows, text_length, 32, generator=generator),
                timestep=video_timestep, sigma=timestep, audio_timestep=torch.rand(rows, generator=generator) * 1000,
                encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=frames, height=height,
                width=width, fps=fps, audio_num_frames=audio_frames, use_cross_timestep=cross_timestep,
                return_dict=False)
    if coords:
        call["video_coords"] = model.rope.prepare_video_coords(rows, frames, height, width, "cpu", fps=fps)
        call["audio_coords"] = model.audio_rope.prepare_audio_coords(rows, audio_frames, "cpu")
    return call


def _check_per_row_adapters(model, calls, forward, sets=ROW_ADAPTERS):
    """`forward(row_adapters)` (one output pair per call) equals each row's plain forward after set_adapters."""
    counts = [call["hidden_states"].shape[0] for call in calls]
    row_adapters = [sets[r % len(sets)] for r in range(sum(counts))]
    with torch.no_grad():
        outputs = forward(row_adapters)
        first = 0
        for call, count, output in zip(calls, counts, outputs):
            for r in range(count):
                one = call_row(call, r, count)
                want = with_adapters(model, row_adapters[first + r], model, **one)
                for got, expected in zip(output, want):  # video, then audio
                    assert max_diff(got[r:r + 1], expected) <= TOLERANCE, (first + r, row_adapters[first + r])
                if first + r == 0:  # the adapters change the row
                    assert max_diff(want[0], with_adapters(model, {}, model, **one)[0]) > 1e-3
            first += count


def test_plain_forward_with_per_token_timesteps_maps_their_embeddings_to_rows():
    """The model's own forward flattens per-token video timesteps ([rows * tokens]) before embedding them: the
    model layer's token rows map them to their rows."""
    from diffusers_stepbatch.adapters.lora import per_row_lora
    from diffusers_stepbatch.testing import add_random_lora_adapters

    model = tiny_ltx2_transformer(CONFIGS["ltx2-split"])
    add_random_lora_adapters(model)
    call = ltx2_call(model, 3, (2, 2, 2), 5, 16, 0, per_token=True)
    (streams,) = support_for(model).lora_token_rows(call)
    assert streams.tolist() == [r for r in range(3) for _ in range(8)]

    def plain(row_adapters):
        with per_row_lora(model, row_adapters, token_rows=[streams]):
            return [model(**call)]

    _check_per_row_adapters(model, [call], plain)


def test_calls_the_packed_forward_does_not_reproduce_have_no_pack_key():
    model = tiny_ltx2_transformer()
    call = ltx2_call(model, 2, (1, 2, 2), 3, 8, 0)
    assert pack_key(dict(call, spatio_temporal_guidance_blocks=[])) is not None
    assert pack_key(dict(call, spatio_temporal_guidance_blocks=[0])) is None  # STG perturbs self-attention
    assert pack_key(dict(call, video_self_attention_mask=torch.ones(2, 4, 4))) is None
    assert pack_key(dict(call, timestep=torch.rand(2, 4))) is not None  # per video token, audio's own per row
    assert pack_key(dict(call, timestep=torch.rand(2, 4), audio_timestep=None)) is None  # audio by video's tokens
    assert pack_key(dict(call, timestep=torch.rand(2, 3))) is None
    assert pack_key(dict(call, attention_kwargs={"other": 1})) is None
    assert pack_key(dict(call, attention_kwargs={"scale": 1.0})) is not None
    assert support_for(model).packing is not None and support_for(model).trusted
