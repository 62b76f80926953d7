"""When a packed forward may stand in for a transformer's own forward, and when it must not."""

from __future__ import annotations

import logging

from ...module_scan import diffusers_hooks, marked_modules, own_attribute

logger = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()
SPLIT_PACKED = "_stepbatch_split_packed"
_SEQUENCE_HOOKS = ("cp_input---", "cp_output---")


def splits_sequence(hook_name: str) -> bool:
    """True for a context-parallel split or gather hook: stateless, so requests may share the model."""
    return hook_name.startswith(_SEQUENCE_HOOKS)


def unsupported_reason(transformer, processor_class: type | tuple[type, ...], called_whole: tuple[str, ...] = ()
                       ) -> str | None:
    """Why driving `transformer`'s submodules directly could differ from its forward (another attention
    processor than `processor_class` (or one of them), fused projections, diffusers hooks, a model offload hook),
    or None. Submodules named in `called_whole` run as the model runs them (called, not driven op by op): any
    processor of theirs is fine."""
    classes = processor_class if isinstance(processor_class, tuple) else (processor_class,)
    if own_attribute(transformer, "_hf_hook") is not None:
        return "the transformer has an accelerate offload hook (enable_model_cpu_offload)"
    whole = tuple(f"{name}." for name in called_whole)
    split_packed = own_attribute(transformer, SPLIT_PACKED) is not None
    for name, module in marked_modules(transformer):
        hooks = [hook for hook in diffusers_hooks(module) if not (split_packed and splits_sequence(hook))]
        if hooks:
            return f"diffusers hooks {sorted(hooks)} are registered on {name or 'the transformer'}"
        processor = own_attribute(module, "processor")
        if processor is not None and type(processor) not in classes and not name.startswith(whole):
            return f"{name} uses {type(processor).__name__}, not {' or '.join(c.__name__ for c in classes)}"
        if own_attribute(module, "fused_projections"):
            return f"{name} has fused QKV projections"
    return None


def extra_attention_kwargs(kwargs: dict | None, name: str) -> str | None:
    """Why sizes stay apart: attention kwargs beyond the LoRA `scale` (the packed forward skips the processor)."""
    extra = set(kwargs or {}) - {"scale"}
    return f"{name} {sorted(extra)} go to the attention processor" if extra else None


def reproduces_call(arguments: dict, reproduced: frozenset[str], attention_kwargs_name: str) -> bool:
    """No argument outside `reproduced` set and no attention kwargs beyond the LoRA `scale`."""
    if any(value is not None for name, value in arguments.items() if name not in reproduced):
        return False
    return extra_attention_kwargs(arguments.get(attention_kwargs_name), attention_kwargs_name) is None


def packing_refused(family: str, reason: str | None) -> bool:
    """True when `reason` keeps a request out of packed calls; says so in one info line per (family, reason)."""
    if reason is None:
        return False
    log_unpackable_once(family, reason)
    return True


def log_unpackable_once(family: str, reason: str) -> None:
    """One info line per (family, reason): the request runs in per-size batches instead of packed calls."""
    if (family, reason) not in _logged:
        _logged.add((family, reason))
        logger.info("%s: mixed-resolution packing is off because %s; requests of different sizes run in "
                    "separate batches", family, reason)
