"""The prologue's cheap module scans give diffusers' and torch's own answers, and follow changes to the pipeline."""

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from diffusers.hooks import apply_group_offloading

from diffusers_stepbatch.module_scan import all_modules, carries_hooks, execution_device, own_attribute, walk
from diffusers_stepbatch.testing import FluxSize, tiny_flux_pipeline, tiny_sd3_pipeline, tiny_sdxl_pipeline

PIPELINES = {
    "flux": lambda: tiny_flux_pipeline(size=FluxSize(num_layers=1, num_single_layers=2)),
    "flux-deeper-vae": lambda: tiny_flux_pipeline(vae_blocks=4),
    "sd3": tiny_sd3_pipeline,
    "sdxl": tiny_sdxl_pipeline,
}


def modules_of(pipe):
    return [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]


@pytest.mark.parametrize("family", PIPELINES)
def test_walk_and_all_modules_match_torch(family):
    pipe = PIPELINES[family]()
    for model in modules_of(pipe):
        named = [(name, id(module)) for name, module in model.named_modules()]
        assert [(name, id(module)) for name, module in walk(model)] == named
        assert [id(module) for module in all_modules(model)] == [id(module) for module in model.modules()]


def test_walk_yields_a_shared_submodule_once_as_torch_does():
    shared = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared, torch.nn.Sequential(shared))
    assert [name for name, _ in walk(model)] == [name for name, _ in model.named_modules()] == ["", "0", "1", "3"]
    assert [id(module) for module in all_modules(model)] == [id(module) for module in model.modules()]


def test_own_attribute_reads_what_getattr_reads():
    pipe = tiny_flux_pipeline()
    attention = pipe.transformer.transformer_blocks[0].attn
    for name in ("processor", "fused_projections", "_diffusers_hook", "not_there", "training"):
        assert own_attribute(attention, name) is getattr(attention, name, None)
    class WithProperty(torch.nn.Module):
        flag = True

        @property
        def processor(self):
            return "from a property"

    with_property = WithProperty()
    assert own_attribute(with_property, "processor") == "from a property"
    assert own_attribute(with_property, "flag") is True
    module_processor = torch.nn.Linear(1, 1)  # a processor that is an nn.Module lives in _modules
    attention.processor = module_processor
    assert own_attribute(attention, "processor") is module_processor is attention.processor


@pytest.mark.parametrize("family", PIPELINES)
def test_execution_device_follows_moves(family):
    pipe = PIPELINES[family]()
    assert execution_device(pipe) == pipe._execution_device == torch.device("cpu")
    for model in modules_of(pipe):  # the first component's device decides; move each in turn and back
        model.to("meta")
        assert execution_device(pipe) == pipe._execution_device
        model.to_empty(device="cpu")
    assert execution_device(pipe) == pipe._execution_device == torch.device("cpu")


class _ExecutionDeviceHook(ModelHook):
    def __init__(self, device):
        self.execution_device = device


def test_execution_device_asks_diffusers_when_an_offload_hook_is_present():
    pipe = tiny_flux_pipeline()
    assert execution_device(pipe) == torch.device("cpu")  # remembered from here on, while nothing changes
    first = modules_of(pipe)[0]
    inner = next(m for m in first.modules() if m is not first)
    add_hook_to_module(first, _ExecutionDeviceHook(None))
    add_hook_to_module(inner, _ExecutionDeviceHook("meta"))  # as enable_sequential_cpu_offload's hooks say
    assert carries_hooks(first)
    assert pipe._execution_device == torch.device("meta")
    assert execution_device(pipe) == torch.device("meta")
    remove_hook_from_module(first, recurse=True)
    assert not carries_hooks(first)
    assert execution_device(pipe) == pipe._execution_device == torch.device("cpu")


def test_execution_device_with_group_offloading_is_diffusers_answer():
    pipe = tiny_flux_pipeline()
    execution_device(pipe)
    apply_group_offloading(pipe.transformer, onload_device=torch.device("cpu"), offload_type="block_level",
                           num_blocks_per_group=1)
    assert carries_hooks(pipe.transformer)
    assert execution_device(pipe) == pipe._execution_device


@pytest.mark.parametrize("family", ["flux", "flux-deeper-vae"])
def test_the_empty_hook_registry_a_plain_call_leaves_is_no_hook(family, monkeypatch):
    import diffusers.hooks.group_offloading as group_offloading
    from diffusers.hooks import FirstBlockCacheConfig

    pipe = PIPELINES[family]()
    pipe.set_progress_bar_config(disable=True)
    pipe(prompt="a red circle", height=32, width=32, num_inference_steps=2, output_type="pt")
    registry = pipe.transformer.__dict__.get("_diffusers_hook")
    assert registry is not None and not registry.hooks  # diffusers' cache_context left it, empty
    assert not carries_hooks(pipe.transformer)
    asked = []
    onload_device = group_offloading._get_group_onload_device
    monkeypatch.setattr(group_offloading, "_get_group_onload_device",
                        lambda module: asked.append(module) or onload_device(module))
    assert execution_device(pipe) == torch.device("cpu")
    asked.clear()
    assert execution_device(pipe) == torch.device("cpu") and asked == []  # remembered: no walk per request
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.8))  # a hook in that registry now
    assert carries_hooks(pipe.transformer)
    asked.clear()
    assert execution_device(pipe) == pipe._execution_device and pipe.transformer in asked  # diffusers answers


# ---------------------------------------------------------------------------------------------------------------
# One walk per model and request: the scans read `marked_modules`, which must hold every module they could see.
from accelerate.hooks import ModelHook as _ModelHook  # noqa: E402
from diffusers import FirstBlockCacheConfig  # noqa: E402
from diffusers.hooks import HookRegistry  # noqa: E402
from diffusers.hooks import ModelHook as DiffusersHook  # noqa: E402
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor  # noqa: E402

import diffusers_stepbatch.module_scan as module_scan  # noqa: E402
from diffusers_stepbatch import StepBatched  # noqa: E402
from diffusers_stepbatch.adapters.ip_adapter import ip_processors  # noqa: E402
from diffusers_stepbatch.module_scan import marked_modules, scan_scope  # noqa: E402
from diffusers_stepbatch.models.packing.support import unsupported_reason  # noqa: E402
from diffusers_stepbatch.programs.cache_hooks import _stateful_hooks  # noqa: E402
from diffusers_stepbatch.testing import add_random_ip_adapter  # noqa: E402

from .references import TOLERANCE, count_forwards, max_diff, seeded  # noqa: E402

_WATCHED = ("_hf_hook", "_diffusers_hook", "processor", "fused_projections")


def _seen_by_a_scan(module) -> bool:
    """What some scan reads off a module: a watched attribute that is set, or an attention processor getter."""
    return hasattr(type(module), "get_processor") or any(own_attribute(module, name) is not None for name in _WATCHED)


class _StatefulHook(DiffusersHook):
    _is_stateful = True


class _Leaf(torch.nn.Linear):
    fused_projections = True  # a class attribute: every instance is seen by the fused-projections scan


def _mutate(pipe, change: str) -> None:
    """Each way the scans' facts can change on a built pipeline, on a module deep inside a model."""
    transformer = pipe.transformer
    leaf = transformer.transformer_blocks[0].ff.net[2]  # a Linear: no children, nothing watched
    if change == "accelerate hook on a leaf":
        add_hook_to_module(leaf, _ModelHook())
    elif change == "diffusers registry on a leaf":
        HookRegistry.check_if_exists_or_initialize(leaf).register_hook(_StatefulHook(), "test-hook")
    elif change == "module processor":  # an nn.Module processor lives in `_modules`, not `__dict__`
        transformer.transformer_blocks[0].attn.processor = torch.nn.Identity()
        leaf.processor = torch.nn.Identity()
    elif change == "fused flag on a leaf":
        leaf.fused_projections = True
    elif change == "marked class":
        transformer.transformer_blocks[0].ff.net[2] = _Leaf(leaf.in_features, leaf.out_features)
    elif change == "fused QKV projections":
        transformer.fuse_qkv_projections()
    elif change == "first-block cache":
        transformer.enable_cache(FirstBlockCacheConfig(threshold=0.8))
    elif change == "IP-Adapter":
        add_random_ip_adapter(pipe)
    elif change != "none":
        raise AssertionError(change)


CHANGES = ["none", "accelerate hook on a leaf", "diffusers registry on a leaf", "module processor",
           "fused flag on a leaf", "marked class", "fused QKV projections", "first-block cache", "IP-Adapter"]


def _every_module(model):
    """A census that marks every module: each scan then reads every module, as a scan of its own would."""
    walked = tuple(walk(model))
    return module_scan.Census(walked, tuple(module for _, module in walked))


@pytest.mark.parametrize("size", [FluxSize(num_layers=1, num_single_layers=2), FluxSize()])
@pytest.mark.parametrize("change", CHANGES)
def test_marked_modules_hold_every_module_a_scan_sees_in_walk_order(size, change):
    pipe = tiny_flux_pipeline(size=size)
    _mutate(pipe, change)
    for model in modules_of(pipe):
        marked = [(name, id(module)) for name, module in marked_modules(model)]
        walked = [(name, id(module)) for name, module in walk(model)]
        assert [pair for pair in walked if pair in set(marked)] == marked  # walk order, names as torch gives them
        seen = [(name, id(module)) for name, module in walk(model) if _seen_by_a_scan(module)]
        assert [pair for pair in marked if pair in set(seen)] == seen
        assert len(marked) < len(walked)  # the point: most modules are skipped


@pytest.mark.parametrize("change", CHANGES)
def test_scans_over_marked_modules_answer_as_scans_over_every_module(change, monkeypatch):
    pipe = tiny_flux_pipeline(size=FluxSize(num_layers=2, num_single_layers=1))
    _mutate(pipe, change)

    def answers():
        transformer = pipe.transformer
        return (unsupported_reason(transformer, FluxAttnProcessor),
                [carries_hooks(model) for model in modules_of(pipe)],
                [id(hook) for hook in _stateful_hooks(transformer)],
                [id(processor) for processor in ip_processors(transformer)])

    census = answers()
    monkeypatch.setattr(module_scan, "_census", _every_module)
    assert answers() == census
    if change != "none":  # each change is visible to some scan
        assert census != (None, [False] * len(modules_of(pipe)), [], [])


def test_one_walk_per_model_per_submit_and_the_next_submit_sees_changes(monkeypatch):
    pipe = tiny_flux_pipeline(guidance_embeds=True, size=FluxSize(num_layers=2, num_single_layers=2))
    pipe.set_progress_bar_config(disable=True)
    walks = []
    census = module_scan._census
    monkeypatch.setattr(module_scan, "_census", lambda model: walks.append(id(model)) or census(model))
    call = dict(prompt="a red circle", height=32, width=32, num_inference_steps=3, output_type="pt", seed=0)
    plain = pipe(**seeded(call)).images
    with StepBatched(pipe) as sb:
        walks.clear()
        got = sb.submit(**seeded(call)).result(timeout=60).images
        scanned = len(walks)
        assert 0 < scanned == len(set(walks)) <= len(modules_of(pipe))
        assert max_diff(got, plain) <= TOLERANCE
        # diffusers' cache hook, enabled between two calls on the same wrapper: the next request runs hooked
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.8))
        cached = pipe(**seeded(call)).images
        assert max_diff(cached, plain) > 2 * TOLERANCE
        sizes, handle = count_forwards(pipe.transformer)
        futures = [sb.submit(**seeded(call)) for _ in range(2)]
        hooked = [future.result(timeout=60).images for future in futures]
        handle.remove()
        assert max(max_diff(image, cached) for image in hooked) <= TOLERANCE
        assert max(sizes) == 1  # hooked requests run alone
        pipe.transformer.disable_cache()
        assert max_diff(sb(**seeded(call)).images, plain) <= TOLERANCE


def test_a_scope_reads_each_model_once_and_a_new_scope_reads_it_again():
    pipe = tiny_flux_pipeline()
    leaf = pipe.transformer.transformer_blocks[0].ff.net[2]
    with scan_scope():
        assert not carries_hooks(pipe.transformer)
        add_hook_to_module(leaf, _ModelHook())
        with scan_scope():  # nested: the outer scope's reading
            assert not carries_hooks(pipe.transformer)
        assert carries_hooks(leaf)  # another model: walked now
    with scan_scope():
        assert carries_hooks(pipe.transformer)
    assert carries_hooks(pipe.transformer)  # outside a scope: every call walks


# ---------------------------------------------------------------------------------------------------------------
# A request's model proxies answer `dtype` / `device` without diffusers' hook walk when the plan found no hook.
from diffusers_stepbatch.module_scan import planned_model, unhooked_device, unhooked_dtype  # noqa: E402


class _KeepsFp32(torch.nn.Module):
    _keep_in_fp32_modules = ["norm"]

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)
        self.proj = torch.nn.Linear(4, 4)


class _BuffersOnly(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.register_buffer("steps", torch.arange(3))
        self.register_buffer("scale", torch.ones(2, dtype=dtype))


@pytest.mark.parametrize("family", PIPELINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unhooked_dtype_and_device_are_diffusers_answers(family, dtype):
    for model in modules_of(PIPELINES[family]()):
        model.to(dtype)
        assert unhooked_dtype(model) == model.dtype == dtype
        assert unhooked_device(model) == model.device


def test_unhooked_dtype_follows_diffusers_rules_for_kept_fp32_modules_and_buffers():
    from diffusers.models.modeling_utils import get_parameter_dtype

    kept = _KeepsFp32()
    kept.proj.to(torch.bfloat16)
    assert unhooked_dtype(kept) == get_parameter_dtype(kept) == torch.bfloat16  # the fp32 norm comes first
    for dtype in (torch.float16, torch.float64):
        buffers = _BuffersOnly(dtype)
        assert unhooked_dtype(buffers) == get_parameter_dtype(buffers) == dtype


def test_proxies_answer_the_planned_dtype_and_ask_diffusers_for_a_hooked_model():
    from diffusers_stepbatch.programs.generic.proxies import ModelProxy

    pipe = tiny_flux_pipeline()
    transformer = pipe.transformer
    proxy = ModelProxy(transformer, {"__call__": "denoise"}, submit=None, walk=planned_model(transformer))
    assert not proxy._walk.hooked
    transformer.to(torch.bfloat16)  # a cast between plan and call: read now, as the model would answer
    assert proxy.dtype == transformer.dtype == torch.bfloat16 and proxy.device == transformer.device
    transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    hooked = ModelProxy(transformer, {"__call__": "denoise"}, submit=None, walk=planned_model(transformer))
    assert hooked._walk.hooked
    assert hooked.dtype == transformer.dtype == torch.bfloat16  # the casting hook's compute dtype
    assert unhooked_dtype(transformer) == torch.float8_e4m3fn  # what a walk-free answer would have said


def _proxy(model):
    from diffusers_stepbatch.programs.generic.proxies import ModelProxy

    with scan_scope():
        return ModelProxy(model, {"__call__": "denoise"}, submit=None, walk=planned_model(model))


@pytest.mark.parametrize("hooks", ["none", "accelerate", "group offloading"])
@pytest.mark.parametrize("family", PIPELINES)
def test_device_lookups_through_a_proxy_give_diffusers_answers(family, hooks):
    from diffusers.utils.torch_utils import get_module_execution_device

    pipe = PIPELINES[family]()
    for model in modules_of(pipe):
        if hooks == "accelerate":
            inner = next(m for m in model.modules() if m is not model)
            add_hook_to_module(inner, _ExecutionDeviceHook("meta"))  # as sequential offload's hooks say
        elif hooks == "group offloading" and model is getattr(pipe, "transformer", getattr(pipe, "unet", None)):
            apply_group_offloading(model, onload_device=torch.device("cpu"), offload_type="block_level",
                                   num_blocks_per_group=1)
        proxy = _proxy(model)
        assert get_module_execution_device(proxy) == get_module_execution_device(model)
        assert proxy.dtype == model.dtype and proxy.device == model.device
        assert [id(m) for m in proxy.modules()] == [id(m) for m in model.modules()]  # other callers: every module


def test_device_lookups_through_a_proxy_read_only_the_modules_that_could_carry_a_hook(monkeypatch):
    from diffusers.utils.torch_utils import get_module_execution_device

    vae = tiny_flux_pipeline(vae_blocks=4).vae
    proxy = _proxy(vae)
    misses = []
    getattr_of_modules = torch.nn.Module.__getattr__
    monkeypatch.setattr(torch.nn.Module, "__getattr__",
                        lambda module, name: misses.append(name) or getattr_of_modules(module, name))
    assert get_module_execution_device(proxy) == torch.device("cpu")
    assert len(misses) <= 2 * len(proxy._walk.hook_carriers) < len(proxy._walk.modules)
    misses.clear()
    get_module_execution_device(vae)
    assert len(misses) >= 2 * len(proxy._walk.modules)  # diffusers' own walk, for comparison


class _CountingStatefulHook(DiffusersHook):
    """A stateful diffusers hook that counts its resets."""

    _is_stateful = True

    def __init__(self):
        super().__init__()
        self.resets = 0

    def reset_state(self, module):
        self.resets += 1
        return module


@pytest.mark.parametrize("where", ["top", "block", "both"])
def test_a_proxy_resets_stateful_hooks_at_the_end_of_a_call_as_diffusers_does(where):
    from diffusers.hooks import HookRegistry

    transformer = PIPELINES["flux"]().transformer
    targets = {"top": [transformer], "block": [transformer.transformer_blocks[0].attn],
               "both": [transformer, transformer.single_transformer_blocks[1]]}[where]
    hooks = []
    for module in targets:
        hooks.append(_CountingStatefulHook())
        HookRegistry.check_if_exists_or_initialize(module).register_hook(hooks[-1], f"counting-{len(hooks)}")
    transformer._reset_stateful_cache()  # diffusers' own walk
    assert [hook.resets for hook in hooks] == [1] * len(hooks)
    proxy = _proxy(transformer)
    assert proxy._reset_stateful_cache.__func__ is not type(transformer)._reset_stateful_cache
    proxy._reset_stateful_cache()
    assert [hook.resets for hook in hooks] == [2] * len(hooks)
    proxy._reset_stateful_cache(recurse=False)
    assert hooks[0].resets == (3 if targets[0] is transformer else 2)


def test_a_proxy_of_a_model_without_a_stateful_reset_has_none():
    vae = PIPELINES["flux"]().vae
    assert not hasattr(_proxy(vae), "_reset_stateful_cache")
