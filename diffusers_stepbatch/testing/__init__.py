"""Tiny, offline, seeded diffusers pipelines and adapters for tests, benchmarks and demos (random weights).

The first families and the shared parts are importable from here; newer models from their module:
`testing.image_models` (Z-Image, FLUX.2, Qwen-Image edit and 2.1), `testing.ltx_models` (LTX-2),
`testing.hunyuan_video_models` (HunyuanVideo 1.5); the Wan video pipelines are the demo server's (`toy.video`).

>>> from diffusers_stepbatch.testing import tiny_flux_pipeline
>>> image = tiny_flux_pipeline()("a cat", height=32, width=32, num_inference_steps=2).images[0]
"""

from .adapters import add_random_ip_adapter, add_random_lora_adapters, add_random_sd3_ip_adapter
from .components import (
    tiny_clip_text_encoder,
    tiny_clip_tokenizer,
    tiny_qwen2_tokenizer,
    tiny_t5_encoder,
    tiny_t5_tokenizer,
    tiny_vae,
)
from .pipelines import (
    FluxSize,
    tiny_flux_pipeline,
    tiny_flux_transformer,
    tiny_pixart_or_sana_pipeline,
    tiny_qwenimage_pipeline,
    tiny_sd3_pipeline,
    tiny_sd_pipeline,
    tiny_sdxl_pipeline,
)
