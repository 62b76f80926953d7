"""HunyuanVideo 1.5's context-parallel plan (diffusers 0.42.1 gives the class none), in diffusers' plan form.

The first block splits the video and the joined text tokens, every block the text mask it is handed, and the
rotary tables are split where they are made; `proj_out` gathers the video tokens. Its attention builds a square
query-by-key mask from the tokens a rank holds, which Ulysses can't gather; since queries and keys are the same
tokens, a key is valid where its own row is, so under context parallelism the mask goes to attention as its
diagonal (one row of keys), which Ulysses gathers. Only the outputs of masked (padding) text tokens change, and
no valid token reads those (they are masked keys; the video tokens are the output).
"""

from __future__ import annotations

import functools

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
_ROPE = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)


def hunyuan_video15_context_parallel_plan(model) -> dict:
    keys_from_square_masks()
    return {
        "transformer_blocks.0": {"hidden_states": _TOKENS, "encoder_hidden_states": _TOKENS},
        "transformer_blocks.*": {"attention_mask": ContextParallelInput(split_dim=1, expected_dims=2,
                                                                        split_output=False)},
        "rope": {0: _ROPE, 1: _ROPE},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


@functools.cache
def keys_from_square_masks() -> None:
    """Route the HunyuanVideo 1.5 processors' attention through `_key_mask`; calls without context parallelism are
    unchanged. Patched once per process, in diffusers' HunyuanVideo 1.5 module only."""
    from diffusers.models.transformers import transformer_hunyuan_video15 as module

    module.dispatch_attention_fn = functools.partial(_key_mask, module.dispatch_attention_fn)


def _key_mask(dispatch, query, key, value, attn_mask=None, **kwargs):
    if kwargs.get("parallel_config") is not None and attn_mask is not None and attn_mask.dim() == 4 \
            and attn_mask.shape[-2] == attn_mask.shape[-1] > 1:
        attn_mask = attn_mask.diagonal(dim1=-2, dim2=-1).unsqueeze(-2)
    return dispatch(query, key, value, attn_mask=attn_mask, **kwargs)
