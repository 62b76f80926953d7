"""Untrained toy FLUX components, built from configs, and the word-level tokenizers of the caption grammar.

Everything here is offline and deterministic: `build_pipeline(seed)` returns a `FluxPipeline` whose text
encoders are the frozen random encoders that the shipped model was trained with.

>>> pipe = build_pipeline(seed=0)
>>> pipe.vae_scale_factor
8
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

# NOTE: captions are at most 11 words; one token per word plus BOS/EOS fits in 16.
MAX_SEQUENCE_LENGTH = 16
TEXT_DIM = 64
NATIVE_SIZE = 64
# NOTE: the sizes the multi-size fine-tune (toy.train_sizes) covers: every side a multiple of SIZE_MULTIPLE
# (vae_scale_factor * 2) in [MIN_SIDE, MAX_SIDE], the longer side at most MAX_ASPECT times the shorter.
MIN_SIDE, MAX_SIDE, SIZE_MULTIPLE, MAX_ASPECT = 48, 128, 16, 2
# (width, height) the held-out judge scores after training and in tests: square, 2:1, 1:2 and 5:7.
JUDGED_SIZES = ((64, 64), (128, 128), (96, 48), (64, 128), (80, 112), (48, 48))

WORDS = (
    "a", "at", "the", "in", "on", "top", "bottom", "left", "right", "center", "background",
    "red", "green", "blue", "yellow", "orange", "purple", "white", "black", "gray",
    "circle", "square", "triangle", "cross",
)  # fmt: skip

VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(16, 32, 64, 128),  # four entries: vae_scale_factor = 2**3 = 8
    layers_per_block=1,
    latent_channels=16,
    # NOTE: few groups on purpose: a group of one channel (GroupNorm = InstanceNorm) normalises the flat
    # background's absolute level away, which costs exactly the colour fidelity this model is judged on.
    norm_num_groups=4,
    sample_size=NATIVE_SIZE,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=False,
    # NOTE: placeholders; training measures the latent mean/std and stores them (as FLUX does).
    scaling_factor=1.0,
    shift_factor=0.0,
)

TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=64,  # 16 latent channels x 2x2 packing
    num_layers=2,
    num_single_layers=4,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=TEXT_DIM,
    pooled_projection_dim=TEXT_DIM,
    guidance_embeds=True,
    axes_dims_rope=(8, 12, 12),
)

SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    # NOTE: FLUX's shift schedule rescaled to our sequence lengths: 64x64 (16 tokens) gets mu=0.5.
    base_image_seq_len=16,
    max_image_seq_len=256,
    base_shift=0.5,
    max_shift=1.15,
)


def supported_sizes() -> list[tuple[int, int]]:
    """Every (width, height) the toy model was trained to draw."""
    sides = range(MIN_SIDE, MAX_SIDE + 1, SIZE_MULTIPLE)
    return [(w, h) for h in sides for w in sides if max(w, h) <= MAX_ASPECT * min(w, h)]


def build_clip_tokenizer() -> CLIPTokenizer:
    """Byte-level BPE whose merges spell every grammar word as one token."""
    from transformers import CLIPTokenizer
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in ByteLevel.alphabet():
        vocab.setdefault(char, len(vocab))
        vocab.setdefault(char + "</w>", len(vocab))
    # NOTE: a tiny BPE training run over the grammar words: replaying the learned merges in order turns each
    # word back into a single token, which hand-written per-word merges don't guarantee (they interfere).
    words = [list(word[:-1]) + [word[-1] + "</w>"] for word in WORDS]
    merges = []
    while any(len(pieces) > 1 for pieces in words):
        counts: dict[tuple[str, str], int] = {}
        for pieces in words:
            for pair in zip(pieces, pieces[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        words = [_merge(pieces, best) for pieces in words]
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=MAX_SEQUENCE_LENGTH)


def _merge(pieces: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(pieces):
        if i + 1 < len(pieces) and (pieces[i], pieces[i + 1]) == pair:
            out.append(pieces[i] + pieces[i + 1])
            i += 2
        else:
            out.append(pieces[i])
            i += 1
    return out


def build_t5_tokenizer() -> T5TokenizerFast:
    """Unigram vocabulary with one piece per grammar word and single characters as fallback."""
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("\u2581" + word, -1.0) for word in WORDS]
    vocab += [(char, -10.0) for char in "\u2581abcdefghijklmnopqrstuvwxyz0123456789.,'-"]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=MAX_SEQUENCE_LENGTH)


def build_text_encoders(clip_vocab: int, t5_vocab: int, seed: int) -> tuple[CLIPTextModel, T5EncoderModel]:
    """Tiny random CLIP and T5 encoders; they stay frozen, a fixed random map is enough to tell captions apart."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=clip_vocab,
            hidden_size=TEXT_DIM,
            intermediate_size=2 * TEXT_DIM,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=MAX_SEQUENCE_LENGTH,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            projection_dim=TEXT_DIM,
        )
    )
    torch.manual_seed(seed + 1)
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=t5_vocab,
            d_model=TEXT_DIM,
            d_kv=16,
            d_ff=2 * TEXT_DIM,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )
    return clip.eval().requires_grad_(False), t5.eval().requires_grad_(False)


def build_vae(seed: int) -> AutoencoderKL:
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(**VAE_CONFIG)


def build_transformer(seed: int) -> FluxTransformer2DModel:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(**TRANSFORMER_CONFIG)


def build_scheduler() -> FlowMatchEulerDiscreteScheduler:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def build_pipeline(
    seed: int = 0,
    vae: AutoencoderKL | None = None,
    transformer: FluxTransformer2DModel | None = None,
) -> FluxPipeline:
    """A toy `FluxPipeline`; untrained parts are built from the configs above with seeds derived from `seed`."""
    from diffusers import FluxPipeline

    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_t5_tokenizer()
    text_encoder, text_encoder_2 = build_text_encoders(len(tokenizer), len(tokenizer_2), seed)
    return FluxPipeline(
        scheduler=build_scheduler(),
        vae=vae if vae is not None else build_vae(seed + 2),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer if transformer is not None else build_transformer(seed + 3),
    )
