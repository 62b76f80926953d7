"""The model layer: what StepBatched knows about each denoiser class, registered by class.

Batching is a property of the denoiser: many pipelines share a few transformer classes. A class without a
module gets `DEFAULT_SUPPORT`, whose first merge of each call structure is checked against separate calls.

>>> @register_model(ZImageTransformer2DModel)
... def _z_image() -> ModelSupport:
...     return ModelSupport(row_lists=("x", "cap_feats"), output_lists_are_rows=True, trusted=True)
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

# refusal(model, arguments) -> why this call can't share a forward, or None
Refusal = Callable[[torch.nn.Module, dict[str, Any]], "str | None"]


@dataclass(frozen=True)
class RowState:
    """A state object holding rows of one call, such as a request's KV cache of its prompt (filled by its first
    step's call, read by the later ones), given to the model as an argument or returned by it.

    Args:
        join: `join(parts)`: the state for a merged call from `[(state, rows), ...]`, each part a whole state of one
            call, in row order; what the merged call stores lands in each part's own state.
        key: `key(state)`: what the states of merged calls must share (their tokens), or None.
        cut: `cut(state, begin, end)`: rows [begin, end) of a state the merged call returned, as a state of their own.
    """

    state_type: type
    join: Callable[[list[tuple[Any, int]]], Any]
    key: Callable[[Any], Any] | None = None
    cut: Callable[[Any, int, int], Any] | None = None


@dataclass(frozen=True)
class Packing:
    """How calls of different sizes run as one packed call of the model's own submodules.

    Args:
        unsupported: why the model can't run packed calls now (other attention processors, hooks), or None.
        key: `key(arguments)`: (what must match for calls to pack, tokens per row), or None when this call can't
            pack; None: only the model's dedicated program packs its calls (it keys them itself).
        run: `run(model, calls, packed_attention, teacache)`: one output per call (its arguments by name), as the
            model returns it; `teacache[i]` holds call i's per-row TeaCache states or None.
        token_rows: `token_rows(model, calls)`: per token stream of the packed call (the `[tokens, ...]` or
            `[1, tokens, ...]` inputs its LoRA layers see), each token's row, rows numbered across the calls in
            order, or None when they don't map to rows (each call then runs apart); None: calls with per-request
            LoRA don't pack.
    """

    unsupported: Callable[[torch.nn.Module], "str | None"]
    key: Callable[[dict[str, Any]], "tuple[Any, int] | None"] | None
    run: Callable[[torch.nn.Module, list[dict[str, Any]], str, list], list[Any]]
    token_rows: Callable[[torch.nn.Module, list[dict[str, Any]]], "list[torch.Tensor] | None"] | None = None


@dataclass(frozen=True)
class ModelSupport:
    """How calls of one denoiser class share a forward.

    Args:
        row_lists: list arguments with one entry per row (Z-Image's per-image latents and captions).
        shared: tensors read as a whole or from row 0 only (FLUX.2's ids): calls merge only when they are equal.
        row_dims: tensors whose rows lie on another dimension (HiDream's Llama states: layers first).
        row_blocks: tensors (or tuples of them) with a whole number of entries per row along dim 0 (AnimateDiff's
            text and ControlNet residuals, per frame).
        padded: tensors whose rows are zero-padded to the longest of a merged call along this dimension, as the model
            masks the padding itself (ERNIE-Image's text, masked by its per-row lengths).
        timestep_rows: numbers or 0-d tensors the model broadcasts over rows: made per-row vectors, so calls at
            different timesteps merge.
        output_lists_are_rows: list outputs hold one entry per row (else a list is a tuple of outputs).
        refusal: a per-call reason that the call must run alone.
        row_states: per-row state objects by argument name (a KV cache carried between a request's calls).
        merge_key: `merge_key(arguments)`: a value calls must share to merge by rows, for a decision the model makes
            once for the whole batch (HunyuanVideo 1.5: text-to-video, read from all image embeds at once).
        trusted: equivalence tests prove the row rules; else each call structure's first merge is checked.
        teacache_coefficients: the model's TeaCache rescale polynomial, highest power first.
        packing: how calls of different sizes share one packed call; None: only equal sizes merge.
        lora_rows: every LoRA layer sees rows (or packed tokens) on dim 0, so per-request LoRA can apply per row.
        lora_token_rows: `lora_token_rows(arguments)`: for a model whose own forward concatenates its rows' tokens
            (Z-Image), per such token stream each token's row (as `Packing.token_rows`); None: rows on dim 0 only.
        teacache_forward: `forward(model, states, arguments)`: the call with one TeaCache state per row, as the
            model returns it, or None where the call has arguments it can't reproduce.
        lora_forward: `forward(model, arguments)`: for a model whose own forward has a LoRA layer input that maps to
            no rows (Qwen-Image 2.1's one t=0 timestep row per call), the call under per-row LoRA, as the model
            returns it; None: the model's forward.
        context_parallel: `plan(model)`: the model's context-parallel plan (diffusers' `_cp_plan` form) where
            diffusers gives the class none or one that doesn't fit this model's config, or a string saying why its
            blocks can't run split (it then runs on rank 0 alone); None: diffusers' own.
    """

    row_lists: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()
    row_dims: Mapping[str, int] = field(default_factory=dict)
    row_blocks: tuple[str, ...] = ()
    padded: Mapping[str, int] = field(default_factory=dict)
    timestep_rows: tuple[str, ...] = ()
    output_lists_are_rows: bool = False
    refusal: Refusal | None = None
    row_states: Mapping[str, RowState] = field(default_factory=dict)
    merge_key: Callable[[dict[str, Any]], Any] | None = None
    trusted: bool = False
    teacache_coefficients: tuple[float, ...] | None = None
    packing: Packing | None = None
    lora_rows: bool = False
    lora_token_rows: Callable[[dict[str, Any]], list[torch.Tensor]] | None = None
    teacache_forward: Callable[[torch.nn.Module, list, dict[str, Any]], Any] | None = None
    lora_forward: Callable[[torch.nn.Module, dict[str, Any]], Any] | None = None
    context_parallel: Callable[[torch.nn.Module], dict | str] | None = None


DEFAULT_SUPPORT = ModelSupport()
_SUPPORT: dict[type, ModelSupport] = {}
_REGISTERED_BY: dict[type, str] = {}  # class -> the module that registered it
# NOTE: the modules of this package that are shared machinery, not one denoiser class's rules
SHARED_MODULES = frozenset({"calls", "merge_checks", "denoiser_calls", "packing", "row_kernels"})


def register_model(model_class: type) -> Callable[[Callable[[], ModelSupport]], Callable[[], ModelSupport]]:
    """Register the `ModelSupport` that `factory` returns for `model_class` (and its subclasses)."""

    def decorate(factory: Callable[[], ModelSupport]) -> Callable[[], ModelSupport]:
        _SUPPORT[model_class] = factory()
        module = factory.__module__  # NOTE: a model module by its name here; a registration elsewhere by its own
        _REGISTERED_BY[model_class] = module[len(__name__) + 1:].split(".")[0] if module.startswith(f"{__name__}.") \
            else module
        return factory

    return decorate


def support_for(model: torch.nn.Module, through_compile: bool = False) -> ModelSupport:
    """The support of the model's class or nearest registered base class. `through_compile`: of the model a
    `torch.compile` wrapper holds (dedicated programs drive its submodules as they drive the model's own)."""
    _load_modules()
    if through_compile:
        model = getattr(model, "_orig_mod", model)
    for cls in type(model).__mro__:
        support = _SUPPORT.get(cls)
        if support is not None:
            return support
    return DEFAULT_SUPPORT


def registered_models() -> dict[type, str]:
    """Every registered class, with the model module that registered it."""
    _load_modules()
    return dict(_REGISTERED_BY)


def model_modules() -> list[str]:
    """The model modules: every module and folder of this package but the shared ones."""
    return sorted(module.name for module in pkgutil.iter_modules(__path__) if module.name not in SHARED_MODULES)


_loaded = False
_loading = False
# NOTE: requests planned in several threads at once must not see a half-filled registry while another loads it
_load_lock = threading.RLock()


def _load_modules() -> None:
    # NOTE: lazily, once: each module imports its diffusers model class (and registers it)
    global _loaded, _loading
    if _loaded:
        return
    with _load_lock:
        if _loaded or _loading:  # a model module's import asking again gets what is registered so far
            return
        _loading = True
        try:
            for name in model_modules():
                importlib.import_module(f"{__name__}.{name}")
            _loaded = True
        finally:
            _loading = False
