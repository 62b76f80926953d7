"""Tiny, seeded, offline parts the test pipelines are built from: byte-level tokenizers, text encoders, a VAE."""

from __future__ import annotations

import torch

from ..toy.tiny_text import tiny_t5_encoder, tiny_t5_tokenizer

__all__ = ["tiny_clip_tokenizer", "tiny_clip_text_encoder", "tiny_qwen2_tokenizer", "tiny_t5_encoder",
           "tiny_t5_tokenizer", "tiny_vae"]


def tiny_clip_tokenizer(model_max_length: int = 77):
    """A byte-level CLIP tokenizer with no merges: every character is one token."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def tiny_clip_text_encoder(tokenizer, hidden_size: int = 32, projection_dim: int | None = None, layers: int = 3,
                           seed: int = 0):
    """A CLIPTextModel, or a CLIPTextModelWithProjection when `projection_dim` is given."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        hidden_size=hidden_size, intermediate_size=37, layer_norm_eps=1e-05, num_attention_heads=4,
        num_hidden_layers=layers, vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length,
        hidden_act="gelu", projection_dim=projection_dim or 32,
    )
    torch.manual_seed(seed)
    model_class = CLIPTextModel if projection_dim is None else CLIPTextModelWithProjection
    return model_class(config).eval()


def tiny_vae(latent_channels: int = 4, blocks: int = 2, seed: int = 0, **config):
    """An AutoencoderKL with vae_scale_factor = 2 ** (blocks - 1)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,) * blocks,
        down_block_types=("DownEncoderBlock2D",) * blocks, up_block_types=("UpDecoderBlock2D",) * blocks,
        layers_per_block=1, latent_channels=latent_channels, norm_num_groups=1, **config,
    ).eval()


_QWEN_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                        "<|image_pad|>", "<|video_pad|>")


def tiny_qwen2_tokenizer():
    """A byte-level Qwen2 tokenizer with no merges (one token per character) plus Qwen's chat/vision tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    for token in ("<|endoftext|>",) + _QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(_QWEN_SPECIAL_TOKENS)})
    return tokenizer
