"""Why LTX-2 runs on rank 0 alone under context parallelism (diffusers 0.42.1).

Its attention processor widens an attention mask to every head (`view(batch, heads, 1, keys)`) before the
attention dispatch; Ulysses hands each rank a share of the heads, so the mask no longer fits the queries (the
text cross-attention always has a mask). diffusers' own `_cp_plan` for the class fails the same way with either
RoPE layout; its split RoPE layout ([batch, heads, tokens, dim / 2]) is also left whole by that plan.
"""

from __future__ import annotations

MASK_PER_HEAD = ("LTX2VideoTransformer3DModel's attention widens its text mask to every head, and Ulysses gives "
                 "each rank a share of the heads (diffusers 0.42.1)")


def ltx2_context_parallel_plan(model) -> str:
    return MASK_PER_HEAD
