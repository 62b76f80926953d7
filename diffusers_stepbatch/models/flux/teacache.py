"""FLUX.1's TeaCache forward: `FluxTransformer2DModel.forward` with one skip decision per request branch.

The rescale polynomial maps the signal's relative L1 change to the model output's, highest power first
(numpy.poly1d order); fitted on FLUX.1-dev by the TeaCache authors (TeaCache4FLUX in
github.com/ali-vilab/TeaCache); FLUX.1-schnell shares the architecture.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.utils import apply_lora_scale

from ...adapters.lora import row_subset
from ...cache.teacache import TeaCacheState, relative_l1, row_groups
from ..packing.support import reproduces_call
from .packing import REPRODUCED_ARGUMENTS, text_image_rotary

FLUX_COEFFICIENTS = (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01)


def teacache_call(transformer, states: Sequence[TeaCacheState | None], arguments: dict) -> Any:
    """A `FluxTransformer2DModel` call (its arguments by name) with per-row TeaCache decisions, as the model
    returns it; None when the call has arguments this forward doesn't reproduce (ControlNet residuals, ...)."""
    if not reproduces_call(arguments, REPRODUCED_ARGUMENTS, "joint_attention_kwargs"):
        return None  # NOTE: e.g. IP-Adapter image embeddings, which the model's own forward turns into tokens
    ids = {name: arguments[name][0] if arguments[name].ndim == 3 else arguments[name]
           for name in ("txt_ids", "img_ids")}
    output = flux_teacache_forward(
        transformer, states, arguments["hidden_states"], arguments["encoder_hidden_states"],
        arguments["pooled_projections"], arguments["timestep"], ids["img_ids"], ids["txt_ids"],
        arguments.get("guidance"), arguments.get("joint_attention_kwargs"))
    return (output,) if not arguments.get("return_dict", True) else Transformer2DModelOutput(sample=output)


def flux_teacache_forward(
    transformer: Any,
    states: Sequence[TeaCacheState | None],
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    pooled_projections: torch.Tensor,
    timestep: torch.Tensor,
    img_ids: torch.Tensor,
    txt_ids: torch.Tensor,
    guidance: torch.Tensor | None = None,
    joint_attention_kwargs: dict | None = None,
) -> torch.Tensor:
    """`FluxTransformer2DModel.forward` (return_dict=False, [0]) with per-row TeaCache decisions.

    `states[r]` is row r's state (rows of one request branch share one object) or None (always compute).
    Rows whose state decides to compute run the blocks as one sub-batch; the others add their residual.
    The state changes only after the forward succeeded, so a failed batch retried row by row stays correct.
    """
    return _forward(
        transformer, states, hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
        pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids, txt_ids=txt_ids,
        guidance=guidance, joint_attention_kwargs=joint_attention_kwargs,
    )


@apply_lora_scale("joint_attention_kwargs")
def _forward(transformer, states, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids,
             txt_ids, guidance, joint_attention_kwargs):
    # NOTE: the embeddings mirror FluxTransformer2DModel.forward op for op, so with every row computing the
    # output is bit-identical to the model's own forward (tested).
    hidden = transformer.x_embedder(hidden_states)
    timestep = timestep.to(hidden.dtype) * 1000
    if guidance is not None:
        guidance = guidance.to(hidden.dtype) * 1000
        temb = transformer.time_text_embed(timestep, guidance, pooled_projections)
    else:
        temb = transformer.time_text_embed(timestep, pooled_projections)
    encoder = transformer.context_embedder(encoder_hidden_states)
    rotary = text_image_rotary(transformer, txt_ids, img_ids)
    signal = transformer.transformer_blocks[0].norm1(hidden, emb=temb)[0]

    out, commit = per_row_blocks(transformer, states, hidden, signal, functools.partial(
        _blocks, transformer, encoder=encoder, temb=temb, rotary=rotary, joint_attention_kwargs=joint_attention_kwargs))
    output = transformer.proj_out(transformer.norm_out(out, temb))
    commit()
    return output


def per_row_blocks(transformer, states, hidden: torch.Tensor, signal: torch.Tensor,
                   blocks: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    """The blocks for the rows whose TeaCache state decides on `signal` to compute (`blocks(hidden, rows=index)`,
    index None: every row), each with its own per-request LoRA; skipping rows add their cached residual. Returns
    (every row's output, commit): call commit once the forward succeeded."""
    decisions = []  # (state, start, end, compute, accumulated)
    for state, start, end in row_groups(states):
        compute, accumulated = (True, 0.0) if state is None else state.decide(signal[start:end])
        decisions.append((state, start, end, compute, accumulated))
    compute_rows = [r for _, start, end, compute, _ in decisions if compute for r in range(start, end)]

    if len(compute_rows) == hidden.shape[0]:
        out = blocks(hidden, rows=None)
        residual = out - hidden
    else:
        out = torch.empty_like(hidden)
        residual = None
        if compute_rows:
            index = torch.tensor(compute_rows, device=hidden.device)
            with row_subset(transformer, compute_rows):  # NOTE: per-row LoRA: these rows' own adapters
                sub = blocks(hidden[index], rows=index)
            out[index] = sub
            residual = torch.empty_like(hidden)
            residual[index] = sub - hidden[index]
        for state, start, end, compute, _ in decisions:
            if not compute:
                out[start:end] = hidden[start:end] + state.residual

    def commit() -> None:
        for state, start, end, compute, accumulated in decisions:
            if state is not None:
                residual_rows = _own(residual, start, end) if compute else None
                state.commit(_own(signal, start, end), compute, accumulated, residual_rows)

    return out, commit


def _own(batch: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) that don't keep the rest of the batch alive."""
    return batch if (start, end) == (0, batch.shape[0]) else batch[start:end].clone()


def _blocks(transformer, hidden, rows, encoder, temb, rotary, joint_attention_kwargs):
    if rows is not None:
        encoder, temb = encoder[rows], temb[rows]
    for block in transformer.transformer_blocks:
        encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                image_rotary_emb=rotary, joint_attention_kwargs=joint_attention_kwargs)
    for block in transformer.single_transformer_blocks:
        encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                image_rotary_emb=rotary, joint_attention_kwargs=joint_attention_kwargs)
    return hidden


def fit_coefficients(
    pipe: Any, prompts: Sequence[str], degree: int = 4, seed: int = 0, signal: Callable | None = None,
    **call_kwargs: Any
) -> tuple[float, ...]:
    """Fit a rescale polynomial for `pipe`'s Flux transformer, as the TeaCache authors did for FLUX.1-dev.

    Runs `pipe` (unwrapped, every step computed) on `prompts` and fits, over consecutive steps of each CFG
    branch, the model output's relative L1 change against the signal's; prompt i is sampled with seed
    `seed + i` unless `call_kwargs` holds a generator. Pass the result as
    `TeaCacheConfig(coefficients=...)` for a model whose statistics differ from FLUX.1-dev's. Another model's
    TeaCache passes its own `signal(transformer, record)`: a hook that calls `record(tensor)` with each forward's
    signal, returned as a removable handle (e.g. `models/z_image/teacache.py`'s `signal_hook`).

    >>> coefficients = fit_coefficients(pipe, ["a cat", "a red square"], num_inference_steps=28)
    >>> sb = StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.4, coefficients=coefficients))
    """
    import numpy as np

    xs, ys = sampled_change_pairs(pipe, prompts, seed, signal, **call_kwargs)
    if len(xs) <= degree:
        raise ValueError(f"{len(xs)} step pairs cannot fit a degree-{degree} polynomial; use more prompts or steps")
    return tuple(float(c) for c in np.polyfit(xs, ys, degree))


def sampled_change_pairs(pipe: Any, prompts: Sequence[str], seed: int = 0, signal: Callable | None = None,
                         **call_kwargs: Any) -> tuple[list[float], list[float]]:
    """`change_pairs` of one run per prompt, pooled; prompt i sampled with seed `seed + i` unless `call_kwargs`
    holds a generator."""
    xs, ys = [], []
    for index, prompt in enumerate(prompts):
        generator = call_kwargs.get("generator") or torch.Generator().manual_seed(seed + index)
        changes = change_pairs(pipe, prompt, signal, **{**call_kwargs, "generator": generator})
        xs.extend(changes[0])
        ys.extend(changes[1])
    return xs, ys


def change_pairs(pipe: Any, prompt: str, signal: Callable | None = None,
                 **call_kwargs: Any) -> tuple[list[float], list[float]]:
    """The points `fit_coefficients` fits, from one run of `pipe` on `prompt` (unwrapped, every step computed):
    over consecutive steps of each CFG branch, the signal's relative L1 change and the model output's."""
    transformer = pipe.transformer
    signals, outputs = [], []
    hooks = [
        (signal or _flux_signal)(transformer, lambda tensor: signals.append(tensor.detach().double())),
        transformer.register_forward_hook(
            lambda module, args, out: outputs.append(_sample(out[0] if isinstance(out, tuple) else out.sample))),
    ]
    try:
        with torch.no_grad():
            pipe(prompt=prompt, **call_kwargs)  # NOTE: FLUX.2 takes `image` first
    finally:
        for hook in hooks:
            hook.remove()
    steps = call_kwargs.get("num_inference_steps") or len(outputs)
    branches = max(len(outputs) // steps, 1)  # true CFG calls the transformer twice per step
    xs, ys = [], []
    for i in range(branches, len(outputs)):
        if outputs[i].shape != outputs[i - branches].shape:
            continue  # NOTE: a step whose call returns other tokens (a KV cache's filling call): no pair
        xs.append(relative_l1(signals[i], signals[i - branches]))
        ys.append(relative_l1(outputs[i], outputs[i - branches]))
    return xs, ys


def _flux_signal(transformer, record):
    return transformer.transformer_blocks[0].norm1.register_forward_hook(lambda module, args, out: record(out[0]))


def _sample(sample) -> torch.Tensor:
    # NOTE: models that take one entry per image (Z-Image) return a list of them
    if isinstance(sample, (list, tuple)):
        return torch.cat([entry.detach().double().flatten() for entry in sample])
    return sample.detach().double()
