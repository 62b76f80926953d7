"""RFD4 Proteina's autoencoder (`RFD4ProteinaAutoencoder`).

Partial diffusion encodes the input structure with `encode(..., generator=[g, ...])`: one generator per row, each
drawing that row's latent noise (`randn_tensor` over a list of generators draws row by row), so the list is a row
input and the encodes of requests merge. Everything else the encoder reads (coordinates, masks, the conditioning
dict) has its rows on dim 0.
"""

from __future__ import annotations

from diffusers import RFD4ProteinaAutoencoder

from . import ModelSupport, register_model


@register_model(RFD4ProteinaAutoencoder)
def _rfd4_proteina_autoencoder() -> ModelSupport:
    # NOTE: trusted by the equivalence tests: an untrusted first merge is checked by running the calls apart as
    # well, which would draw from the requests' generators a second time and change their noise
    return ModelSupport(row_lists=("generator",), trusted=True)
