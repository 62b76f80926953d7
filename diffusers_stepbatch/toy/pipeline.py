"""The toy's pipeline classes: FLUX pipelines with the toy's text length and image positions.

The T5 input stops at the 16 tokens the toy was trained with (FluxPipeline pads to 512, which changes a
caption's embeddings). Image positions (RoPE ids) are fractions of each side, scaled to the native 4 x 4 grid:
at any size "top left" is near (1, 1), as the captions mean it. No `__call__` changes: StepBatched serves
`ToyFluxPipeline` with the Flux step program and the edit pipelines with the generic one.
"""

from __future__ import annotations

from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, FluxPipeline


NATIVE_GRID = 4  # image tokens per side at 64 px


class ToyFlux:
    @staticmethod
    def _prepare_latent_image_ids(batch_size, height, width, device, dtype):
        ids = FluxPipeline._prepare_latent_image_ids(batch_size, height, width, device, dtype)
        ids[:, 1] *= NATIVE_GRID / max(height, 1)  # NOTE: an empty grid (a side below 16 px) fails later, as in Flux
        ids[:, 2] *= NATIVE_GRID / max(width, 1)
        return ids

    def _get_t5_prompt_embeds(self, prompt=None, num_images_per_prompt=1, max_sequence_length=512, device=None,
                              dtype=None):
        max_sequence_length = min(max_sequence_length, self.tokenizer_2.model_max_length)
        return super()._get_t5_prompt_embeds(prompt, num_images_per_prompt, max_sequence_length, device, dtype)


class ToyFluxPipeline(ToyFlux, FluxPipeline):
    """`toy.load_pipeline()`'s class."""


class ToyFluxInpaintPipeline(ToyFlux, FluxInpaintPipeline):
    """`ToyFluxInpaintPipeline(**pipe.components)` repaints the white part of `mask_image`."""


class ToyFluxImg2ImgPipeline(ToyFlux, FluxImg2ImgPipeline):
    """Redraws `image` from noise level `strength`."""
