"""`StepBatched.sibling`: another pipeline over the same models, submitting into the same engine."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import torch
from PIL import Image

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.toy import load_pipeline
from diffusers_stepbatch.toy.pipeline import ToyFluxImg2ImgPipeline, ToyFluxInpaintPipeline
from diffusers_stepbatch.toy.scenes import Scene, render_scene

CALL = {"num_inference_steps": 12, "max_sequence_length": 16, "height": 64, "width": 64}
PROMPT = "a red circle at the top left on a white background"


def test_siblings_share_one_engine_and_their_forwards_and_match_the_plain_pipelines():
    pipe = load_pipeline()
    inpaint_pipe, img2img_pipe = ToyFluxInpaintPipeline(**pipe.components), ToyFluxImg2ImgPipeline(**pipe.components)
    for p in (inpaint_pipe, img2img_pipe):
        p.set_progress_bar_config(disable=True)
    image = render_scene(Scene("blue", "square", "at the bottom right", "white"), 64)
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 32))
    sb = StepBatched(pipe, max_batch_size=8)
    try:
        inpaint, img2img = sb.sibling(inpaint_pipe), sb.sibling(img2img_pipe)
        assert inpaint.engine is sb.engine and img2img.engine is sb.engine
        assert inpaint.options.prompt_cache is sb.options.prompt_cache
        assert img2img.sibling(pipe).engine is sb.engine  # a sibling's sibling belongs to the same owner
        handles = [inpaint.submit(PROMPT, image=image, mask_image=mask, strength=1.0,
                                  generator=torch.Generator().manual_seed(1), **CALL),
                   img2img.submit(PROMPT, image=image, strength=1.0, generator=torch.Generator().manual_seed(2),
                                  **CALL)]
        got = [np.asarray(h.result().images[0], dtype=np.int16) for h in handles]
        denoise = sb.stats()["rows_histogram"]["denoise"]
        assert denoise.get(2, 0) > 0, denoise  # the inpainting and the img2img request shared forwards
    finally:
        sb.close()
    want = [inpaint_pipe(PROMPT, image=image, mask_image=mask, strength=1.0,
                         generator=torch.Generator().manual_seed(1), **CALL).images[0],
            img2img_pipe(PROMPT, image=image, strength=1.0, generator=torch.Generator().manual_seed(2), **CALL).images[0]]
    for g, w in zip(got, want):
        assert np.abs(g - np.asarray(w, dtype=np.int16)).max() <= 1
