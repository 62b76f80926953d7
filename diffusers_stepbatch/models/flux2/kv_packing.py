"""FLUX.2 klein KV calls in the packed forward: parts that fill or read a reference-image KV cache.

A klein KV request's first call (`kv_cache_mode="extract"`) holds its reference-image tokens at the front of each
row's image tokens: modulated with a fixed timestep's embedding, they attend only to each other (text and target
tokens attend to all), and their keys and values after RoPE fill a new `Flux2KVCache` that the call returns. Its
later calls (`"cached"`) attend to that cache's keys and values as well, put between the text and image keys.
The KV attention processors do this per call; here each part's attention does it for the part's rows, op for op,
so calls of other sizes, reference counts and modes (plain calls too) share one packed forward. A cached part reads
its rows' cache (one request's, or the row-state join of several); an extract part fills one the row state cuts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_flux2 import (Flux2KVAttnProcessor, Flux2KVCache,
                                                            Flux2KVParallelSelfAttnProcessor)

from ..packing.joint import IMAGE, attention_fn
from ..packing.layout import PackedLayout, RowValues, adaln_rows
from .kv_cache import cache_rows

# the forward's KV arguments the packed forward reproduces (`kv_role` says which combinations)
KV_ARGUMENTS = frozenset({"kv_cache", "kv_cache_mode", "num_ref_tokens", "ref_fixed_timestep"})
_KV_PROCESSORS = (Flux2KVAttnProcessor, Flux2KVParallelSelfAttnProcessor)


@dataclass(frozen=True)
class PartKV:
    """What a packed part does with the reference KV cache."""

    mode: str | None  # "extract" (fills `cache`), "cached" (reads `cache`) or None (a plain call)
    num_ref: int = 0  # reference tokens per row: extract: the first image tokens; cached: the cache's
    cache: Flux2KVCache | None = None  # [part rows, reference tokens, heads, head dim] per layer
    ref_timestep: float = 0.0  # extract: the reference tokens' fixed timestep

    @property
    def extracts(self) -> bool:
        return self.mode == "extract" and self.num_ref > 0


def kv_role(arguments: dict) -> tuple[str | None, int] | None:
    """(mode, reference tokens per row) of a call whose KV arguments the packed forward reproduces, as the
    pipeline passes them; None for other combinations (they run as the model's forward)."""
    mode, cache = arguments.get("kv_cache_mode"), arguments.get("kv_cache")
    refs, fixed = arguments.get("num_ref_tokens", 0), arguments.get("ref_fixed_timestep", 0.0)
    if mode is None and cache is None:
        return None, 0  # NOTE: the model reads num_ref_tokens and ref_fixed_timestep only when extracting
    if mode == "cached" and isinstance(cache, Flux2KVCache):
        return mode, cache.num_ref_tokens
    if mode == "extract" and cache is None and isinstance(refs, int) and isinstance(fixed, (int, float)) and \
            0 <= refs <= arguments["hidden_states"].shape[1]:
        return mode, refs
    return None


def part_kv(transformer, arguments: dict) -> PartKV:
    """The `PartKV` of a call `kv_role` accepts; an extract call's cache is new, as the model makes it."""
    mode, refs = kv_role(arguments)
    if mode == "cached":
        return PartKV(mode, refs, arguments["kv_cache"])
    if mode == "extract":
        cache = None
        if refs:
            cache = Flux2KVCache(len(transformer.transformer_blocks), len(transformer.single_transformer_blocks))
            cache.num_ref_tokens = refs
        return PartKV(mode, refs, cache, float(arguments.get("ref_fixed_timestep", 0.0)))
    return PartKV(None)


@dataclass(frozen=True)
class PackedKV:
    """The KV roles of a packed forward's parts and, where a part extracts, every row's modulation of its
    reference timestep (double-stream image, single-stream), as the model's `ref_temb` gives them."""

    parts: Sequence[PartKV]
    ref_mods: tuple[torch.Tensor, torch.Tensor] | None

    def image_values(self, layout: PackedLayout, mod_img: torch.Tensor) -> list[RowValues]:
        """The double blocks' image-stream AdaLN values, reference tokens with their row's reference ones."""
        return self._values(layout, IMAGE, mod_img, [0] * layout.num_parts, 6)

    def joint_values(self, joint_layout: PackedLayout, text_lengths: Sequence[int], mod_single: torch.Tensor
                     ) -> list[RowValues]:
        """The single blocks' AdaLN values over each row's text then image tokens, as `image_values`."""
        return self._values(joint_layout, 0, mod_single, text_lengths, 3)

    def _values(self, layout, stream, mod, offsets, chunks):
        ref_mod = None if self.ref_mods is None else self.ref_mods[0 if stream == IMAGE else 1]
        if ref_mod is None:
            return layout.row_values(stream, adaln_rows(mod, chunks), chunks)
        is_ref = torch.zeros(layout.tokens(stream), dtype=torch.bool, device=mod.device)
        for part, kv in enumerate(self.parts):
            if kv.extracts:
                span, rows = layout.spans[part][stream], layout.rows[part]
                is_ref[span.start:span.start + rows * span.length].view(rows, span.length)[
                    :, offsets[part]:offsets[part] + kv.num_ref] = True
        table = adaln_rows(torch.cat([mod, ref_mod]), chunks)  # NOTE: each row's values, then its reference ones
        per_token = table.index_select(0, layout.token_rows[stream] + is_ref * layout.num_rows).chunk(chunks, dim=1)
        return [RowValues(rows, tokens) for rows, tokens in
                zip(table[:layout.num_rows].chunk(chunks, dim=1), per_token)]

    def attention(self, attn, text_lengths: Sequence[int], layer: int, double: bool) -> list:
        """Per part, its attention in layer `layer` (a double block's when `double`, else a single block's) on
        the part's [rows, text + image tokens, heads, head dim] queries, keys and values."""
        if not isinstance(attn.processor, _KV_PROCESSORS):
            raise ValueError(f"klein KV calls pack with {' or '.join(c.__name__ for c in _KV_PROCESSORS)} only, "
                             f"but the transformer uses {type(attn.processor).__name__}")
        plain = attention_fn(attn)
        functions = []
        for kv, text in zip(self.parts, text_lengths):
            layer_cache = None
            if kv.cache is not None:
                layer_cache = kv.cache.get_double(layer) if double else kv.cache.get_single(layer)
            if kv.mode == "cached":
                functions.append(_reading(plain, text, *layer_cache.get()))
            elif kv.extracts:
                functions.append(_filling(plain, text, kv.num_ref, layer_cache))
            else:
                functions.append(plain)
        return functions

    def select(self, layout: PackedLayout, rows: Sequence[int]) -> PackedKV:
        """The roles of a call of only `rows` (global, in order; `layout.select_rows`' parts): cached parts read
        their kept rows' caches; an extract part (its rows always compute) stays whole."""
        kept: dict[int, list[int]] = {}
        for row in rows:
            part, inner = layout.part_of_row(row)
            kept.setdefault(part, []).append(inner)
        parts = []
        for part, inners in kept.items():
            kv = self.parts[part]
            if kv.extracts and len(inners) != layout.rows[part]:
                raise ValueError(f"an extract part of {layout.rows[part]} rows can't run {len(inners)} of them")
            if kv.mode == "cached" and len(inners) != layout.rows[part]:
                kv = PartKV(kv.mode, kv.num_ref, cache_rows(kv.cache, torch.tensor(inners)))
            parts.append(kv)
        index = torch.tensor(list(rows), device=layout.token_rows[0].device)
        ref_mods = None if self.ref_mods is None else tuple(mod.index_select(0, index) for mod in self.ref_mods)
        return PackedKV(parts, ref_mods)

    def outputs(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each part's image tokens as the model returns them: without an extract part's reference tokens."""
        return [out[:, kv.num_ref:] if kv.extracts else out for out, kv in zip(outputs, self.parts)]


def packed_kv(transformer, parts: Sequence[PartKV], rows: Sequence[int], timestep: torch.Tensor,
              guidance: torch.Tensor | None) -> PackedKV | None:
    """The forward's `PackedKV`, or None when every part is a plain call. `timestep` and `guidance` are the rows'
    (times 1000), as the model embeds them."""
    if all(kv.mode is None for kv in parts):
        return None
    ref_mods = None
    if any(kv.extracts for kv in parts):
        # NOTE: every row's, as the model embeds its call's rows (a request's rows at their solo GEMM size, per-row
        # LoRA by row); only extracting rows read theirs
        ref_timestep = torch.cat([torch.full((count,), kv.ref_timestep * 1000, dtype=timestep.dtype,
                                             device=timestep.device) for kv, count in zip(parts, rows)])
        ref_temb = transformer.time_guidance_embed(ref_timestep, guidance)
        ref_mods = (transformer.double_stream_modulation_img(ref_temb), transformer.single_stream_modulation(ref_temb))
    return PackedKV(list(parts), ref_mods)


def _between(tensor: torch.Tensor, reference: torch.Tensor, text: int) -> torch.Tensor:
    return torch.cat([tensor[:, :text], reference, tensor[:, text:]], dim=1)


def _reading(attention, text: int, ref_key: torch.Tensor, ref_value: torch.Tensor):
    """A cached part's attention: its reference keys and values between the text and image ones."""
    def attend(query, key, value):
        return attention(query, _between(key, ref_key, text), _between(value, ref_value, text))

    return attend


def _filling(attention, text: int, refs: int, layer_cache):
    """An extract part's attention: stores its reference keys and values in the layer's cache; text and image
    tokens attend to all, reference tokens to each other (the model's `_flux2_kv_causal_attention`)."""
    ref = slice(text, text + refs)

    def attend(query, key, value):
        layer_cache.store(key[:, ref].clone(), value[:, ref].clone())
        others = attention(torch.cat([query[:, :text], query[:, ref.stop:]], dim=1), key, value)
        own = attention(query[:, ref], key[:, ref], value[:, ref])
        return torch.cat([others[:, :text], own, others[:, text:]], dim=1)

    return attend

