"""The unCLIP priors (`PriorTransformer`: Kandinsky 2.1 / 2.2 priors, unCLIP, Shap-E).

The pipelines pass one timestep per call (a 0-d tensor or a number) that the model broadcasts over the rows:
as a per-row vector, calls at different timesteps (requests of other step counts) merge. Every other input
(latents, text states and mask, the projected embedding) is per row.
"""

from __future__ import annotations

from diffusers import PriorTransformer

from . import ModelSupport, register_model


@register_model(PriorTransformer)
def _prior_transformer() -> ModelSupport:
    return ModelSupport(timestep_rows=("timestep",), trusted=True)
