"""AnyFlow FAR's calls carry a per-request KV cache written in place: they run alone by rule, named in
`stats()["splits"]`, and equal their plain runs (a merged call used to raise inside the attention processor)."""

import functools

import pytest
import torch

from diffusers_stepbatch.testing import tiny_t5_encoder, tiny_t5_tokenizer
from diffusers_stepbatch.toy.video import tiny_wan_vae

from .references import TOLERANCE, max_diff, plain_and_wrapped, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@functools.lru_cache(maxsize=None)
def _pipe(head_dim: int):
    from diffusers import AnyFlowFARPipeline, AnyFlowFARTransformer3DModel, FlowMapEulerDiscreteScheduler

    tokenizer = tiny_t5_tokenizer()
    torch.manual_seed(0)
    transformer = AnyFlowFARTransformer3DModel(
        patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=3, num_attention_heads=2,
        attention_head_dim=head_dim, in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
        num_layers=2, cross_attn_norm=True, rope_max_seq_len=32, gate_value=0.25, deltatime_type="r",
        chunk_partition=(1, 1, 1)).eval()
    pipe = AnyFlowFARPipeline(transformer=transformer, vae=tiny_wan_vae(), text_encoder=tiny_t5_encoder(tokenizer),
                              tokenizer=tokenizer,
                              scheduler=FlowMapEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("head_dim", [12, 24])
def test_kv_cache_calls_run_alone_by_rule_and_equal_plain_runs(head_dim):
    pipe = _pipe(head_dim)
    requests = [dict(prompt=prompt, negative_prompt="bad", num_inference_steps=2 + i % 2, guidance_scale=6.0 - i,
                     height=16, width=16, num_frames=9, max_sequence_length=16, output_type="pt", seed=i)
                for i, prompt in enumerate(("a cat", "a dog", "an owl"))]
    runs = plain_and_wrapped(pipe, requests)
    splits = runs.stats["splits"]
    assert max(max_diff(got.frames, want.frames) for got, want in zip(runs.wrapped, runs.plain)) <= TOLERANCE
    assert any("KV cache is preallocated per request" in reason for reason in splits), splits
    assert not any("raised" in reason for reason in splits), splits
