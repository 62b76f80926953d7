"""LTX-2's context-parallel plan, for both RoPE layouts, and the one mask it must narrow under Ulysses.

diffusers 0.42.1's `_cp_plan` splits the video RoPE as [batch, tokens, dim] (the interleaved layout); the split
layout (LTX-2's own checkpoints) returns [batch, heads, tokens, dim / 2], which that plan leaves whole. The video
tokens' cross-modal RoPE (`cross_attn_rope`) is split too, since the audio-video attention's video side is.
The attention processor widens its mask to every head (`view(batch, heads, 1, keys)`, one mask repeated), and
Ulysses hands each rank a share of the heads: under context parallelism the mask goes to attention as one head,
which broadcasts over the rank's share (`narrow_masks_to_one_head`).
"""

from __future__ import annotations

import functools

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput


def ltx2_context_parallel_plan(model) -> dict:
    narrow_masks_to_one_head()
    split = model.config.rope_type == "split"
    rope = ContextParallelInput(split_dim=2 if split else 1, expected_dims=4 if split else 3, split_output=True)
    return {
        "": {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
            "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
            "encoder_attention_mask": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False),
        },
        "rope": {0: rope, 1: rope},
        "cross_attn_rope": {0: rope, 1: rope},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


@functools.cache
def narrow_masks_to_one_head() -> None:
    """Route the LTX-2 processors' attention through `_one_head_mask`; calls without context parallelism are
    unchanged. Patched once per process, in diffusers' LTX-2 module only (its processors' `dispatch_attention_fn`)."""
    from diffusers.models.transformers import transformer_ltx2

    transformer_ltx2.dispatch_attention_fn = functools.partial(_one_head_mask, transformer_ltx2.dispatch_attention_fn)


def _one_head_mask(dispatch, query, key, value, attn_mask=None, **kwargs):
    if kwargs.get("parallel_config") is not None and attn_mask is not None and attn_mask.dim() == 4:
        attn_mask = attn_mask[:, :1]  # NOTE: the processor repeats one mask over the heads
    return dispatch(query, key, value, attn_mask=attn_mask, **kwargs)
