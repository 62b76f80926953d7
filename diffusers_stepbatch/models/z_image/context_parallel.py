"""Z-Image's context-parallel plan (diffusers 0.42 gives the class none), in diffusers' plan form.

Three stacks of attention layers each run over a sequence of their own: the noise refiner over the image tokens,
the context refiner over the caption tokens, the main layers over both (`_build_unified_sequence` joins them by
position, so each refiner's output is gathered whole before the join). Each stack's first layer splits its
tokens over the ranks, every layer splits the mask and the rotary table it is handed (the forward passes each
layer the whole ones), and the stack's last layer (or the final layer) gathers the tokens again.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
_PER_LAYER = {"attn_mask": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False),
              "freqs_cis": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)}
_GATHER = ContextParallelOutput(gather_dim=1, expected_dims=3)


def z_image_context_parallel_plan(model) -> dict:
    plan: dict = {}
    for stack in ("noise_refiner", "context_refiner", "layers"):
        last = len(getattr(model, stack)) - 1
        if last == 0:  # NOTE: one key per module: a lone layer splits all three under the wildcard
            plan[f"{stack}.*"] = {"x": _TOKENS, **_PER_LAYER}
        else:
            plan[f"{stack}.0"] = {"x": _TOKENS}
            plan[f"{stack}.*"] = dict(_PER_LAYER)
        if stack != "layers":
            plan[f"{stack}.{last}"] = _GATHER
    for name in model.all_final_layer:
        plan[f"all_final_layer.{name}"] = _GATHER
    return plan
