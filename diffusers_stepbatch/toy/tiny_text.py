"""A seeded tiny T5 text encoder and its local tokenizer: the text side of the demo video model (`toy.video`),
and of the tiny test pipelines (`diffusers_stepbatch.testing`). Offline: no Hub access, random weights."""

from __future__ import annotations

import string

import torch


def tiny_t5_tokenizer():
    """A unigram T5 tokenizer over ASCII letters, digits and punctuation."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation]
    pieces += [("\u2581" + c, -1.5) for c in string.ascii_letters]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def tiny_t5_encoder(tokenizer, d_model: int = 32, seed: int = 0):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0,
        )
    ).eval()
