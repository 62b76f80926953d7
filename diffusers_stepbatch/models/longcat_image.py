"""LongCat-Image and LongCat-Image-Edit (`LongCatImageTransformer2DModel`).

As FLUX.1's, its position ids `img_ids` / `txt_ids` are 2-D `[tokens, 3]` tensors the model reads once for the whole
call, never per row. The default rule takes a tensor whose dim 0 equals the call's rows for a row input, so a
1-token image in a 1-row call would have its ids concatenated across the merged requests: they are shared instead,
and calls merge only where they are equal (one image size; the pipelines pad text to one length).
"""

from __future__ import annotations

from diffusers import LongCatImageTransformer2DModel

from . import ModelSupport, register_model


@register_model(LongCatImageTransformer2DModel)
def _longcat_image() -> ModelSupport:
    return ModelSupport(shared=("img_ids", "txt_ids"), trusted=True)
