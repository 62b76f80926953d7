"""Z-Image's TeaCache forward: `ZImageTransformer2DModel.forward` with one skip decision per request branch.

The signal is the first main layer's modulated input (`attention_norm1(x) * (1 + scale_msa)`) over the unified
sequence (image then caption tokens); a skipping row adds its cached residual of the main layers. The forward pads
rows of several sizes to the longest, so a request's signal and residual are kept as its rows' own tokens only
(padding dropped): the same whatever it shares a call with. Z-Image runs both CFG rows in one call, so a state
covers its request's rows; when the rows change (`cfg_truncation` ends CFG) that step computes.

The rescale polynomial was fitted with `models/flux/teacache.py`'s `fit_coefficients` (signal `z_image_signal`)
on the tiny test model (`testing.image_models.tiny_z_image_pipeline()`, prompts "a red circle", "a blue square",
"a green cross", 32x32, 16 steps, guidance 3, negative prompt "bad", degree 4): no Z-Image weights were at hand, so
fit the real model's polynomial the same way before relying on the default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.utils import apply_lora_scale

from ...adapters.lora import row_subset
from ...cache.teacache import TeaCacheState
from ...cache.teacache_rows import commit_rows, computing_rows, decide_rows
from ..packing.support import reproduces_call

Z_IMAGE_COEFFICIENTS = (5.72123062e04, -3.50883175e04, 8.02204162e03, -8.07866363e02, 3.04659687e01)

# the forward's arguments the TeaCache forward reproduces; a call with any other (ControlNet residuals, omni
# mode's SigLIP features and noise masks) computes every step
_REPRODUCED = frozenset({"x", "t", "cap_feats", "return_dict", "patch_size", "f_patch_size",
                         "joint_attention_kwargs"})


def teacache_call(transformer, states: Sequence[TeaCacheState | None], arguments: dict) -> Any:
    """A `ZImageTransformer2DModel` call (its arguments by name) with per-row TeaCache decisions, as the model
    returns it; None when the call has arguments this forward doesn't reproduce."""
    if not reproduces_call(arguments, _REPRODUCED, "joint_attention_kwargs") or isinstance(arguments["x"][0], list):
        return None
    output = _forward(transformer, states, arguments["x"], arguments["t"], arguments["cap_feats"],
                      arguments.get("patch_size", 2), arguments.get("f_patch_size", 1),
                      joint_attention_kwargs=arguments.get("joint_attention_kwargs"))
    return (output,) if not arguments.get("return_dict", True) else Transformer2DModelOutput(sample=output)


def z_image_signal(layer, unified: torch.Tensor, adaln_input: torch.Tensor) -> torch.Tensor:
    """The TeaCache signal: the first main layer's modulated attention input, [rows, tokens, dim]."""
    scale_msa = layer.adaLN_modulation(adaln_input).unsqueeze(1).chunk(4, dim=2)[0]
    return layer.attention_norm1(unified) * (1.0 + scale_msa)


def signal_hook(transformer, record: Callable[[torch.Tensor], None]):
    """`fit_coefficients`' `signal=` for Z-Image: records `z_image_signal` at the first main layer."""
    def hook(layer, args):
        record(z_image_signal(layer, args[0], args[3]))

    return transformer.layers[0].register_forward_pre_hook(hook)


@apply_lora_scale("joint_attention_kwargs")
def _forward(model, states, x, t, cap_feats, patch_size, f_patch_size, joint_attention_kwargs=None):
    # NOTE: the steps before the main layers mirror ZImageTransformer2DModel.forward (basic mode) call for call,
    # so with every row computing the output is the model's own (tested).
    device = x[0].device
    adaln_input = model.t_embedder(t * model.t_scale).type_as(x[0])
    x, cap_feats, x_size, x_pos_ids, cap_pos_ids, x_pad_mask, cap_pad_mask = model.patchify_and_embed(
        x, cap_feats, patch_size, f_patch_size)
    x_seqlens = [len(xi) for xi in x]
    x = model.all_x_embedder[f"{patch_size}-{f_patch_size}"](torch.cat(x, dim=0))
    x, x_freqs, x_mask, _, _ = model._prepare_sequence(list(x.split(x_seqlens, dim=0)), x_pos_ids, x_pad_mask,
                                                       model.x_pad_token, None, device)
    for layer in model.noise_refiner:
        x = layer(x, x_mask, x_freqs, adaln_input, None, None, None)
    cap_seqlens = [len(ci) for ci in cap_feats]
    cap_feats = model.cap_embedder(torch.cat(cap_feats, dim=0))
    cap_feats, cap_freqs, cap_mask, _, _ = model._prepare_sequence(
        list(cap_feats.split(cap_seqlens, dim=0)), cap_pos_ids, cap_pad_mask, model.cap_pad_token, None, device)
    for layer in model.context_refiner:
        cap_feats = layer(cap_feats, cap_mask, cap_freqs)
    unified, freqs, mask, _ = model._build_unified_sequence(
        x, x_freqs, x_seqlens, None, cap_feats, cap_freqs, cap_seqlens, None, None, None, None, None, False, device)
    lengths = [a + b for a, b in zip(x_seqlens, cap_seqlens)]

    signal = z_image_signal(model.layers[0], unified, adaln_input)
    decisions = decide_rows(states, lambda rows: _own_tokens(signal, lengths, rows))
    compute_rows = computing_rows(decisions)

    out, residual = unified, None
    if compute_rows:
        if len(compute_rows) == len(lengths):
            computed = _layers(model, unified, mask, freqs, adaln_input)
            out, residual = computed, computed - unified
        else:
            index = torch.tensor(compute_rows, device=device)
            longest = max(lengths[r] for r in compute_rows)  # NOTE: padded to their longest, as run on their own
            sub_mask = None if all(lengths[r] == longest for r in compute_rows) else mask[index, :longest]
            sub_input = unified[index, :longest]
            with row_subset(model, compute_rows):  # NOTE: per-row LoRA: these rows' own adapters
                computed = _layers(model, sub_input, sub_mask, freqs[index, :longest], adaln_input[index])
            out, residual = unified.clone(), torch.zeros_like(unified)
            out[index, :longest] = computed
            residual[index, :longest] = computed - sub_input
    if len(compute_rows) < len(lengths):
        out = out.clone() if out is unified else out
        for decision in decisions:
            if not decision.compute:
                cached = decision.state.residual.split([lengths[row] for row in decision.rows])
                for row, row_residual in zip(decision.rows, cached):
                    out[row, :lengths[row]] = unified[row, :lengths[row]] + row_residual

    out = model.all_final_layer[f"{patch_size}-{f_patch_size}"](out, c=adaln_input)
    output = model.unpatchify(list(out.unbind(dim=0)), x_size, patch_size, f_patch_size, None)

    commit_rows(decisions, lambda decision: _own_tokens(residual, lengths, decision.rows))
    return output


def _layers(model, unified, mask, freqs, adaln_input):
    for layer in model.layers:
        unified = layer(unified, mask, freqs, adaln_input, None, None, None)
    return unified


def _own_tokens(batch: torch.Tensor, lengths: Sequence[int], rows: range) -> torch.Tensor:
    """`rows` of a padded [rows, tokens, dim] batch as their own tokens only, [their tokens, dim]."""
    return torch.cat([batch[row, :lengths[row]] for row in rows])
