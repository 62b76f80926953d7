"""The prologue's cheap module scans give diffusers' and torch's own answers, and follow changes to the pipeline."""

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from diffusers.hooks import apply_group_offloading

from diffusers_stepbatch.module_scan import carries_hooks, execution_device, own_attribute, submodules, walk
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
def test_walk_and_submodules_match_torch(family):
    pipe = PIPELINES[family]()
    for model in modules_of(pipe):
        named = [(name, id(module)) for name, module in model.named_modules()]
        assert [(name, id(module)) for name, module in walk(model)] == named
        assert [id(module) for module in submodules(model)] == [id(module) for module in model.modules()]


def test_walk_yields_a_shared_submodule_once_as_torch_does():
    shared = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared, torch.nn.Sequential(shared))
    assert [name for name, _ in walk(model)] == [name for name, _ in model.named_modules()] == ["", "0", "1", "3"]


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
