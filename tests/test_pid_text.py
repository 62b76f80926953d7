"""PiD caption embeddings: the reference recipe on a tiny offline Gemma-2 (no downloads)."""

from __future__ import annotations

import pytest
import torch
from transformers import BatchEncoding, Gemma2Config, Gemma2Model

from diffusers_stepbatch.decoders.pid import PiDTextEncoder, PiDTextEncoderConfig


BOS, PAD = 2, 0


class CharTokenizer:
    """BOS + one token per character; pads and truncates on the right like the Gemma tokenizer does here."""

    padding_side = "right"

    def encode(self, text: str) -> list[int]:
        return [BOS] + [3 + ord(c) % 60 for c in text]

    def __call__(self, texts, *, max_length, padding, truncation, return_tensors):
        assert padding == "max_length" and truncation and return_tensors == "pt"
        ids = [self.encode(t)[:max_length] for t in texts]
        mask = [[1] * len(i) + [0] * (max_length - len(i)) for i in ids]
        ids = [i + [PAD] * (max_length - len(i)) for i in ids]
        return BatchEncoding({"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)})


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _encoder(prompt: str = "Describe: ", max_length: int = 8) -> PiDTextEncoder:
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        query_pre_attn_scalar=8,
        max_position_embeddings=128,
    )
    model = Gemma2Model(config).float()
    return PiDTextEncoder(
        PiDTextEncoderConfig(instruction_prompt=prompt, max_length=max_length, dtype=torch.float32),
        tokenizer=CharTokenizer(),
        model=model,
    )


def test_keeps_bos_and_the_last_positions():
    encoder = _encoder()
    prompt_tokens = len(CharTokenizer().encode("Describe: "))
    total = prompt_tokens + 8 - 2
    embeds = encoder.encode(["a cat"])
    tokens = CharTokenizer()(
        ["Describe: a cat"], max_length=total, padding="max_length", truncation=True, return_tensors="pt"
    )
    hidden = encoder.model(**tokens).last_hidden_state
    assert embeds.shape == (1, 8, 16)
    assert torch.equal(embeds[:, 0], hidden[:, 0])
    assert torch.equal(embeds[:, 1:], hidden[:, total - 7 :])


def test_rows_do_not_depend_on_each_other():
    encoder = _encoder()
    prompts = ["a cat", "a very long caption about a dog on a beach", ""]
    batched = encoder.encode(prompts)
    for i, prompt in enumerate(prompts):
        assert (batched[i] - encoder.encode(prompt)[0]).abs().max() <= 1e-5


def test_without_instruction_prompt_uses_max_length_tokens():
    encoder = _encoder(prompt="", max_length=6)
    assert encoder.encode("hello").shape == (1, 6, 16)


def test_nothing_loads_until_used():
    encoder = PiDTextEncoder(PiDTextEncoderConfig(model_id="some/unreachable-model"))
    assert encoder._model is None and encoder._tokenizer is None
