"""Caption embeddings for PiD: the last hidden states of frozen Gemma-2-2B-it, as the released decoders saw them.

As the reference's `_encode_text_raw`: instruction prefix + caption, right-padded to `prefix + 298` tokens,
Gemma's decoder (bf16), BOS plus the last 299 positions: [B, 300, 2304]. No text mask, so rows batch freely.

>>> encoder = PiDTextEncoder()                      # nothing loaded yet
>>> embeds = encoder.encode(["a cat", "a dog"])     # [2, 300, 2304]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["DEFAULT_TEXT_ENCODER_ID", "PID_INSTRUCTION_PROMPT", "PiDTextEncoder", "PiDTextEncoderConfig"]

# The reference maps "gemma-2-2b-it" to this Hub mirror of google/gemma-2-2b-it.
DEFAULT_TEXT_ENCODER_ID = "Efficient-Large-Model/gemma-2-2b-it"

# NOTE: the released checkpoints were trained with this prefix before every caption (reference experiment
# configs, `chi_prompt`); embeddings without it are out of distribution.
PID_INSTRUCTION_PROMPT = "\n".join(
    [
        'Given a user prompt, generate an "Enhanced prompt" that provides detailed visual descriptions suitable for '
        "image generation. Evaluate the level of detail in the user prompt:",
        "- If the prompt is simple, focus on adding specifics about colors, shapes, sizes, textures, and spatial "
        "relationships to create vivid and concrete scenes.",
        "- If the prompt is already detailed, refine and enhance the existing details slightly without "
        "overcomplicating.",
        "Here are examples of how to transform or refine prompts:",
        "- User Prompt: A cat sleeping -> Enhanced: A small, fluffy white cat curled up in a round shape, sleeping "
        "peacefully on a warm sunny windowsill, surrounded by pots of blooming red flowers.",
        "- User Prompt: A busy city street -> Enhanced: A bustling city street scene at dusk, featuring glowing "
        "street lamps, a diverse crowd of people in colorful clothing, and a double-decker bus passing by towering "
        "glass skyscrapers.",
        "Please generate only the enhanced description for the prompt below and avoid including any additional "
        "commentary or evaluations:",
        "User Prompt: ",
    ]
)


@dataclass(frozen=True)
class PiDTextEncoderConfig:
    """Which text model to use (a Gemma-2 causal LM by Hub id or folder, at `revision`, in `dtype`), the prefix put
    before every caption ("" for none) and the tokens kept per caption (the decoder's `txt_max_length`)."""

    model_id: str = DEFAULT_TEXT_ENCODER_ID
    revision: str | None = None
    max_length: int = 300
    instruction_prompt: str = PID_INSTRUCTION_PROMPT
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if self.max_length < 2:
            raise ValueError(f"max_length={self.max_length} must be >= 2 (BOS plus at least one token)")


class PiDTextEncoder:
    """Gemma-2 caption encoder for PiD; the tokenizer and model load on first `encode` unless given."""

    def __init__(
        self,
        config: PiDTextEncoderConfig | None = None,
        *,
        tokenizer: Any = None,
        model: torch.nn.Module | None = None,
        device: str | torch.device = "cpu",
    ):
        self.config = config or PiDTextEncoderConfig()
        self.device = torch.device(device)
        self._tokenizer = tokenizer
        self._model = model
        self._prefix_tokens: int | None = None

    def _load(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        cfg = self.config
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(cfg.model_id, revision=cfg.revision)
        if self._model is None:
            # NOTE: AutoModel on a causal-LM checkpoint gives its decoder without the LM head, as `get_decoder()`.
            self._model = AutoModel.from_pretrained(cfg.model_id, revision=cfg.revision, dtype=cfg.dtype)
        self._model = self._model.to(self.device).eval().requires_grad_(False)
        self._tokenizer.padding_side = "right"
        prompt = cfg.instruction_prompt
        self._prefix_tokens = len(self._tokenizer.encode(prompt)) if prompt else 0

    @property
    def model(self) -> torch.nn.Module:
        if self._prefix_tokens is None:
            self._load()
        return self._model

    @torch.no_grad()
    def encode(self, prompts: str | Sequence[str]) -> torch.Tensor:
        """[B, max_length, hidden] embeddings, one row per prompt; a row does not depend on the others."""
        if self._prefix_tokens is None:
            self._load()
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        cfg = self.config
        if cfg.instruction_prompt:
            texts = [cfg.instruction_prompt + p for p in prompts]
            total = self._prefix_tokens + cfg.max_length - 2
        else:
            texts, total = prompts, cfg.max_length
        tokens = self._tokenizer(
            texts, max_length=total, padding="max_length", truncation=True, return_tensors="pt"
        ).to(self.device)
        hidden = self._model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).last_hidden_state
        keep = [0, *range(total - cfg.max_length + 1, total)]
        return hidden[:, keep]
