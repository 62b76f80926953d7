"""Merged calls whose linear layers, activations and convolutions compute each request's rows as alone.

A CPU GEMM picks its kernel by the number of rows M: below a small M (a few rows) it takes another path than
for larger M, and the two round differently. A per-row embedding (`[rows, features]`) has M = 1 or 2 in a request's
solo call and M = 8 in a merged one, so its rows come out a float32 rounding apart; most pipelines carry that
rounding harmlessly, some amplify it past 1e-4 (Kandinsky's image-embedding UNets, Stable Cascade's prior). Above
that M, a row's result does not depend on M.

`solo_kernels(model, rows)` makes every `nn.Linear` of `model` compute, for one merged call, each request's rows
whose solo M would be below that limit as a call of their own; the others stay one call. The limit is measured
per layer shape, once: the smallest M from which a layer's rows equal those of a 16-row call.

Elementwise activations (`torch.nn` and transformers activation modules) have a like cause: a vectorised kernel
computes a tensor's last few elements (all of a small one) on a scalar path that rounds `exp` differently, so where
a request's elements sit in the merged tensor decides how they round. Where the requests' blocks would
not start at a whole vector step and the activation's two paths round apart (measured once per kind), each
request's block runs alone; at real model widths (multiples of the vector step) the call stays one.

Convolutions too: torch runs a small input of one row on its own kernel and several rows on oneDNN, which round
apart. Per layer and request shape a one-time probe says whether the request's rows come out of the merged call as
alone; where not, they run on that own kernel together (where it matches) or alone.

>>> with solo_kernels(pipe.unet, [2, 2, 2, 2]):    # four CFG requests of two rows each
...     out = pipe.unet(sample, t, encoder_hidden_states=text)
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

PROBE_ROWS = 16
PROBE_DRAWS = 4
_LINEARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (adapter signature, nn.Linear layers)
_limits: dict[tuple, int] = {}  # (in, out, dtype, device type, bias) -> the smallest row-invariant M
_batched: dict[tuple, bool] = {}  # (in, out, dtype, device type, bias, M) -> batched matmul == F.linear
_path_invariant_kinds: dict[tuple, bool] = {}  # ((class, repr), dtype) -> vector and scalar paths agree
_kinds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # activation -> (class, repr)
_row_blocks: dict[tuple, bool] = {}  # ((class, repr), dtype, blocks, size) -> `_row_per_block` is exact
_CLEAR_TIMING_S = 0.05  # a path that ran this long once is timed well enough to choose between two exact paths
_SINGLE_CHUNK = 32768  # ATen's grain size: elementwise kernels run smaller tensors as one chunk on one thread
# NOTE: ATen's vector loops step by two vector registers and leave the rest of a tensor to a scalar loop; 64
# elements span two AVX-512 registers of 16-bit floats, the widest such step.
VECTOR_SPAN = 64
_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")
_CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
_conv_paths: dict[tuple, str] = {}  # (layer config, rows, row shape, dtype) -> "together" | "own kernel" | "alone"


def linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's `nn.Linear` layers (peft's LoRA base layers and adapter matrices included), cached per model
    and loaded-adapter set."""
    return _layers(model)[0]


def activations(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's elementwise activation modules (`torch.nn`'s and transformers'), cached as `linears`."""
    return _layers(model)[1]


def convolutions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's 1-3d convolutions (subclasses too: their `_conv_forward` is what runs the kernel)."""
    return _layers(model)[2]


def _layers(model: torch.nn.Module) -> tuple[list, list, list]:
    signature = tuple(getattr(model, "peft_config", None) or ())
    cached = _LINEARS.get(model)
    if cached is None or cached[0] != signature:
        modules = list(model.modules())
        found = ([m for m in modules if type(m) is torch.nn.Linear], [m for m in modules if _is_activation(m)],
                 [m for m in modules if isinstance(m, _CONVOLUTIONS)])
        cached = _LINEARS[model] = (signature, found)
    return cached[1]


def _is_activation(module: torch.nn.Module) -> bool:
    cls = type(module)
    return (cls.__module__ in _ACTIVATION_MODULES and not module._modules
            and not issubclass(cls, torch.nn.MultiheadAttention))


def invariant_rows(layer: torch.nn.Linear) -> int:
    """The smallest M from which the layer's output rows don't depend on M (1: none do)."""
    weight = layer.weight
    key = (layer.in_features, layer.out_features, weight.dtype, weight.device.type, layer.bias is not None)
    if key not in _limits:
        limit = 1
        with torch.no_grad():
            for seed in range(PROBE_DRAWS):  # NOTE: on a narrow layer the two kernels agree for many inputs
                x = torch.randn(PROBE_ROWS, layer.in_features, generator=torch.Generator().manual_seed(seed))
                x = x.to(device=weight.device, dtype=weight.dtype)
                full = F.linear(x, weight, layer.bias)
                for m in range(PROBE_ROWS - 1, limit - 1, -1):
                    if not torch.equal(F.linear(x[:m], weight, layer.bias), full[:m]):
                        limit = m + 1
                        break
        _limits[key] = limit
    return _limits[key]


@contextlib.contextmanager
def solo_kernels(model: torch.nn.Module, rows: Sequence[int]) -> Iterator[None]:
    """Inside, `model`'s linear layers, activations and convolutions give each request (`rows[i]` consecutive
    rows on dim 0) its solo kernel.

    Not thread-safe: the model must not run elsewhere meanwhile (the engine thread owns it). Layers that already
    carry an instance `forward` (an accelerate hook) are left as they are.
    """
    if len(rows) < 2 or not all(r > 0 for r in rows) or _compiled(model):
        yield  # NOTE: a compiled model's kernels are its graph's; swapping its layers' forwards would recompile it
        return
    installed, rows, total = [], tuple(rows), sum(rows)
    try:
        for layer in linears(model):
            own = vars(layer)  # NOTE: set in the instance dict directly: `nn.Module.__setattr__` costs per layer
            if "forward" not in own and layer.weight.device.type == "cpu":
                own["forward"] = functools.partial(_forward, layer, rows, total)
                installed.append(layer)
        for layer in activations(model):
            own = vars(layer)
            if "forward" not in own:
                own["forward"] = functools.partial(_activation_forward, layer, rows, total)
                installed.append(layer)
        for layer in convolutions(model):
            own = vars(layer)
            if "forward" not in own and "_conv_forward" not in own and layer.weight.device.type == "cpu":
                own["_conv_forward"] = functools.partial(_conv_forward, layer, rows, total)
                installed.append(layer)
        yield
    finally:
        for layer in installed:
            vars(layer).pop("forward", None)
            vars(layer).pop("_conv_forward", None)


def row_kernels_of(*models: torch.nn.Module | None) -> Callable[[Sequence[int]], contextlib.AbstractContextManager]:
    """`WorkItem.row_kernels` for a call that runs these models (None entries skipped): `solo_kernels` on each."""
    present = [model for model in models if model is not None]
    return functools.partial(_solo_kernels_on, present)


@contextlib.contextmanager
def _solo_kernels_on(models: list[torch.nn.Module], rows: Sequence[int]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for model in models:
            stack.enter_context(solo_kernels(model, rows))
        yield


def _compiled(model: torch.nn.Module) -> bool:
    """Whether `model` runs a torch.compile graph (`torch.compile(model)` or `model.compile()`)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule) or getattr(model, "_compiled_call_impl", None) is not None


def _forward(layer: torch.nn.Linear, rows: tuple[int, ...], total: int, input: torch.Tensor) -> torch.Tensor:
    x = input  # NOTE: named as in `nn.Linear.forward`: some models pass it by keyword
    if x.dim() < 2 or x.shape[0] != total or x.numel() == 0:
        return F.linear(x, layer.weight, layer.bias)
    if not x.is_contiguous():
        # NOTE: a request's strided rows (a transposed view) go to the GEMM as they lie, while the merged tensor is
        # first copied into rows: two kernels. Each request's own view takes its solo path.
        return torch.cat([F.linear(block, layer.weight, layer.bias) for block in x.split(rows)])
    features = x.shape[-1]
    per_row = x.numel() // (total * features)  # the GEMM rows one batch row brings
    limit = invariant_rows(layer)
    if min(rows) * per_row >= limit:
        return F.linear(x, layer.weight, layer.bias)
    count = rows[0]
    if all(other == count for other in rows) and _batched_matches(layer, count * per_row):
        # requests of equal size, each below the limit: one batched call of their solo problems, in place
        problems = x.reshape(len(rows), count * per_row, features)
        return _batched_linear(layer, problems).reshape(*x.shape[:-1], layer.out_features)
    by_count: dict[int, list[int]] = {}  # a small request's row count -> the first rows of such requests
    grouped, first = [], 0
    for count in rows:
        if count * per_row < limit:
            by_count.setdefault(count, []).append(first)
        else:
            grouped.append(torch.arange(first, first + count))
        first += count
    pieces = [piece for count, starts in by_count.items() for piece in _solo_pieces(layer, x, count, starts)]
    if grouped:
        index = torch.cat(grouped).to(x.device)
        pieces.append((index, F.linear(x.index_select(0, index), layer.weight, layer.bias)))
    return _gathered(pieces, total)


def _gathered(pieces: list[tuple[torch.Tensor, torch.Tensor]], total: int) -> torch.Tensor:
    """One tensor of `total` rows from (row index, those rows' output) pieces."""
    first = pieces[0][1]
    out = first.new_empty(total, *first.shape[1:])
    for index, piece in pieces:
        out.index_copy_(0, index, piece)
    return out


def _solo_pieces(layer: torch.nn.Linear, x: torch.Tensor, count: int, starts: list[int]) -> list:
    """(row index, output) for requests of `count` rows each, computed as their solo calls compute them: one
    batched matmul of `count`-row problems where it gives the same bits as `F.linear` on each, else one call each."""
    index = torch.tensor([b + i for b in starts for i in range(count)], device=x.device)
    if len(starts) > 1 and _batched_matches(layer, count * (x[0].numel() // x.shape[-1])):
        problems = x.index_select(0, index).reshape(len(starts), -1, x.shape[-1])
        return [(index, _batched_linear(layer, problems).reshape(len(index), *x.shape[1:-1], layer.out_features))]
    return [(index[i * count:(i + 1) * count], F.linear(x[b:b + count], layer.weight, layer.bias))
            for i, b in enumerate(starts)]


def _batched_linear(layer: torch.nn.Linear, problems: torch.Tensor) -> torch.Tensor:
    weight = layer.weight.t().expand(problems.shape[0], -1, -1)
    if layer.bias is None:
        return torch.bmm(problems, weight)
    return torch.baddbmm(layer.bias.expand(problems.shape[0], problems.shape[1], -1), problems, weight)


def _batched_matches(layer: torch.nn.Linear, m: int) -> bool:
    """Whether a batched matmul of m-row problems gives exactly `F.linear`'s m-row results (measured once)."""
    weight = layer.weight
    key = (layer.in_features, layer.out_features, weight.dtype, weight.device.type, layer.bias is not None, m)
    if key not in _batched:
        with torch.no_grad():
            x = torch.randn(4, m, layer.in_features, generator=torch.Generator().manual_seed(0))
            x = x.to(device=weight.device, dtype=weight.dtype)
            alone = torch.stack([F.linear(problem, weight, layer.bias) for problem in x])
            _batched[key] = torch.equal(_batched_linear(layer, x), alone)
    return _batched[key]


def _activation_forward(layer: torch.nn.Module, rows: tuple[int, ...], total: int, input: torch.Tensor) -> torch.Tensor:
    forward = type(layer).forward
    x = input
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != total or x.device.type != "cpu":
        return forward(layer, x)
    per_row = x.numel() // total
    # NOTE: the last block's tail is the merged tensor's tail, as in its solo call
    if all(count * per_row % VECTOR_SPAN == 0 for count in rows[:-1]) or _path_invariant(layer, x.dtype):
        return forward(layer, x)
    count, inplace = rows[0], getattr(layer, "inplace", False)
    if (not inplace and all(other == count for other in rows)
            and _rows_match_blocks(layer, len(rows), count * per_row, x.dtype)):
        return _row_per_block(layer, x, len(rows), count * per_row).reshape(x.shape)
    parts = [forward(layer, block) for block in x.split(list(rows))]
    if inplace:  # NOTE: the blocks are views of x, changed in place as x would be
        return x
    return torch.cat(parts)


def _row_per_block(layer: torch.nn.Module, x: torch.Tensor, blocks: int, size: int) -> torch.Tensor:
    """The activation of `blocks` equal blocks of `x`, each laid out as a row of a padded buffer: the kernel's
    loop then runs row by row, with each block's own vector steps and scalar tail, instead of across blocks."""
    padded = x.new_empty(blocks, size + 1)[:, :size]
    padded.copy_(x.reshape(blocks, size))
    return type(layer).forward(layer, padded)


def _rows_match_blocks(layer: torch.nn.Module, blocks: int, size: int, dtype: torch.dtype) -> bool:
    """Whether `_row_per_block` gives each block its solo call's bits (measured once per kind and shape); only
    below the size from which a kernel may split one call's elements across threads."""
    if blocks * size > _SINGLE_CHUNK:
        return False
    key = (_kind(layer), dtype, blocks, size)
    if key not in _row_blocks:
        forward, generator = type(layer).forward, torch.Generator().manual_seed(0)
        matches = True
        with torch.no_grad():
            for _ in range(max(1, min(64, 8192 // (blocks * size)))):  # NOTE: 8k values: small blocks agree often
                x = (torch.randn(blocks * size, generator=generator) * 4).to(dtype)
                alone = torch.cat([forward(layer, block.clone()) for block in x.split(size)])
                matches = matches and torch.equal(_row_per_block(layer, x, blocks, size).reshape(-1), alone)
        _row_blocks[key] = matches
    return _row_blocks[key]


def _kind(layer: torch.nn.Module) -> tuple[type, str]:
    """The activation's class and settings (its `repr`, read once per layer: it costs per merged call)."""
    kind = _kinds.get(layer)
    if kind is None:
        kind = _kinds[layer] = (type(layer), repr(layer))
    return kind


def _path_invariant(layer: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether the activation's vectorised and scalar paths give the same bits (measured once per kind)."""
    key = (_kind(layer), dtype)
    if key not in _path_invariant_kinds:
        forward = type(layer).forward
        with torch.no_grad():
            x = (torch.randn(512, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
            vectorised = forward(layer, x.clone())
            scalar = torch.cat([forward(layer, element.clone()) for element in x.split(1)])
            _path_invariant_kinds[key] = torch.equal(vectorised, scalar)
    return _path_invariant_kinds[key]


def _conv_forward(layer: torch.nn.Module, rows: tuple[int, ...], total: int, input: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    conv = type(layer)._conv_forward
    if input.shape[0] != total:
        return conv(layer, input, weight, bias)
    paths = {count: _conv_path(layer, count, total, input, weight, bias) for count in set(rows)}
    taken = set(paths.values())
    if taken == {"together"}:
        return conv(layer, input, weight, bias)
    if taken == {"own kernel"}:  # NOTE: every row on it, in order: nothing to select or gather
        return _own_kernel(layer, input.contiguous(), weight, bias)
    if taken == {"alone"}:
        return torch.cat([conv(layer, part, weight, bias) for part in input.split(list(rows))])
    shared: dict[str, list[int]] = {}  # "together" / "own kernel" -> the rows that take it in one call
    pieces, first = [], 0
    for count in rows:
        if paths[count] == "alone":
            index = torch.arange(first, first + count, device=input.device)
            pieces.append((index, conv(layer, input[first:first + count], weight, bias)))
        else:
            shared.setdefault(paths[count], []).extend(range(first, first + count))
        first += count
    for path, indices in shared.items():
        index = torch.tensor(indices, device=input.device)
        part = input.index_select(0, index)
        run = conv(layer, part, weight, bias) if path == "together" else _own_kernel(layer, part, weight, bias)
        pieces.append((index, run))
    return _gathered(pieces, total)


def _conv_path(layer: torch.nn.Module, count: int, total: int, input: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> str:
    """How a request of `count` rows gets its solo call's bits in a merged call of `total` rows (measured once per
    shape and total: oneDNN picks its kernel by the batch too)."""
    key = (type(layer), layer.stride, layer.padding, layer.dilation, layer.groups, layer.padding_mode,
           tuple(weight.shape), bias is not None, count, total, tuple(input.shape[1:]), input.dtype)
    if key not in _conv_paths:
        conv = type(layer)._conv_forward
        with torch.no_grad():
            # NOTE: the merged call's own rows, and enough blocks for 8k values: on a few channels the two kernels
            # agree for most inputs
            blocks = max(3, -(-total // count), min(256, -(-8192 // input[:count].numel())))
            x = torch.randn(blocks * count, *input.shape[1:], generator=torch.Generator().manual_seed(0))
            x = x.to(input.dtype)
            alone = torch.cat([conv(layer, part, weight, bias) for part in x.split(count)])
            if torch.equal(conv(layer, x, weight, bias), alone):
                _conv_paths[key] = "together"
            elif (_has_own_kernel(layer) and torch.equal(_own_kernel(layer, x, weight, bias), alone)
                  and _own_kernel_is_faster(layer, conv, x[:2 * count], weight, bias)):
                _conv_paths[key] = "own kernel"
            else:  # NOTE: also where torch's own kernel is exact but slower than a call per request (oneDNN)
                _conv_paths[key] = "alone"
    return _conv_paths[key]


def _own_kernel_is_faster(layer: torch.nn.Module, conv, pair: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> bool:
    """Whether torch's own kernel on two requests' rows beats one call per request (best of up to three each). Both
    give the solo bits here; a one-row call may still take oneDNN, which is faster than torch's own kernel."""
    def best(run) -> float:
        times: list[float] = []
        while len(times) < 3 and sum(times) < _CLEAR_TIMING_S:  # NOTE: one long run is timed clearly enough
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return min(times)

    half = pair.shape[0] // 2
    own = best(lambda: _own_kernel(layer, pair, weight, bias))
    apart = best(lambda: [conv(layer, part, weight, bias) for part in (pair[:half], pair[half:])])
    return own < apart


def _has_own_kernel(layer: torch.nn.Module) -> bool:
    """Whether torch's plain (not oneDNN) kernel takes this layer: 2d or 3d, padding by sizes, no groups or
    dilation."""
    return (isinstance(layer, (torch.nn.Conv2d, torch.nn.Conv3d)) and not isinstance(layer.padding, str)
            and layer.groups == 1 and all(d == 1 for d in layer.dilation))


def _own_kernel(layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """The convolution on torch's plain kernel, the one a small one-row call takes."""
    kernel = torch.ops.aten.slow_conv3d if isinstance(layer, torch.nn.Conv3d) else torch.ops.aten.thnn_conv2d
    padding = list(layer.padding)
    if layer.padding_mode != "zeros":  # NOTE: as `_conv_forward` does: pad first, then convolve without padding
        x = F.pad(x, layer._reversed_padding_repeated_twice, mode=layer.padding_mode)
        padding = [0] * len(padding)
    return kernel(x, weight, list(weight.shape[2:]), bias, list(layer.stride), padding)
