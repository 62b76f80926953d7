"""Why HunyuanVideo 1.5 runs on rank 0 alone under context parallelism (diffusers 0.42.1 gives it no plan).

Its attention builds a square query-by-key mask from the tokens it holds (`mask.view(b, 1, 1, n) & its
transpose`); with the sequence split, each rank would build the mask of its own share only, which Ulysses can't
gather into the whole sequence's (it gathers masks along the keys, not the queries).
"""

from __future__ import annotations

SQUARE_MASK = ("HunyuanVideo15Transformer3DModel's attention builds a query-by-key mask from the tokens a rank "
               "holds, which the split sequence can't gather (diffusers 0.42.1)")


def hunyuan_video15_context_parallel_plan(model) -> str:
    return SQUARE_MASK
