"""The toy pipeline's class: a FluxPipeline whose T5 input stops at the length the toy model was trained with.

FluxPipeline pads the T5 input to `max_sequence_length` (default 512) and its T5 encoder attends to the
padding, so the embeddings of a caption depend on that length; the toy model saw 16 tokens in training.
Capping the T5 length at the tokenizer's `model_max_length` (16) makes FluxPipeline's defaults draw the
trained picture: `pipe(caption, height=64, width=64)` equals `pipe(caption, ..., max_sequence_length=16)`.
It changes no `__call__`, so StepBatched serves it with the Flux step program.

>>> pipe = ToyFluxPipeline.from_pretrained(WEIGHTS_DIR)   # what `toy.load_pipeline()` returns
"""

from __future__ import annotations

from diffusers import FluxPipeline


class ToyFluxPipeline(FluxPipeline):
    """FluxPipeline with the T5 length capped at `tokenizer_2.model_max_length`."""

    def _get_t5_prompt_embeds(self, prompt=None, num_images_per_prompt=1, max_sequence_length=512, device=None,
                              dtype=None):
        max_sequence_length = min(max_sequence_length, self.tokenizer_2.model_max_length)
        return super()._get_t5_prompt_embeds(prompt, num_images_per_prompt, max_sequence_length, device, dtype)
