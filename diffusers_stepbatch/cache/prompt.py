"""Prompt-embedding cache: a byte-bounded LRU of text-encoder outputs, shared safely between engines.

A step program calls `cached_encode`: cached texts skip the text encoders, the others are encoded in one batched
work item. Keys isolate models: model id, a fingerprint of the encoders' weights, dtypes, placement and every
option that changes the embedding, then the text. Each text (positive or negative) is one entry.

>>> cache = PromptCache(max_bytes=64 * 2**20)
>>> sb_a, sb_b = StepBatched(pipe_a, prompt_cache=cache), StepBatched(pipe_b, prompt_cache=cache)
>>> cache.stats().hit_rate
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.batch import WorkItem
from ..module_scan import all_modules, execution_device as current_execution_device

DEFAULT_MAX_BYTES = 256 * 2**20
_SAMPLES_PER_TENSOR = 4096


@dataclass(frozen=True)
class PromptCacheStats:
    """Counters of one `PromptCache`; `bytes` is what the stored embeddings occupy."""

    hits: int
    misses: int
    entries: int
    bytes: int
    max_bytes: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class PromptCache:
    """A thread-safe LRU of text-encoder outputs, bounded in bytes (`max_bytes`); `put` stores private copies and
    `get` returns fresh ones. One cache may serve several engines (keys carry the model's identity).

    >>> cache = PromptCache(max_bytes=32 * 2**20)
    >>> cache.put(("model", "a cat"), (torch.ones(1, 4),))
    >>> cache.get(("model", "a cat"))[0].sum().item()
    4.0
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes!r} must be an int >= 0 (0 stores nothing)")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[torch.Tensor, ...]] = OrderedDict()
        self._structures: dict[Hashable, Any] = {}  # how an entry's tensors nest in the output it came from
        self._lock = threading.Lock()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0

    def get(self, key: Hashable) -> tuple[torch.Tensor, ...] | None:
        """The entry under `key` as fresh copies (a hit), or None (a miss)."""
        stored = self._lookup(key)
        return None if stored is None else tuple(t.clone() for t in stored)

    def get_entry(self, key: Hashable) -> tuple[tuple[torch.Tensor, ...], Any] | None:
        """(fresh copies of the entry under `key`, the structure stored with it), or None (a miss)."""
        with self._lock:
            structure = self._structures.get(key)
        stored = self._lookup(key)
        return None if stored is None else (tuple(t.clone() for t in stored), structure)

    def put(self, key: Hashable, tensors: Sequence[torch.Tensor], structure: Any = None) -> None:
        """Store copies of `tensors` (and `structure`, e.g. a pytree spec) under `key`; an entry larger than
        `max_bytes` is not stored."""
        # NOTE: own contiguous copies: a sliced row would keep its whole batch alive, beyond the byte count.
        stored = tuple(t.detach().clone(memory_format=torch.contiguous_format) for t in tensors)
        size = sum(t.numel() * t.element_size() for t in stored)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= _nbytes(old)
            self._entries[key] = stored
            self._structures[key] = structure
            self._bytes += size
            while self._bytes > self.max_bytes:
                evicted_key, evicted = self._entries.popitem(last=False)
                self._structures.pop(evicted_key, None)
                self._bytes -= _nbytes(evicted)
                self._evictions += 1

    def stats(self) -> PromptCacheStats:
        with self._lock:
            return PromptCacheStats(self._hits, self._misses, len(self._entries), self._bytes, self.max_bytes,
                                    self._evictions)

    def clear(self) -> None:
        """Drop every entry (the hit/miss counters stay)."""
        with self._lock:
            self._entries.clear()
            self._structures.clear()
            self._bytes = 0

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PromptCache(entries={s.entries}, bytes={s.bytes}, max_bytes={s.max_bytes}, hits={s.hits}, "
                f"misses={s.misses})")

    def _lookup(self, key: Hashable) -> tuple[torch.Tensor, ...] | None:
        """The stored tensors themselves; callers inside this module only read them."""
        with self._lock:
            stored = self._entries.get(key)
            if stored is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return stored


def _nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------------------------------------------- keys
class _Fingerprints:
    """Weight fingerprints memoized per module, recomputed when a tensor's identity or `_version` (in-place writes:
    `load_state_dict`, a fused LoRA) changes."""

    def __init__(self):
        self._memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __call__(self, module: torch.nn.Module, modules: tuple[torch.nn.Module, ...] | None = None) -> str:
        signature = tuple((id(t), t._version) for sub in (all_modules(module) if modules is None else modules)
                          for group in (sub._parameters, sub._buffers) for t in group.values() if t is not None)
        with self._lock:
            memo = self._memo.get(module)
        if memo is None or memo[0] != signature:
            tensors = list(module.named_parameters()) + list(module.named_buffers())
            memo = (signature, _weights_digest(module, tensors))
            with self._lock:
                self._memo[module] = memo
        adapters = _adapter_state(module)
        return memo[1] if adapters is None else f"{memo[1]}+{hashlib.blake2b(adapters.encode()).hexdigest()[:16]}"


def _adapter_state(module: torch.nn.Module) -> str | None:
    """Loaded LoRA adapters' scales and switches: `set_adapters` changes them without touching any tensor."""
    if not (getattr(module, "_hf_peft_config_loaded", False) or hasattr(module, "peft_config")):
        return None
    state = []
    for name, layer in module.named_modules():
        scaling = getattr(layer, "scaling", None)
        if isinstance(scaling, dict):
            state.append((name, sorted(scaling.items()), getattr(layer, "active_adapters", None),
                          getattr(layer, "merged_adapters", None), getattr(layer, "disable_adapters", None)))
    return repr(state)


def _weights_digest(module: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> str:
    # NOTE: sampled (4096 strided elements per tensor, every name, shape and dtype): checkpoints differ nearly
    # everywhere, and hashing every byte of a large T5 would cost seconds and a device-to-host copy.
    h = hashlib.blake2b(digest_size=16)
    h.update(type(module).__qualname__.encode())
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        h.update(config.to_json_string().encode())
    for name, tensor in tensors:
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        try:
            flat = tensor.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // _SAMPLES_PER_TENSOR)][:_SAMPLES_PER_TENSOR]
            h.update(sample.to("cpu", torch.float64).numpy().tobytes())
        except (RuntimeError, TypeError, NotImplementedError):  # e.g. a quantized tensor subclass
            h.update(f"id:{id(tensor)}".encode())
    return h.hexdigest()


weights_fingerprint = _Fingerprints()


def placement(execution_device: Any, module: torch.nn.Module | None) -> str:
    """Where a text encoder runs: the pipeline's execution device, the module's device and any offload hook."""
    if module is None:
        return "none"
    hook = getattr(module, "_hf_hook", None)
    first = next(module.parameters(), None)
    where = str(first.device) if first is not None else "no-params"
    return f"{execution_device}|{where}|{type(hook).__name__ if hook is not None else 'resident'}"


def encoder_namespace(
    pipe: Any,
    encoders: Sequence[torch.nn.Module | None],
    family: str,
    tokenizers: Sequence[Any] = (),
    execution_device: Any = None,
    **options: Any,
) -> tuple:
    """The part of a cache key shared by every text of one encode configuration.

    >>> namespace = encoder_namespace(pipe, [pipe.text_encoder, pipe.text_encoder_2], "flux",
    ...                               [pipe.tokenizer, pipe.tokenizer_2], max_sequence_length=512, lora_scale=None)

    Args:
        pipe: the pipeline; its `name_or_path` joins the key (one built in memory is keyed by its identity).
        encoders: the text encoders the embedding depends on (None entries are allowed).
        family: the encode function ("flux", "sd3", ...): the same encoders give other embeddings in other families.
        tokenizers: the encoders' tokenizers (class, vocabulary size and max length join the key).
        execution_device: `pipe._execution_device` if the caller has it.
        options: everything else that changes the embedding: max_sequence_length, lora_scale, clip_skip, ...
    """
    if execution_device is None:
        execution_device = current_execution_device(pipe)
    return (
        ("family", family),
        ("model", getattr(pipe, "name_or_path", None) or f"<{type(pipe).__name__} at {id(pipe):#x}>"),
        ("weights", tuple(weights_fingerprint(e) if e is not None else None for e in encoders)),
        ("tokenizers", tuple(_describe_tokenizer(t) for t in tokenizers)),
        ("dtype", tuple(str(getattr(e, "dtype", None)) for e in encoders)),
        ("placement", tuple(placement(execution_device, e) for e in encoders)),
        ("options", tuple(sorted(options.items()))),
    )


def encoders_are_deterministic(encoders: Sequence[torch.nn.Module | None]) -> bool:
    """Whether the encoders give the same embedding for the same text every call: none in training mode (dropout
    makes the plain pipeline draw new embeddings each call)."""
    return not any(encoder is not None and encoder.training for encoder in encoders)


def _describe_tokenizer(tokenizer: Any) -> tuple | None:
    if tokenizer is None:
        return None
    return type(tokenizer).__name__, len(tokenizer), getattr(tokenizer, "model_max_length", None)


# ------------------------------------------------------------------------------------------ programs
def cached_encode(
    cache: PromptCache | None,
    namespace: Hashable,
    texts: Sequence[Hashable],
    make_item: Callable[[list], WorkItem],
) -> Generator[WorkItem, Any, tuple[torch.Tensor, ...]]:
    """Encode `texts` through the cache in a step program: only the misses, each once, go into `make_item(texts)`
    (the family's batched encode item); returns fresh tensors, one row per entry of `texts`.

    >>> embeds, pooled = yield from cached_encode(cache, namespace, [("a cat", "a cat")], make_item)
    """
    if cache is None or cache.max_bytes == 0:
        return _as_tuple((yield make_item(list(texts))))
    found = {}
    missing = []
    for text in texts:
        if text in found or text in missing:
            continue
        stored = cache._lookup((namespace, text))
        if stored is None:
            missing.append(text)
        else:
            found[text] = stored
    if missing:
        encoded = _as_tuple((yield make_item(missing)))
        for row, text in enumerate(missing):
            found[text] = tuple(t[row:row + 1] for t in encoded)
            cache.put((namespace, text), found[text])
    width = len(next(iter(found.values())))
    return tuple(torch.cat([found[text][k] for text in texts]) for k in range(width))


def _as_tuple(output: Any) -> tuple[torch.Tensor, ...]:
    return (output,) if isinstance(output, torch.Tensor) else tuple(output)
