"""A request's proxies for the models its pipeline call runs: planned in the caller's thread (`plan_proxies`: each
denoiser's LoRA, TeaCache and packed attention, each model's module walk) and installed on the request's view when
its call starts (`ProxyPlan.install`), on the views of the pipelines it calls too (combined pipelines: prior then
decoder). A proxied call goes to the engine as a work item (`work_items.py`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import DiffusionPipeline, ModelMixin
from diffusers.hooks import HookRegistry, group_offloading
from diffusers.models.cache_utils import CacheMixin
from diffusers.utils import torch_utils

from ...adapters.state import NOT_GIVEN, AdapterState, request_adapters
from ...cache import encoder_calls
from ...cache.prompt import PromptCache
from ...cache.teacache import TeaCacheConfig, TeaCacheState
from ...engine.batch import WorkItem
from ...models import support_for
from ...models.packing.support import packing_refused
from ...module_scan import PlannedModel, hook_registry, planned_model, unhooked_device, unhooked_dtype
from ..options import PlanContext
from ..registry import request_view
from .branch_pairs import BranchPairs
from .work_items import ATTENTION_KWARGS, HOLDERS, model_item

DENOISER_NAMES = ("transformer", "transformer_2", "unconditional_transformer", "unet", "prior", "decoder")
ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder")


@dataclass(frozen=True)
class DenoiserPlan:
    """What one denoiser's calls carry for a request."""

    adapters: AdapterState | None  # the request's LoRA, applied to its own rows; None: the model's own adapters
    teacache: TeaCacheConfig | None  # None: every call computes
    packed_attention: str | None  # how packed calls keep attention inside each row; None: never packed


@dataclass
class ProxyPlan:
    """A request's proxies as planned: per denoiser name what its calls carry, and what every proxy shares."""

    pipe: Any
    denoisers: dict[str, DenoiserPlan]
    packed_attention: str | None
    prompt_cache: PromptCache | None  # answers text-encoder calls identical to earlier ones
    walks: dict[int, PlannedModel]  # each model as the plan found it (modules, hooks), by id

    def install(self, view, submit: Callable[[WorkItem], None]) -> None:
        """The view's denoisers, text encoders and VAE become proxies whose calls go to `submit`."""
        _install(self.pipe, view, submit, self.denoisers, self.packed_attention, self.prompt_cache, self.walks)


def plan_proxies(pipe, args: dict[str, Any], context: PlanContext, denoisers: list[str]) -> ProxyPlan:
    """Raise where the request's `teacache=` or `adapters=` can't apply to its denoisers; else its proxies' plan."""
    options = context.options
    models = [getattr(pipe, name) for name in denoisers]
    if options.teacache is not None:
        if not any(support_for(model).teacache_forward for model in models):
            raise ValueError(f"teacache= is not supported for {type(pipe).__name__}: its denoiser "
                             f"({', '.join(type(model).__name__ for model in models)}) has no TeaCache forward")
        if any(getattr(model, "_hf_hook", None) is not None for model in models):
            raise ValueError("TeaCache calls the denoiser's blocks directly, which bypasses its model offload hook; "
                             "call pipe.to(device) instead of enable_model_cpu_offload(), or pass teacache=None")
    planned = {name: DenoiserPlan(_denoiser_adapters(model, args, context), options.teacache,
                                  packed_attention_for(model, options.packed_attention))
               for name, model in zip(denoisers, models)}
    shared = [getattr(pipe, name, None) for name in (*DENOISER_NAMES, *ENCODER_NAMES, "vae")]
    walks = {id(model): planned_model(model) for model in shared if isinstance(model, torch.nn.Module)}
    return ProxyPlan(pipe, planned, options.packed_attention, options.prompt_cache, walks)


def denoiser_names(pipe) -> list[str]:
    return [name for name in DENOISER_NAMES if isinstance(getattr(pipe, name, None), torch.nn.Module)]


def _denoiser_adapters(model, args: dict[str, Any], context: PlanContext) -> AdapterState | None:
    """The request's LoRA for `model` (its `adapters=`, or the active adapters), times its attention kwargs' scale;
    None where the model layer can't apply LoRA per row (calls then run with the model's own adapters)."""
    if not support_for(model).lora_rows:
        if context.adapters is not NOT_GIVEN:
            raise ValueError(f"adapters= is not supported for {type(model).__name__}: per-request LoRA needs rows "
                             "its layers can be mapped to; set the adapters on the pipeline with set_adapters")
        return None
    scale = next((args[name].get("scale") for name in ATTENTION_KWARGS if isinstance(args.get(name), dict)), None)
    return request_adapters(model, context.adapters, lora_scale=scale)


def _install(pipe, view, submit: Callable[[WorkItem], None], denoisers: dict[str, DenoiserPlan],
             packed_attention: str | None, prompt_cache: PromptCache | None, walks: dict[int, PlannedModel]) -> None:
    for name, sub_pipeline in list(view.__dict__.items()):
        if isinstance(sub_pipeline, DiffusionPipeline):
            sub_view = request_view(sub_pipeline)
            sub_denoisers = {name: DenoiserPlan(None, None, packed_attention_for(getattr(sub_pipeline, name),
                                                                                 packed_attention))
                             for name in denoiser_names(sub_pipeline)}
            _install(sub_pipeline, sub_view, submit, sub_denoisers, packed_attention, prompt_cache, walks)
            view.__dict__[name] = sub_view
    scheduler = getattr(view, "scheduler", None)
    for name, planned in denoisers.items():
        model = getattr(pipe, name)
        teacache = None
        if planned.teacache is not None and support_for(model).teacache_forward is not None:
            teacache = RequestTeaCache(planned.teacache, model, lambda: len(scheduler.timesteps))
        view.__dict__[name] = ModelProxy(model, {"__call__": "denoise"}, submit,
                                         functools.partial(_step_index, scheduler), planned.packed_attention,
                                         planned.adapters, teacache, walk=walks.get(id(model)))
    for name in ENCODER_NAMES:
        if isinstance(getattr(pipe, name, None), torch.nn.Module):
            model = getattr(pipe, name)
            view.__dict__[name] = ModelProxy(model, {"__call__": "encode"}, submit, cache=prompt_cache,
                                             walk=walks.get(id(model)))
    if isinstance(getattr(pipe, "vae", None), torch.nn.Module):
        view.__dict__["vae"] = ModelProxy(pipe.vae, {"encode": "vae_encode", "decode": "decode"}, submit,
                                          walk=walks.get(id(pipe.vae)))


def _step_index(scheduler) -> int | None:
    """The step the request's own scheduler is at (for progress and scheduling), if it tracks one."""
    if not hasattr(type(scheduler), "step_index"):
        return None
    return scheduler.step_index or 0  # None until the first scheduler.step: step 0


# NOTE: diffusers functions that walk a model's modules only to find accelerate or diffusers hooks (private names:
# a diffusers without them gets every module, the same answer)
_HOOK_LOOKUPS = frozenset(function.__code__ for function in (
    getattr(torch_utils, "get_module_execution_device", None),
    getattr(group_offloading, "_get_top_level_group_offload_hook", None)) if function is not None)


def _is_diffusers_reset(method: Any) -> bool:
    return getattr(method, "__func__", None) is CacheMixin._reset_stateful_cache


class ModelProxy:
    """Stands in for a model on a request's view: the intercepted calls go to `submit`, the rest to the model.

    `methods` maps a method name ("__call__" for the model itself) to the work kind its calls become;
    `packed_attention` (None: never pack) is how packed calls of several sizes keep attention inside each row;
    `adapters` is the request's LoRA, applied to its own rows (None: the model has no LoRA layers);
    `teacache` the request's TeaCache states; `cache` a `PromptCache` that answers calls identical to earlier ones
    (text encoders).
    """

    def __init__(self, module: torch.nn.Module, methods: dict[str, str], submit: Callable[[WorkItem], None],
                 step: Callable[[], int | None] = lambda: None, packed_attention: str | None = None,
                 adapters: AdapterState | None = None, teacache: RequestTeaCache | None = None,
                 cache: PromptCache | None = None, walk: PlannedModel | None = None):
        pairs = BranchPairs() if methods.get("__call__") == "denoise" else None
        self.__dict__.update(_module=module, _methods=methods, _submit=submit, _step=step,
                             _packed_attention=packed_attention, _adapters=adapters, _teacache=teacache,
                             _cache=cache if cache is not None and cache.max_bytes else None, _walk=walk,
                             _pairs=pairs)

    def modules(self) -> Iterator[torch.nn.Module]:
        """The model's modules, from the walk made when the request was planned. diffusers' device lookups
        (`get_module_execution_device`) walk them at every call for hooks only: those get the modules that could
        carry one, the same answer without a raised `AttributeError` per module."""
        if self._walk is None:
            return self._module.modules()
        if sys._getframe(1).f_code in _HOOK_LOOKUPS:
            return iter(self._walk.hook_carriers)
        return iter(self._walk.modules)

    @property
    def dtype(self) -> torch.dtype:
        """The model's `dtype`; for a diffusers model that carried no hook at plan, without diffusers' walk of
        every module for a dtype-casting hook."""
        if self._unhooked_diffusers_model():
            return unhooked_dtype(self._module)
        return self._module.dtype

    @property
    def device(self) -> torch.device:
        """The model's `device`; for a diffusers model that carried no hook at plan, without the walk for one."""
        if self._unhooked_diffusers_model():
            return unhooked_device(self._module)
        return self._module.device

    def _unhooked_diffusers_model(self) -> bool:
        cls = type(self._module)
        diffusers_answers = (getattr(cls, "dtype", None) is ModelMixin.dtype
                             and getattr(cls, "device", None) is ModelMixin.device)
        return self._walk is not None and not self._walk.hooked and diffusers_answers

    @property
    def __class__(self) -> type:  # NOTE: so that the pipeline's isinstance checks see the model's class
        return type(self._module)

    def __getattr__(self, name: str) -> Any:
        kind = self._methods.get(name)
        if kind is None:
            found = getattr(self._module, name)
            if name == "_reset_stateful_cache" and self._walk is not None and _is_diffusers_reset(found):
                return self._reset_planned_registries
            return found
        return functools.partial(self._intercept, kind, name)

    def _reset_planned_registries(self, recurse: bool = True) -> None:
        """diffusers' `_reset_stateful_cache` (every pipeline call ends with it), over the hook registries among
        the modules the plan's walk found able to carry one; diffusers walks every module for them."""
        HookRegistry.check_if_exists_or_initialize(self._module).reset_stateful_hooks(recurse=False)
        if recurse:
            for module in self._walk.hook_carriers:
                registry = hook_registry(module) if module is not self._module else None
                if registry is not None:
                    registry.reset_stateful_hooks(recurse=False)

    def __setattr__(self, name: str, value: Any) -> None:  # as without the proxy: the shared model changes
        setattr(self._module, name, value)

    def __delattr__(self, name: str) -> None:  # NOTE: accelerate removes offload hooks by `delattr(model, "_hf_hook")`
        delattr(self._module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kind = self._methods.get("__call__")
        if kind is None:
            return self._module(*args, **kwargs)
        return self._intercept(kind, "forward", *args, **kwargs)

    def _intercept(self, kind: str, method: str, *args: Any, **kwargs: Any) -> Any:
        key = None if self._cache is None else encoder_calls.call_key(
            self._module, method, args, kwargs, None if self._walk is None else self._walk.modules)
        if key is not None:
            output = encoder_calls.lookup(self._cache, key)
            if output is not None:
                return output
        output = self._submitted(kind, method, args, kwargs)
        if key is not None:
            encoder_calls.store(self._cache, key, output)
        return output

    def _submitted(self, kind: str, method: str, args: tuple, kwargs: dict) -> Any:
        step = self._step()
        pairs, predicted = self._pairs, None
        if pairs is not None:
            answered, output = pairs.answer(step, (args, kwargs))
            if answered:  # NOTE: its rows ran with the step's first call
                return output
            predicted = pairs.predict(step, (args, kwargs))
        teacache = self._teacache.state(step) if self._teacache is not None else None
        paired_state = self._teacache.state(step) if self._teacache is not None and predicted is not None else None
        item, holder = model_item(self._module, kind, method, args, kwargs, self._packed_attention, self._adapters,
                                  teacache, paired=predicted, paired_teacache=paired_state)
        if predicted is not None:
            undo = None if paired_state is None else self._teacache.giving_back(paired_state)
            if item.inputs[HOLDERS][-1] is not holder:
                pairs.expect(predicted, item.inputs[HOLDERS][-1], undo)
            else:  # NOTE: the two calls can't share rows (other shapes, say of the negative prompt): stop trying
                pairs.off = True
                if undo is not None:
                    undo()
        item.step = step
        self._submit(item)
        return holder.output


class RequestTeaCache:
    """One request's TeaCache states for one denoiser: one per call of a step (the CFG branches, in order)."""

    def __init__(self, config: TeaCacheConfig, model: torch.nn.Module, num_steps: Callable[[], int]):
        self.config, self.model, self.num_steps = config, model, num_steps
        self.states: dict[int, TeaCacheState | None] = {}
        self.step: int | None = None
        self.calls = 0

    def giving_back(self, state: TeaCacheState | None) -> Callable[[], None]:
        """An undo for the call that just took `state` (the last branch of the step): the state as it is now, and
        its branch, are given back (a predicted call that then didn't come)."""
        fields = dict(vars(state)) if state is not None else None
        step = self.step

        def undo() -> None:
            if state is not None:
                vars(state).update(fields)
            if self.step == step:
                self.calls -= 1

        return undo

    def state(self, step: int | None) -> TeaCacheState | None:
        if step != self.step:
            self.step, self.calls = step, 0
        branch, self.calls = self.calls, self.calls + 1
        if branch not in self.states:
            made = self.config.states(self.model, support_for(self.model).teacache_coefficients, self.num_steps(), 1)
            self.states[branch] = made[0] if made else None
        state = self.states[branch]
        if state is not None:
            state.step = step or 0
        return state


def packed_attention_for(module: torch.nn.Module, packed_attention: str | None) -> str | None:
    """The packed attention method for `module`'s calls, or None where its class has no packing or its state
    (attention processors, hooks) does not allow one now. NOTE: the check walks the model's modules."""
    packing = support_for(module).packing
    if packed_attention is None or packing is None or packing.key is None:
        return None
    return None if packing_refused(type(module).__name__, packing.unsupported(module)) else packed_attention


