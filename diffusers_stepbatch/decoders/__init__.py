"""Decoders from latents to images: batched VAE decode (`vae.py`) and PiD (`pid/`), by object or registered name.

>>> from diffusers_stepbatch.decoders import register_decoder, PiDDecoding
"""

from .registry import PIPELINE_TEXT, PiDDecoding, register_decoder, registered_decoders, resolve_decoder

__all__ = ["PIPELINE_TEXT", "PiDDecoding", "register_decoder", "registered_decoders", "resolve_decoder"]
