"""Per-row LoRA: one denoiser forward whose rows each use their own adapters and weights.

diffusers keeps the active adapters and their weights on the model's peft layers (`pipe.set_adapters`), global
state that concurrent requests would overwrite. `per_row_lora` instead swaps, for one forward, every peft
`LoraLayer`'s forward for one that adds each row's own weighted sum of deltas:

    out[row] = base(x[row]) + sum_a  w[row, a] * unit_a * B_a(A_a(dropout(x[row])))

with `unit_a` peft's scale for weight 1 (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA). That is what
`set_adapters(names, weights)` and a plain forward compute for that row (peft's `scaling = weight * unit`, then
diffusers' `scale` from `joint_attention_kwargs`/`cross_attention_kwargs` multiplies it): pass `w = weight *
scale`. A row with no adapters gets the base layer exactly, and a layer whose adapters are fused (`fuse_lora`,
peft's `merged`) runs its (fused) base layer for every row, as peft does.

Rows are dim 0 of a layer input. For packed inputs (several requests' tokens concatenated into one sequence),
pass `token_rows`: per token stream, each token's row ([T] each; e.g. Flux's text, image and joint streams). A
layer input with the rows along dim 0 is weighted per row (per-request embeddings such as the timestep's); one
of shape [T, ...] or [1, T, ...] per token of the stream with T tokens. Streams whose lengths coincide but
whose tokens map to rows differently can't be told apart by shape: `streams_ambiguous` says so beforehand;
where every row carries the same adapters (one request's rows) that doesn't matter, as every token takes them.
A forward's steps on another arrangement of the rows say so with `lora_layout` (or `row_subset`).

>>> rows = [{"pixel": 1.0}, {}, {"ink": 0.7, "pixel": 0.3}]
>>> with per_row_lora(pipe.transformer, rows):
...     out = pipe.transformer(hidden_states=x, ...)          # x has 3 rows
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (adapter signature, layers)
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the RowPlan of its per-row forward


def lora_layers(model: torch.nn.Module) -> list[Any]:
    """The peft LoRA layers of `model` (cached per model and loaded-adapter set)."""
    signature = tuple(getattr(model, "peft_config", None) or ())
    cached = _LAYERS.get(model)
    if cached is not None and cached[0] == signature:
        return cached[1]
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft, no LoRA layers
        layers = []
    else:
        layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    _LAYERS[model] = (signature, layers)
    return layers


def unit_scale(layer: Any, adapter: str) -> float:
    """peft's scaling of `adapter` in `layer` at weight 1 (what `set_scale(adapter, 1.0)` sets)."""
    if layer.use_rslora.get(adapter, False):
        return layer.lora_alpha[adapter] / math.sqrt(layer.r[adapter])
    return layer.lora_alpha[adapter] / layer.r[adapter]


class _Use(NamedTuple):
    """Where one adapter applies in a layer input: all elements, a contiguous run or an index, and its weights."""

    adapter: str
    span: tuple[int, int] | None  # (start, length) along the row dim; None: every element (or see `index`)
    index: torch.Tensor | None  # element indices when they are not contiguous
    weight: float | torch.Tensor  # one weight for all of them, or one per element (float64)


def streams_ambiguous(num_rows: int, token_rows: Sequence[torch.Tensor]) -> bool:
    """True when two token streams (or a stream and the rows) have the same length but map to rows differently:
    their inputs can't be told apart by shape, so `per_row_lora` refuses them (run such rows per shape)."""
    return _ambiguous([torch.arange(num_rows), *token_rows])


def _ambiguous(mappings: Sequence[torch.Tensor]) -> bool:
    seen: dict[int, torch.Tensor] = {}
    for mapping in mappings:
        mapping = mapping.cpu()
        other = seen.setdefault(mapping.shape[0], mapping)
        if other is not mapping and not torch.equal(other, mapping):
            return True
    return False


class LoraLayout:
    """Each entry's row in a LoRA layer input, by its shape: `rows` for inputs with rows on dim 0, `token_rows` per
    packed token stream (`ambiguous`: two of equal length map to rows differently)."""

    def __init__(self, rows: torch.Tensor | Sequence[int], token_rows: Sequence[torch.Tensor] = ()):
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        mappings = [rows, *(t.cpu() for t in token_rows)]
        self.ambiguous = _ambiguous(mappings)
        self.num_rows = len(rows)
        self.lengths = [len(t) for t in mappings[1:]]
        self.by_length = {}  # element count -> each element's row
        for mapping in mappings:
            self.by_length.setdefault(int(mapping.shape[0]), mapping)


class RowPlan:
    """Which rows (or tokens) use which adapter with which weight, for one forward."""

    def __init__(self, rows: Sequence[Mapping[str, float]],
                 token_rows: torch.Tensor | Sequence[torch.Tensor] | None = None):
        self.num_rows = len(rows)
        self.rows = [dict(weights) for weights in rows]
        # NOTE: rows that all carry the same adapters may have ambiguous streams: every token takes the same
        self.uniform = all(weights == rows[0] for weights in rows[1:])
        streams = [] if token_rows is None else [token_rows] if isinstance(token_rows, torch.Tensor) else token_rows
        self.layout = self.check(LoraLayout(torch.arange(self.num_rows), streams))
        self.adapters: dict[str, list[tuple[int, float]]] = {}
        for row, weights in enumerate(rows):
            for name, weight in weights.items():
                if weight != 0:
                    self.adapters.setdefault(name, []).append((row, float(weight)))
        self._uses: dict[tuple, list[_Use]] = {}

    def uses(self, x: torch.Tensor) -> tuple[int, list[_Use]]:
        """(the row dim of layer input `x`, where each adapter applies in it)."""
        layout = self.layout
        if x.shape[0] in layout.by_length:  # rows, or packed tokens [tokens, ...]
            dim, count = 0, x.shape[0]
        elif x.dim() >= 3 and x.shape[0] == 1 and x.shape[1] in layout.by_length:  # packed tokens [1, tokens, ...]
            dim, count = 1, x.shape[1]
        else:
            expected = " or ".join([f"{layout.num_rows} rows"] + [f"{n} tokens" for n in layout.by_length
                                                                   if n != layout.num_rows])
            raise RuntimeError(f"a LoRA layer input of shape {tuple(x.shape)} matches neither {expected}")
        key = (layout, dim, count, x.device)  # NOTE: the layout itself, kept alive by the key (not its id)
        if key not in self._uses:
            mapping = layout.by_length[count]
            self._uses[key] = [use for name, uses in self.adapters.items()
                               if (use := self._use(name, uses, mapping, x.device)) is not None]
        return dim, self._uses[key]

    def check(self, layout: LoraLayout) -> LoraLayout:
        if layout.ambiguous and not self.uniform:
            raise ValueError(f"token streams of lengths {layout.lengths} (and {layout.num_rows} rows) can't be told "
                             "apart by shape; run these rows per shape")
        return layout

    @contextlib.contextmanager
    def laid_out(self, layout: LoraLayout) -> Iterator[None]:
        previous, self.layout = self.layout, self.check(layout)
        try:
            yield
        finally:
            self.layout = previous

    def narrowed(self, rows: Sequence[int]) -> contextlib.AbstractContextManager:
        return self.laid_out(LoraLayout(rows))

    def _use(self, name: str, uses: list[tuple[int, float]], mapping: torch.Tensor, device: Any) -> _Use | None:
        weight_of_row = torch.zeros(self.num_rows, dtype=torch.float64)
        for row, weight in uses:
            weight_of_row[row] = weight
        every = weight_of_row[mapping]  # an element takes its row's weight
        used = torch.nonzero(every, as_tuple=True)[0]
        if used.numel() == 0:  # NOTE: none of this layout's rows uses the adapter
            return None
        weights = every[used]
        weight = float(weights[0]) if bool((weights == weights[0]).all()) else weights.to(device)
        first, count = int(used[0]), used.numel()
        if count == every.numel():
            return _Use(name, None, None, weight)
        if int(used[-1]) - first + 1 == count:  # NOTE: contiguous (a request's rows): slice, don't gather
            return _Use(name, (first, count), None, weight)
        return _Use(name, None, used.to(device), weight)


def lora_active(model: torch.nn.Module) -> bool:
    """Whether `model` is inside a `per_row_lora` forward (its LoRA layers map inputs to rows)."""
    return model in _PLANS


def lora_uniform(model: torch.nn.Module) -> bool:
    """Whether every row of `model`'s running `per_row_lora` forward carries the same adapters (True outside one)."""
    plan = _PLANS.get(model)
    return plan is None or plan.uniform


@contextlib.contextmanager
def lora_layout(model: torch.nn.Module, layout: LoraLayout | None) -> Iterator[None]:
    """Inside a `per_row_lora` forward of `model`, LoRA layer inputs map to its rows by `layout` (a no-op outside
    one, or with None): for steps that run on another arrangement of the rows, such as a packed forward's blocks
    on some rows' token streams; `with lora_layout(model, LoraLayout(rows, token_rows)): ...`."""
    plan = _PLANS.get(model)
    with contextlib.nullcontext() if plan is None or layout is None else plan.laid_out(layout):
        yield


def _base_forward(layer: Any, plan: RowPlan, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return layer.base_layer(x, *args, **kwargs)


def _row_forward(layer: Any, plan: RowPlan, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    result = layer.base_layer(x, *args, **kwargs)
    if layer.merged:  # NOTE: as peft: a fused layer is the (fused) base model for every row
        return result
    dim, uses = plan.uses(x)
    for use in uses:
        name = use.adapter
        if name not in layer.lora_A:
            continue
        lora_A, lora_B, dropout = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
        if use.span is not None:
            part = x.narrow(dim, *use.span)
        else:
            part = x if use.index is None else x.index_select(dim, use.index)
        delta = lora_B(lora_A(dropout(part.to(lora_A.weight.dtype))))
        if isinstance(use.weight, float):
            delta = delta * (use.weight * unit_scale(layer, name))
        else:
            coef = (use.weight * unit_scale(layer, name)).to(delta.dtype)
            delta = delta * coef.view(*([1] * dim), -1, *([1] * (delta.dim() - dim - 1)))
        delta = delta.to(result.dtype)
        # NOTE: in place: `result` is the base layer's fresh output, and its backward needs only x and weights
        if use.span is not None:
            result.narrow(dim, *use.span).add_(delta)
        elif use.index is not None:
            result.index_add_(dim, use.index, delta)
        else:
            result.add_(delta)
    return result


@contextlib.contextmanager
def per_row_lora(model: torch.nn.Module, rows: Sequence[Mapping[str, float]],
                 token_rows: torch.Tensor | Sequence[torch.Tensor] | None = None) -> Iterator[None]:
    """Inside, every LoRA layer of `model` applies row r's adapters `rows[r]` ({name: weight x scale}).

    The swap is per forward and undone on exit; the layers' own active adapters and scalings are not read.
    Not thread-safe: the model must not run elsewhere meanwhile (the engine thread owns it).
    """
    layers = lora_layers(model)
    if not layers:
        yield
        return
    plan = RowPlan(rows, token_rows)
    if model in _PLANS:
        raise RuntimeError(f"{type(model).__name__} is already inside a per-row LoRA forward")
    # NOTE: no row uses an adapter: the base layers (fused adapters included, as peft runs a merged layer)
    forward = _row_forward if plan.adapters else _base_forward
    installed = []
    try:
        for layer in layers:
            if "forward" in vars(layer):
                raise RuntimeError(f"{type(layer).__name__} already has an instance forward (a hook?); per-row "
                                   "LoRA would bypass it")
            layer.forward = functools.partial(forward, layer, plan)
            installed.append(layer)
        _PLANS[model] = plan
        yield
    finally:
        _PLANS.pop(model, None)
        for layer in installed:
            vars(layer).pop("forward", None)


@contextlib.contextmanager
def row_subset(model: torch.nn.Module, rows: Sequence[int]) -> Iterator[None]:
    """`lora_layout` for a sub-batch: the body's LoRA layer inputs hold only `rows` of the forward's rows, on dim 0
    (the rows a step cache computes, one size's rows); `with row_subset(model, [0, 2]): block(hidden[[0, 2]])`."""
    plan = _PLANS.get(model)
    with contextlib.nullcontext() if plan is None else plan.narrowed(rows):
        yield
