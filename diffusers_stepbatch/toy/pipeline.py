"""The toy pipeline's classes: FLUX pipelines whose T5 input stops at the length the toy model was trained with.

FluxPipeline pads the T5 input to `max_sequence_length` (default 512) and its T5 encoder attends to the
padding, so the embeddings of a caption depend on that length; the toy model saw 16 tokens in training.
Capping the T5 length at the tokenizer's `model_max_length` (16) makes FluxPipeline's defaults draw the
trained picture: `pipe(caption, height=64, width=64)` equals `pipe(caption, ..., max_sequence_length=16)`.
None changes `__call__`, so StepBatched serves `ToyFluxPipeline` with the Flux step program and the edit
pipelines (built from the same components) with the generic one.

>>> pipe = ToyFluxPipeline.from_pretrained(WEIGHTS_DIR)   # what `toy.load_pipeline()` returns
>>> inpaint = ToyFluxInpaintPipeline(**pipe.components)  # the same models, editing a masked region
"""

from __future__ import annotations

from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, FluxPipeline


class T5LengthCap:
    """Caps the T5 length of a FLUX pipeline at `tokenizer_2.model_max_length`."""

    def _get_t5_prompt_embeds(self, prompt=None, num_images_per_prompt=1, max_sequence_length=512, device=None,
                              dtype=None):
        max_sequence_length = min(max_sequence_length, self.tokenizer_2.model_max_length)
        return super()._get_t5_prompt_embeds(prompt, num_images_per_prompt, max_sequence_length, device, dtype)


class ToyFluxPipeline(T5LengthCap, FluxPipeline):
    """FluxPipeline with the T5 length capped at `tokenizer_2.model_max_length`."""


class ToyFluxInpaintPipeline(T5LengthCap, FluxInpaintPipeline):
    """FluxInpaintPipeline with the toy's T5 length cap: repaints the white part of `mask_image`."""


class ToyFluxImg2ImgPipeline(T5LengthCap, FluxImg2ImgPipeline):
    """FluxImg2ImgPipeline with the toy's T5 length cap: redraws `image` from noise level `strength`."""
