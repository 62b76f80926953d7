"""TeaCache with one decision per request and CFG branch, inside merged batches.

TeaCache (Liu et al., 2024) reuses the transformer blocks' residual of an earlier step while the cheap signal
barely moves: the first block's modulated input (norm1 of the embedded image tokens under the step's
timestep embedding). Its relative L1 change since the previous step goes through a per-family rescale
polynomial and accumulates; while the sum stays below the threshold the blocks are skipped and the cached
residual is added, once it crosses the threshold the blocks run and the sum restarts. The first and last
steps always run.

Public implementations keep one such state per model and take one decision for the whole batch. Here a
`TeaCacheState` lives in the request, one per CFG branch, and `flux_teacache_forward` decides per state:
rows that skip never enter the blocks, rows that compute run them together. A request therefore gets the
same steps skipped whether it ran alone or in a batch.

>>> sb = StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.4))
>>> image = sb("a cat", num_inference_steps=28).images[0]
>>> exact = sb("a cat", num_inference_steps=28, teacache=None).images[0]   # per-request override
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.utils import apply_lora_scale

from ..engine.host_sync import host_float

# NOTE: the rescale polynomials map the signal's relative L1 change to the model output's, highest power
# first (numpy.poly1d order). FLUX: fitted on FLUX.1-dev by the TeaCache authors, published in
# TeaCache4FLUX/teacache_flux.py of github.com/ali-vilab/TeaCache; FLUX.1-schnell shares the architecture.
FLUX_COEFFICIENTS = (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01)
COEFFICIENTS = {"flux": FLUX_COEFFICIENTS}

FEW_STEPS = 8  # at or below this many steps every step is a turning point: TeaCache would only harm


@dataclass
class TeaCacheConfig:
    """TeaCache settings for a `StepBatched` engine, or for one request (`teacache=` call argument).

    Args:
        threshold: accumulated rescaled change below which a step reuses the cached residual. 0 never skips;
            on FLUX.1-dev 0.25, 0.4, 0.6 and 0.8 give about 1.5x, 1.8x, 2.0x and 2.25x (TeaCache4FLUX).
        coefficients: rescale polynomial, highest power first; None takes the family's (see `COEFFICIENTS`).
        min_steps: requests with fewer denoising steps run without TeaCache (and a warning, once per config).
    """

    threshold: float = 0.4
    coefficients: tuple[float, ...] | None = None
    min_steps: int = FEW_STEPS + 1
    _warned: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or self.threshold < 0:
            raise ValueError(f"threshold={self.threshold!r} must be a number >= 0 (0 never skips a step)")
        if self.coefficients is not None:
            self.coefficients = tuple(float(c) for c in self.coefficients)
            if not self.coefficients:
                raise ValueError("coefficients=() must hold at least one value (highest power first)")
        if isinstance(self.min_steps, bool) or not isinstance(self.min_steps, int) or self.min_steps < 3:
            raise ValueError(f"min_steps={self.min_steps!r} must be an int >= 3 (first and last steps always run)")

    def states(self, family: str, num_steps: int, branches: int) -> list[TeaCacheState] | None:
        """Fresh per-branch states for one request, or None when TeaCache must not run for it."""
        if num_steps < self.min_steps:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"TeaCache is off for requests with num_inference_steps={num_steps} < min_steps={self.min_steps}: "
                    "on few-step models every step changes the image and reusing a residual only harms",
                    UserWarning, stacklevel=4,
                )
            return None
        coefficients = self.coefficients or COEFFICIENTS.get(family)
        if coefficients is None:
            raise ValueError(f"TeaCache has no rescale coefficients for family {family!r}; pass coefficients=")
        return [TeaCacheState(float(self.threshold), coefficients, num_steps) for _ in range(branches)]


@dataclass(eq=False)
class TeaCacheState:
    """One request's TeaCache memory for one CFG branch; the program sets `step` before each forward."""

    threshold: float
    coefficients: tuple[float, ...]
    num_steps: int
    step: int = 0
    accumulated: float = 0.0
    previous_signal: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    computed_steps: int = 0
    skipped_steps: int = 0

    def decide(self, signal: torch.Tensor) -> tuple[bool, float]:
        """(compute?, new accumulated distance) for this step's signal rows; changes nothing."""
        edge = self.step == 0 or self.step >= self.num_steps - 1
        if edge or self.previous_signal is None or self.residual is None:
            return True, 0.0
        accumulated = self.accumulated + _polyval(self.coefficients, _relative_l1(signal, self.previous_signal))
        if accumulated < self.threshold:
            return False, accumulated
        return True, 0.0

    def commit(self, signal: torch.Tensor, compute: bool, accumulated: float, residual: torch.Tensor | None) -> None:
        self.previous_signal = signal
        self.accumulated = accumulated
        if compute:
            self.residual = residual
            self.computed_steps += 1
        else:
            self.skipped_steps += 1


def fit_coefficients(
    pipe: Any, prompts: Sequence[str], degree: int = 4, seed: int = 0, **call_kwargs: Any
) -> tuple[float, ...]:
    """Fit a rescale polynomial for `pipe`'s Flux transformer, as the TeaCache authors did for FLUX.1-dev.

    Runs `pipe` (unwrapped, every step computed) on `prompts` and fits, over consecutive steps of each CFG
    branch, the model output's relative L1 change against the signal's; prompt i is sampled with seed
    `seed + i` unless `call_kwargs` holds a generator. Pass the result as
    `TeaCacheConfig(coefficients=...)` for a model whose statistics differ from FLUX.1-dev's.

    >>> coefficients = fit_coefficients(pipe, ["a cat", "a red square"], num_inference_steps=28)
    >>> sb = StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.4, coefficients=coefficients))
    """
    import numpy as np

    transformer = pipe.transformer
    xs, ys = [], []
    for index, prompt in enumerate(prompts):
        signals, outputs = [], []
        hooks = [
            transformer.transformer_blocks[0].norm1.register_forward_hook(
                lambda module, args, out: signals.append(out[0].detach().double())),
            transformer.register_forward_hook(
                lambda module, args, out: outputs.append((out[0] if isinstance(out, tuple) else out.sample).double())),
        ]
        try:
            with torch.no_grad():
                generator = call_kwargs.get("generator") or torch.Generator().manual_seed(seed + index)
                pipe(prompt, **{**call_kwargs, "generator": generator})
        finally:
            for hook in hooks:
                hook.remove()
        steps = call_kwargs.get("num_inference_steps") or len(outputs)
        branches = max(len(outputs) // steps, 1)  # true CFG calls the transformer twice per step
        for i in range(branches, len(outputs)):
            xs.append(_relative_l1(signals[i], signals[i - branches]))
            ys.append(_relative_l1(outputs[i], outputs[i - branches]))
    if len(xs) <= degree:
        raise ValueError(f"{len(xs)} step pairs cannot fit a degree-{degree} polynomial; use more prompts or steps")
    return tuple(float(c) for c in np.polyfit(xs, ys, degree))


def _relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    # NOTE: the skip decision is made on the host, so this is the step's one device read per request branch.
    return host_float((current - previous).abs().mean() / previous.abs().mean())


def _polyval(coefficients: Sequence[float], x: float) -> float:
    value = 0.0
    for c in coefficients:
        value = value * x + c
    return value


def _row_groups(states: Sequence[TeaCacheState | None]) -> list[tuple[TeaCacheState | None, int, int]]:
    """Consecutive rows sharing one state object, as (state, start, end); a program's rows are contiguous."""
    groups: list[tuple[TeaCacheState | None, int, int]] = []
    for row, state in enumerate(states):
        if groups and groups[-1][0] is state:
            groups[-1] = (state, groups[-1][1], row + 1)
        else:
            groups.append((state, row, row + 1))
    return groups


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
    rotary = transformer.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
    signal = transformer.transformer_blocks[0].norm1(hidden, emb=temb)[0]

    decisions = []  # (state, start, end, compute, accumulated)
    for state, start, end in _row_groups(states):
        compute, accumulated = (True, 0.0) if state is None else state.decide(signal[start:end])
        decisions.append((state, start, end, compute, accumulated))
    compute_rows = [r for _, start, end, compute, _ in decisions if compute for r in range(start, end)]

    if len(compute_rows) == hidden.shape[0]:
        out = _blocks(transformer, hidden, encoder, temb, rotary, joint_attention_kwargs)
        residual = out - hidden
    else:
        out = torch.empty_like(hidden)
        residual = None
        if compute_rows:
            index = torch.tensor(compute_rows, device=hidden.device)
            sub = _blocks(transformer, hidden[index], encoder[index], temb[index], rotary, joint_attention_kwargs)
            out[index] = sub
            residual = torch.empty_like(hidden)
            residual[index] = sub - hidden[index]
        for state, start, end, compute, _ in decisions:
            if not compute:
                out[start:end] = hidden[start:end] + state.residual
    output = transformer.proj_out(transformer.norm_out(out, temb))

    for state, start, end, compute, accumulated in decisions:
        if state is not None:
            residual_rows = _own(residual, start, end) if compute else None
            state.commit(_own(signal, start, end), compute, accumulated, residual_rows)
    return output


def _own(batch: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) that don't keep the rest of the batch alive."""
    return batch if (start, end) == (0, batch.shape[0]) else batch[start:end].clone()


def _blocks(transformer, hidden, encoder, temb, rotary, joint_attention_kwargs):
    for block in transformer.transformer_blocks:
        encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                image_rotary_emb=rotary, joint_attention_kwargs=joint_attention_kwargs)
    for block in transformer.single_transformer_blocks:
        encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                image_rotary_emb=rotary, joint_attention_kwargs=joint_attention_kwargs)
    return hidden
