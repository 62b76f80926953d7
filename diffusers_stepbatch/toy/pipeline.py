"""The toy's pipeline classes: FLUX pipelines whose T5 input stops at the 16 tokens the toy was trained with.

FluxPipeline pads the T5 input to `max_sequence_length` (default 512), which changes a caption's embeddings;
capped, FluxPipeline's defaults draw the trained picture. No `__call__` changes: StepBatched serves
`ToyFluxPipeline` with the Flux step program and the edit pipelines with the generic one.
"""

from __future__ import annotations

from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, FluxPipeline


class T5LengthCap:
    def _get_t5_prompt_embeds(self, prompt=None, num_images_per_prompt=1, max_sequence_length=512, device=None,
                              dtype=None):
        max_sequence_length = min(max_sequence_length, self.tokenizer_2.model_max_length)
        return super()._get_t5_prompt_embeds(prompt, num_images_per_prompt, max_sequence_length, device, dtype)


class ToyFluxPipeline(T5LengthCap, FluxPipeline):
    """`toy.load_pipeline()`'s class."""


class ToyFluxInpaintPipeline(T5LengthCap, FluxInpaintPipeline):
    """`ToyFluxInpaintPipeline(**pipe.components)` repaints the white part of `mask_image`."""


class ToyFluxImg2ImgPipeline(T5LengthCap, FluxImg2ImgPipeline):
    """Redraws `image` from noise level `strength`."""
