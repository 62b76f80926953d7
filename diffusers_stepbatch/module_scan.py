"""Cheap module scans for a request's prologue.

Every request asks what its pipeline looks like now (execution device, hooks, attention processors), since a user
may move, offload, hook or patch it between calls; with N callers these scans run one after another under the GIL.
They read the modules' own dicts instead of `nn.Module.__getattr__`, walk each model once per request
(`scan_scope`, `marked_modules`), and remember the execution device while nothing it depends on changed.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch

_ACCELERATE_HOOK = "_hf_hook"  # accelerate's offload hooks (enable_model_cpu_offload, sequential offload)
_DIFFUSERS_HOOKS = "_diffusers_hook"  # diffusers' HookRegistry (group offloading, caches, layer skipping)


def walk(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """`module.named_modules()`: the same (name, module) pairs in the same order, without its generator chain (the
    reference the census is tested against)."""
    seen: set[int] = set()
    stack = [("", module)]
    while stack:
        name, current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield name, current
        children = current._modules
        if children:
            stack.extend((f"{name}.{key}" if name else key, child)
                         for key, child in reversed(children.items()) if child is not None)


def own_attribute(module: torch.nn.Module, name: str) -> Any:
    """`getattr(module, name, None)`, read from the instance's dicts first (no `__getattr__` raise-and-catch)."""
    value = module.__dict__.get(name)
    if value is None:
        value = module._modules.get(name)
    if value is None and name not in module.__dict__:
        value = getattr(type(module), name, None)
        if hasattr(value, "__get__"):  # NOTE: a property or method of the class: its value on this instance
            value = getattr(module, name, None)
    return value


# NOTE: what the scans ask about; a module with none of these (nor its class) answers every scan with "nothing".
_WATCHED = (_ACCELERATE_HOOK, _DIFFUSERS_HOOKS, "processor", "fused_projections")
_marked_classes: dict[type, bool] = {}
_scope: ContextVar[dict[int, tuple[torch.nn.Module, "Census"]] | None] = ContextVar("module_scan_scope", default=None)


def _class_marked(cls: type) -> bool:
    """Whether every instance of `cls` is marked: the class defines a watched name or `get_processor`."""
    marked = _marked_classes.get(cls)
    if marked is None:
        marked = _marked_classes[cls] = any(hasattr(cls, name) for name in (*_WATCHED, "get_processor"))
    return marked


class Census(NamedTuple):
    """One walk of a model: the modules a scan could see (`marked`, named) and every module, in walk order."""

    marked: tuple[tuple[str, torch.nn.Module], ...]
    modules: tuple[torch.nn.Module, ...]


def _census(model: torch.nn.Module) -> Census:
    # NOTE: `walk`'s loop, naming only the marked few: formatting every dotted name was a quarter of the walk.
    marked, modules, classes = [], [], _marked_classes
    seen: set[int] = set()
    stack: list[tuple[tuple | None, torch.nn.Module]] = [(None, model)]
    while stack:
        path, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        modules.append(module)
        own, children = module.__dict__, module._modules
        marked_class = classes.get(type(module))
        if marked_class is None:
            marked_class = _class_marked(type(module))
        if (marked_class or _ACCELERATE_HOOK in own or _DIFFUSERS_HOOKS in own or "processor" in own
                or "fused_projections" in own or "processor" in children):
            marked.append((path, module))
        if children:
            stack.extend(((path, key), child) for key, child in reversed(children.items()) if child is not None)
    return Census(tuple((_dotted(path), module) for path, module in marked), tuple(modules))


def _dotted(path: tuple | None) -> str:
    """A `_census` path as `named_modules()` names it ("" for the model itself)."""
    keys = []
    while path is not None:
        path, key = path
        keys.append(key)
    return ".".join(reversed(keys))


def _scoped_census(model: torch.nn.Module) -> Census:
    """The model's census; within a `scan_scope`, one walk per model."""
    scope = _scope.get()
    if scope is None:
        return _census(model)
    found = scope.get(id(model))
    if found is None or found[0] is not model:
        found = scope[id(model)] = (model, _census(model))
    return found[1]


def marked_modules(model: torch.nn.Module) -> tuple[tuple[str, torch.nn.Module], ...]:
    """The (name, module) pairs of `model`, in `named_modules()` order, that can carry an accelerate or diffusers
    hook, an attention processor (`processor`, `get_processor`) or `fused_projections`; every other module would
    answer each scan here with "nothing". Within a `scan_scope`, the walk runs once per model."""
    return _scoped_census(model).marked


def all_modules(model: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """`tuple(model.modules())`, from the same walk as `marked_modules` within a `scan_scope`."""
    return _scoped_census(model).modules


@contextmanager
def scan_scope() -> Iterator[None]:
    """One request's prologue: its scans share one walk per model (what a model looks like is read once, at
    submit). Nested scopes share the outer one.

    >>> with scan_scope():
    ...     request = plan(pipe, call_args)
    """
    if _scope.get() is not None:
        yield
        return
    token = _scope.set({})
    try:
        yield
    finally:
        _scope.reset(token)


def hook_registry(module: torch.nn.Module) -> Any:
    """The diffusers `HookRegistry` on `module` itself, or None."""
    return own_attribute(module, _DIFFUSERS_HOOKS)


def diffusers_hooks(module: torch.nn.Module) -> dict[str, Any]:
    """The hooks of the diffusers `HookRegistry` on `module` itself, by name ({} without a registry)."""
    registry = hook_registry(module)
    return {} if registry is None else registry.hooks


def carries_hooks(module: torch.nn.Module) -> bool:
    """Whether an accelerate or diffusers hook sits on `module` or any of its submodules.

    NOTE: an empty `HookRegistry` (a plain Flux call's `cache_context` leaves one) holds no hook, and must not send
    every later request to diffusers' slow `_execution_device` walk.
    """
    return any(_ACCELERATE_HOOK in sub.__dict__ or diffusers_hooks(sub) for _, sub in marked_modules(module))


class PlannedModel(NamedTuple):
    """A model as a request's plan found it: its modules in walk order, those that could carry a hook (the
    marked ones), and whether any carries one."""

    modules: tuple[torch.nn.Module, ...]
    hook_carriers: tuple[torch.nn.Module, ...]
    hooked: bool


def planned_model(model: torch.nn.Module) -> PlannedModel:
    """`all_modules`, `marked_modules` and `carries_hooks` of `model`, from one walk within a `scan_scope`."""
    carriers = tuple(module for _, module in marked_modules(model))
    return PlannedModel(all_modules(model), carriers, carries_hooks(model))


def unhooked_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """diffusers' `ModelMixin.dtype` for a model that carries no hook, without its hook walk: the first floating
    parameter outside `_keep_in_fp32_modules`, else the first floating buffer, else the last tensor's dtype."""
    keep_fp32 = getattr(model, "_keep_in_fp32_modules", None) or ()
    last = None
    for name, parameter in model.named_parameters():
        last = parameter.dtype
        if parameter.is_floating_point() and not any(kept in name for kept in keep_fp32):
            return parameter.dtype
    for buffer in model.buffers():
        last = buffer.dtype
        if buffer.is_floating_point():
            return buffer.dtype
    return last


def unhooked_device(model: torch.nn.Module) -> torch.device:
    """diffusers' `ModelMixin.device` for a model that carries no hook: its first parameter's or buffer's device."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return model.device if first is None else first.device


def _first_tensor_device(module: torch.nn.Module) -> tuple[str | None, str | None]:
    parameter = next(module.parameters(), None)
    buffer = next(module.buffers(), None) if parameter is None else None
    return (str(parameter.device) if parameter is not None else None,
            str(buffer.device) if buffer is not None else None)


def _models(pipe: Any) -> Iterator[tuple[str, torch.nn.Module]]:
    """The registered models, from the instance dict (`getattr` of a plain config entry warns in diffusers)."""
    for name in pipe.config:
        if not name.startswith("_"):
            component = pipe.__dict__.get(name)
            if isinstance(component, torch.nn.Module):
                yield name, component


class _ExecutionDevices:
    """`pipe._execution_device`, remembered per pipeline while its components and their first tensors' devices
    stay the same; a hook anywhere (offloading, caches) sends the question to diffusers itself, every time."""

    def __init__(self):
        self._memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __call__(self, pipe: Any) -> torch.device:
        from diffusers import DiffusionPipeline

        cls = type(pipe)
        if (cls._execution_device is not DiffusionPipeline._execution_device
                or cls.device is not DiffusionPipeline.device):
            return pipe._execution_device  # a pipeline that answers in its own way
        signature = []
        for name, component in _models(pipe):
            if carries_hooks(component):
                return pipe._execution_device
            signature.append((name, id(component), _first_tensor_device(component)))
        signature = tuple(signature)
        with self._lock:
            memo = self._memo.get(pipe)
        if memo is not None and memo[0] == signature:
            return memo[1]
        device = pipe._execution_device
        with self._lock:
            self._memo[pipe] = (signature, device)
        return device


execution_device = _ExecutionDevices()
