"""PiD: a pixel-space diffusion decoder that replaces VAE decode and upsamples (nvidia/PiD checkpoints).

>>> from diffusers_stepbatch.decoders.pid import PiDDecoder, decode
>>> decoder = PiDDecoder.from_pretrained("nvidia/PiD", checkpoint="PiD_res2k_sr4x_official_flux_distill_4step")
>>> image = decode(decoder, latent, sigma=0.0, text_embeds=embeds)   # [B, 3, 4 * 8 * h, 4 * 8 * w] in [-1, 1]
"""

from .configs import OFFICIAL_CONFIGS, OfficialCheckpoint, get_official_config
from .hub import PiDCheckpointError, PiDCheckpointNotFoundError
from .model import PiDDecoder, load_official_decoder
from .sampler import PID_DISTILLED_TIMESTEPS, PiDSamplerConfig, decode, sampler_step, to_unit_range
from .text import PiDTextEncoder, PiDTextEncoderConfig

__all__ = [
    "OFFICIAL_CONFIGS",
    "PID_DISTILLED_TIMESTEPS",
    "OfficialCheckpoint",
    "PiDCheckpointError",
    "PiDCheckpointNotFoundError",
    "PiDDecoder",
    "PiDSamplerConfig",
    "PiDTextEncoder",
    "PiDTextEncoderConfig",
    "decode",
    "get_official_config",
    "load_official_decoder",
    "sampler_step",
    "to_unit_range",
]
