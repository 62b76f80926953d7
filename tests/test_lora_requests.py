"""Per-request LoRA through StepBatched: 8 concurrent requests over 3 adapters share forwards, and each equals
the plain pipeline configured with `set_adapters` for that request and run alone."""

import functools
import math

import pytest
import torch

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.adapters import state as adapter_state
from diffusers_stepbatch.testing import (
    add_random_lora_adapters,
    tiny_flux_pipeline,
    tiny_qwenimage_pipeline,
    tiny_sd3_pipeline,
    tiny_sd_pipeline,
    tiny_sdxl_pipeline,
)
from diffusers_stepbatch.testing.hunyuan_video_models import HunyuanVideo15Size, tiny_hunyuan_video15_pipeline
from diffusers_stepbatch.testing.image_models import tiny_z_image_pipeline
from diffusers_stepbatch.testing.ltx_models import LTX2_PLAIN, LTX2Size, tiny_ltx2_pipeline
from diffusers_stepbatch.toy.video import tiny_wan_pipeline

from .references import TOLERANCE, engine_held, max_diff, seeded, submit_all

# family: (builder, denoiser attribute, attention-kwargs name, request kwargs)
FAMILIES = {
    "flux": (functools.partial(tiny_flux_pipeline, guidance_embeds=True), "transformer", "joint_attention_kwargs",
             dict(height=32, width=32, max_sequence_length=16)),
    "sd3": (tiny_sd3_pipeline, "transformer", "joint_attention_kwargs",
            dict(height=32, width=32, max_sequence_length=16)),
    "qwenimage": (tiny_qwenimage_pipeline, "transformer", "attention_kwargs",
                  dict(height=32, width=32, negative_prompt="blurry", true_cfg_scale=3.0)),
    "sdxl": (tiny_sdxl_pipeline, "unet", "cross_attention_kwargs", dict(height=32, width=32)),
    "sd": (tiny_sd_pipeline, "unet", "cross_attention_kwargs", dict(height=32, width=40, guidance_scale=1.0)),
    # through the generic program: per-row LoRA on intercepted transformer calls
    "kontext-generic": (lambda: _kontext(tiny_flux_pipeline(guidance_embeds=True)), "transformer",
                        "joint_attention_kwargs",
                        dict(height=32, width=32, max_sequence_length=16, _auto_resize=False, max_area=32 * 32,
                             image=torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)))),
    "qwenimage-img2img-generic": (lambda: _generic(tiny_qwenimage_pipeline(), "QwenImageImg2ImgPipeline"),
                                  "transformer", "attention_kwargs",
                                  dict(height=32, width=32, negative_prompt="blurry", true_cfg_scale=3.0, strength=0.8,
                                       image=torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)))),
    "wan-generic": (functools.partial(tiny_wan_pipeline, layers=1), "transformer", "attention_kwargs",
                    dict(height=16, width=32, num_frames=5, max_sequence_length=16, negative_prompt="blur",
                         guidance_scale=4.0)),
    "ltx2-generic": (functools.partial(tiny_ltx2_pipeline, LTX2Size(layers=1)), "transformer", "attention_kwargs",
                     dict(LTX2_PLAIN, height=32, width=64, num_frames=5, frame_rate=25.0, negative_prompt="blurry",
                          guidance_scale=3.0, audio_guidance_scale=1.5)),
    "hunyuan-video15-generic": (functools.partial(tiny_hunyuan_video15_pipeline, guidance_scale=3.0), "transformer",
                                "attention_kwargs", dict(height=16, width=32, num_frames=5, negative_prompt="blurry")),
    # generic: the model's own forward joins its rows' tokens (`ModelSupport.lora_token_rows`); CFG rows in one call
    "z-image-generic": (tiny_z_image_pipeline, "transformer", "joint_attention_kwargs",
                        dict(height=32, width=32, guidance_scale=4.0)),
}


def _images(output):
    """A pipeline output's images, or a video pipeline's frames (LTX-2: its frames and audio, flattened)."""
    if hasattr(output, "audio"):
        return torch.cat([torch.as_tensor(output.frames).flatten(), torch.as_tensor(output.audio).flatten()])
    return output.frames if hasattr(output, "frames") else output.images


def _generic(pipe, pipeline_class: str):
    import diffusers

    generic = getattr(diffusers, pipeline_class)(**pipe.components)
    generic.set_progress_bar_config(disable=True)
    return generic


def _kontext(pipe):
    from diffusers import FluxKontextPipeline

    kontext = FluxKontextPipeline(**pipe.components)
    kontext.set_progress_bar_config(disable=True)
    return kontext
ACTIVE = (["c"], [0.6])  # the pipeline's own set_adapters state when requests without adapters= are submitted

# (adapters= or None for "the pipeline's active adapters", LoRA scale or None, prompt, seed)
REQUESTS = [
    ({"a": 1.0}, None, "a red circle", 0),
    ({"b": 1.0}, None, "a red circle", 0),
    ({"a": 0.7, "c": 0.3}, None, "a blue square", 1),
    ({}, None, "a red circle", 0),
    ({"b": 0.8}, 0.5, "a green cross", 2),
    (None, None, "a red circle", 3),
    (["a", "b", "c"], None, "a blue square", 4),
    ({"a": 1.0}, 1.5, "a red circle", 5),
]


@functools.cache
def lora_pipe(family):
    builder = FAMILIES[family][0]
    pipe = builder()
    add_random_lora_adapters(getattr(pipe, FAMILIES[family][1]))
    return pipe


def lora_owner(pipe):
    """What `set_adapters` is called on: the pipeline, or its transformer where the pipeline has no LoRA loader
    (HunyuanVideo 1.5)."""
    return pipe if hasattr(pipe, "set_adapters") else pipe.transformer


def call_kwargs(family, adapters, scale, prompt, seed, steps=3):
    _, _, kwargs_name, extra = FAMILIES[family]
    kwargs = dict(prompt=prompt, num_inference_steps=steps, seed=seed, output_type="pt", **extra)
    if scale is not None:
        kwargs[kwargs_name] = {"scale": scale}
    if adapters is not None:
        kwargs["adapters"] = adapters
    return kwargs


def plain_run(pipe, kwargs):
    """The unwrapped pipeline after `set_adapters` for this request, run alone: its images (or frames)."""
    return _images(plain_output(pipe, kwargs))


def plain_output(pipe, kwargs):
    """The unwrapped pipeline's output after `set_adapters` for this request, run alone."""
    kwargs = dict(kwargs)
    adapters = kwargs.pop("adapters", None)
    if adapters is None:
        adapters = dict(zip(*ACTIVE))
    elif isinstance(adapters, list):
        adapters = dict.fromkeys(adapters, 1.0)
    if adapters:
        lora_owner(pipe).enable_lora()
        lora_owner(pipe).set_adapters(list(adapters), list(adapters.values()))
    else:
        lora_owner(pipe).disable_lora()
    try:
        return pipe(**seeded(kwargs))
    finally:
        lora_owner(pipe).enable_lora()
        lora_owner(pipe).set_adapters(*ACTIVE)


@pytest.fixture
def recorded_rows(monkeypatch):
    """The per-row adapter weights of every per-row LoRA forward."""
    rows = []
    real = adapter_state.per_row_lora

    def record(model, row_weights, token_rows=None):
        rows.append([dict(w) for w in row_weights])
        return real(model, row_weights, token_rows)

    monkeypatch.setattr(adapter_state, "per_row_lora", record)
    return rows


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_concurrent_requests_with_their_own_adapters_equal_plain_runs(family, recorded_rows):
    pipe = lora_pipe(family)
    lora_owner(pipe).set_adapters(*ACTIVE)
    requests = [call_kwargs(family, *request) for request in REQUESTS]
    expected = [plain_run(pipe, kwargs) for kwargs in requests]
    with StepBatched(pipe, max_batch_size=16) as sb:
        with engine_held(sb, call_kwargs(family, {}, None, "a blocker", 0, steps=1)):  # all start in lockstep
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(300) for future in futures]
    for request, got, want in zip(REQUESTS, results, expected):
        assert max_diff(_images(got), want) <= TOLERANCE, request
    # the adapters matter, and forwards really mixed rows with different adapters
    assert max_diff(expected[0], expected[3]) > 1e-3 and max_diff(expected[0], expected[1]) > 1e-3
    mixed = max(len({tuple(sorted(r.items())) for r in rows}) for rows in recorded_rows)
    assert mixed == len(REQUESTS), recorded_rows  # all 8 requests (8 distinct weight sets) in one forward


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_submit_keeps_the_adapters_active_at_submit(family):
    pipe = lora_pipe(family)
    first, second = call_kwargs(family, None, None, "a red circle", 0), call_kwargs(family, None, None, "a cat", 1)
    lora_owner(pipe).set_adapters(["a"], [1.0])
    want_first = _images(pipe(**seeded(first)))
    lora_owner(pipe).set_adapters(["b", "c"], [0.5, 1.0])
    want_second = _images(pipe(**seeded(second)))
    try:
        with StepBatched(pipe) as sb:
            lora_owner(pipe).set_adapters(["a"], [1.0])
            future_first = sb.submit(**seeded(first))
            lora_owner(pipe).set_adapters(["b", "c"], [0.5, 1.0])
            future_second = sb.submit(**seeded(second))
            lora_owner(pipe).disable_lora()  # later changes don't reach submitted requests
            got_first, got_second = _images(future_first.result(300)), _images(future_second.result(300))
    finally:
        lora_owner(pipe).enable_lora()
        lora_owner(pipe).set_adapters(*ACTIVE)
    assert max_diff(got_first, want_first) <= TOLERANCE
    assert max_diff(got_second, want_second) <= TOLERANCE


@pytest.mark.parametrize("adapters, scale, message", [
    ({"nope": 1.0}, None, "unknown adapter 'nope'"),
    ({"a": -0.5}, None, r"adapters\['a'\]=-0.5 must be a finite number >= 0"),
    ({"a": math.nan}, None, "must be a finite number"),
    ({"a": math.inf}, None, "must be a finite number"),
    ({"a": {"transformer_blocks.0": 1.0}}, None, "per-block weights"),
    ({"a": 1.0}, math.nan, "LoRA scale nan"),
])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bad_adapters_raise_value_error_in_caller(family, adapters, scale, message):
    pipe = lora_pipe(family)
    with StepBatched(pipe) as sb:
        with pytest.raises(ValueError, match=message):
            sb.submit(**seeded(call_kwargs(family, adapters, scale, "a cat", 0)))
        assert sb.stats()["waiting"] == 0 and sb.stats()["running"] == 0


def test_adapters_of_the_wrong_type_is_a_type_error():
    with StepBatched(lora_pipe("flux")) as sb:
        with pytest.raises(TypeError, match="adapters=3 must be a dict of adapter name -> weight"):
            sb.submit(**seeded(call_kwargs("flux", 3, None, "a cat", 0)))


def test_adapters_on_a_pipeline_that_runs_whole_calls_is_an_error():
    from diffusers import StableDiffusionPAGPipeline

    pipe = StableDiffusionPAGPipeline(**tiny_sd_pipeline().components, pag_applied_layers=["mid"])
    add_random_lora_adapters(pipe.unet)
    with StepBatched(pipe) as sb:
        with pytest.raises(ValueError, match="adapters= is not supported for StableDiffusionPAGPipeline"):
            sb.submit(prompt="a cat", adapters={"a": 1.0}, pag_scale=2.0)


def test_fused_lora_is_the_base_model_for_everyone():
    pipe = tiny_flux_pipeline(guidance_embeds=True)
    add_random_lora_adapters(pipe.transformer)
    pipe.set_adapters(["a"])
    pipe.fuse_lora(components=["transformer"], adapter_names=["a"])
    requests = [call_kwargs("flux", adapters, None, "a red circle", seed) for adapters, seed in
                [(None, 0), ({}, 1), ({"b": 1.0}, 2)]]
    expected = []
    for kwargs, active in zip(requests, (["a"], ["a"], ["b"])):  # {}: the fused model, "a" stays fused
        pipe.set_adapters(active)
        expected.append(_images(pipe(**seeded({k: v for k, v in kwargs.items() if k != "adapters"}))))
    pipe.set_adapters(["a"])
    with StepBatched(pipe) as sb:
        results = submit_all(sb, requests)
    for got, want in zip(results, expected):
        assert max_diff(_images(got), want) <= TOLERANCE
    assert max_diff(expected[0], expected[2]) > 1e-3


def test_prompt_cache_is_keyed_on_the_text_encoder_lora_state():
    """Text-encoder LoRA through peft's own injection: transformers 5.24's `add_adapter` (what diffusers'
    `load_lora_weights` uses for text encoders) wants peft >= 0.22, which the registry doesn't have."""
    from diffusers.utils.peft_utils import set_weights_and_activate_adapters
    from peft import LoraConfig, inject_adapter_in_model

    pipe = tiny_flux_pipeline(guidance_embeds=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                                pipe.text_encoder, adapter_name="t")
    kwargs = call_kwargs("flux", None, None, "a red circle", 0)
    with StepBatched(pipe) as sb:
        outputs = []
        for weight in (1.0, 0.25, 1.0):
            set_weights_and_activate_adapters(pipe.text_encoder, ["t"], [weight])
            expected = _images(pipe(**seeded(kwargs)))
            got = _images(sb(**seeded(kwargs)))
            assert max_diff(got, expected) <= TOLERANCE, weight
            outputs.append(got)
        stats = sb.stats()["prompt_cache"]
    assert max_diff(outputs[0], outputs[1]) > 1e-3  # the text-encoder LoRA changes the embeddings
    assert stats["hits"] == 1  # only the third request, under the first one's state


def test_requests_that_differ_only_in_lora_scale_share_prompt_cache_entries():
    pipe = lora_pipe("flux")
    with StepBatched(pipe) as sb:
        for scale in (1.0, 0.5):
            sb(**seeded(call_kwargs("flux", {"a": 1.0}, scale, "a lone prompt", 0)))
        stats = sb.stats()["prompt_cache"]
    assert (stats["hits"], stats["misses"]) == (1, 1)  # no text-encoder LoRA: the scale can't change embeddings


@pytest.mark.parametrize("family", ["flux", "qwenimage", "sd3"])
def test_requests_of_different_sizes_with_adapters_equal_plain_runs(family, caplog):
    """Rows of several sizes share packed forwards, adapters per row over the packed token streams."""
    from diffusers_stepbatch import SchedulerConfig

    pipe = lora_pipe(family)
    pipe.set_adapters(*ACTIVE)
    requests = [dict(call_kwargs(family, adapters, None, "a red circle", seed), height=h, width=w)
                for adapters, seed, (h, w) in [({"a": 1.0}, 0, (32, 32)), ({"b": 0.5}, 1, (32, 48)),
                                               ({}, 2, (32, 48)), (None, 3, (32, 32)), ({"a": 0.3, "c": 1.0}, 4,
                                                                                          (48, 32))]]
    if family == "sd3":  # skip-layer guidance on two requests: one packed forward per skip set, rows' own LoRA
        for kwargs in requests[1:3]:
            kwargs.update(skip_guidance_layers=[0], skip_layer_guidance_start=0.0, skip_layer_guidance_stop=0.9)
    expected = [plain_run(pipe, kwargs) for kwargs in requests]
    caplog.set_level("WARNING", logger="diffusers_stepbatch.engine.core")
    with StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=16, cost_aware=False)) as sb:
        with engine_held(sb, call_kwargs(family, {}, None, "a blocker", 0, steps=1)):
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(300) for future in futures]
        mixed_calls = sb.stats()["mixed"]["calls"]
    for kwargs, got, want in zip(requests, results, expected):
        assert max_diff(_images(got), want) <= TOLERANCE, kwargs
    assert mixed_calls > 0
    assert not [r for r in caplog.records if "packed" in r.getMessage()]  # no packed call failed and fell back


def test_teacache_requests_of_different_sizes_with_adapters_equal_their_solo_runs(caplog):
    """TeaCache's packed sub-calls fall back to one ordinary forward per size (adapters still per row): each
    request equals itself run alone with the same TeaCache config (TeaCache is lossy, but batch-invariant)."""
    from diffusers_stepbatch import SchedulerConfig
    from diffusers_stepbatch.cache import TeaCacheConfig

    pipe = lora_pipe("flux")
    pipe.set_adapters(*ACTIVE)
    teacache = TeaCacheConfig(threshold=0.6, min_steps=3)
    # NOTE: different step counts, so the requests' skip decisions differ and packed calls shrink to sub-calls
    requests = [dict(call_kwargs("flux", adapters, None, "a red circle", seed, steps=steps), height=h, width=w)
                for adapters, seed, steps, (h, w) in [({"a": 1.0}, 0, 6, (32, 32)), ({"b": 0.5}, 1, 5, (32, 48)),
                                                      ({}, 2, 7, (48, 32))]]
    config = SchedulerConfig(max_batch_size=16, cost_aware=False)
    caplog.set_level("WARNING", logger="diffusers_stepbatch.engine.core")
    with StepBatched(pipe, teacache=teacache, scheduler=config) as sb:
        solo = [_images(sb(**seeded(kwargs))) for kwargs in requests]
        with engine_held(sb, call_kwargs("flux", {}, None, "a blocker", 0, steps=1)):
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [_images(future.result(300)) for future in futures]
        mixed_calls = sb.stats()["mixed"]["calls"]
    for kwargs, got, want in zip(requests, results, solo):
        assert max_diff(got, want) <= TOLERANCE, kwargs
    assert mixed_calls > 0
    assert not [r for r in caplog.records if "packed" in r.getMessage()]  # no packed call failed and fell back


def test_sd3_adapter_on_the_patch_embedding_runs_one_forward_per_size(caplog):
    """pos_embed runs per size inside SD3's packed forward: with an adapter there, each shape runs alone."""
    from peft import LoraConfig

    from diffusers_stepbatch import SchedulerConfig

    pipe = tiny_sd3_pipeline()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe.transformer.add_adapter(LoraConfig(r=2, target_modules=["pos_embed.proj", "to_q"],
                                                init_lora_weights=False), adapter_name="p")
    requests = [dict(call_kwargs("sd3", adapters, None, "a red circle", seed), height=h, width=w)
                for adapters, seed, (h, w) in [({"p": 1.0}, 0, (32, 32)), ({}, 1, (32, 48)), ({"p": 0.5}, 2, (48, 32))]]
    pipe.set_adapters(["p"])
    expected = [plain_run_with(pipe, kwargs, kwargs["adapters"]) for kwargs in requests]
    caplog.set_level("WARNING", logger="diffusers_stepbatch.engine.core")
    with StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=16, cost_aware=False)) as sb:
        results = submit_all(sb, requests)
    for kwargs, got, want in zip(requests, results, expected):
        assert max_diff(_images(got), want) <= TOLERANCE, kwargs
    assert not [r for r in caplog.records if "packed" in r.getMessage()]


def plain_run_with(pipe, kwargs, adapters):
    kwargs = {k: v for k, v in kwargs.items() if k != "adapters"}
    if adapters:
        pipe.set_adapters(list(adapters), list(adapters.values()))
    else:
        pipe.disable_lora()
    try:
        return _images(pipe(**seeded(kwargs)))
    finally:
        pipe.enable_lora()


# ------------------------------------------------------------------ video models: adapters inside packed forwards
def _video_image(height, width, seed):
    import PIL.Image

    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed))
    return PIL.Image.fromarray(pixels.to(torch.uint8).numpy())


WAN_SIZES = [(16, 32, 5), (32, 16, 9), (16, 16, 1), (16, 32, 5), (32, 32, 9)]  # (height, width, num_frames)
LTX2_SIZES = [(32, 32, 5), (32, 64, 9), (64, 32, 5), (32, 32, 9), (32, 64, 1)]
HV15_SIZES = [(16, 16, 5), (16, 32, 9), (32, 16, 5), (16, 16, 9), (32, 32, 1)]
# config: (builder, request kwargs, each request's (height, width, num_frames), whether requests pass an image)
VIDEO_CONFIGS = {
    "wan-t2v": (functools.partial(tiny_wan_pipeline, layers=1),
                dict(max_sequence_length=16, negative_prompt="blur", guidance_scale=4.0), WAN_SIZES, False),
    # image key/value projections and the image embedder run per size inside the packed forward
    "wan-i2v": (functools.partial(tiny_wan_pipeline, heads=3, head_dim=8, layers=1, image_to_video=True,
                                  image_kv=True),
                dict(max_sequence_length=16, negative_prompt="blur", guidance_scale=3.0), WAN_SIZES, True),
    "ltx2-split": (functools.partial(tiny_ltx2_pipeline, LTX2Size(layers=1)),
                   dict(LTX2_PLAIN, frame_rate=25.0, negative_prompt="blurry", guidance_scale=3.0,
                        audio_guidance_scale=1.5), LTX2_SIZES, False),
    # interleaved RoPE, gated attention and LTX-2.3's timestep-modulated prompts (per-row prompt AdaLN)
    "ltx2-23": (functools.partial(tiny_ltx2_pipeline, LTX2Size(heads=4, head_dim=8, audio_heads=2, audio_head_dim=8,
                                                                 layers=1, rope_type="interleaved", gated_attn=True,
                                                                 cross_attn_mod=True)),
                dict(LTX2_PLAIN, frame_rate=25.0, guidance_scale=1.0, use_cross_timestep=True), LTX2_SIZES, False),
    "hunyuan-video15-tiny": (functools.partial(tiny_hunyuan_video15_pipeline, HunyuanVideo15Size()), {},
                             HV15_SIZES, False),
    "hunyuan-video15-patch2-cfg": (functools.partial(tiny_hunyuan_video15_pipeline,
                                                     HunyuanVideo15Size(heads=4, head_dim=8, layers=2, patch_size=2),
                                                     guidance_scale=3.0),
                                   dict(negative_prompt="blurry"), HV15_SIZES, False),
}
MIXED_ADAPTERS = [{"a": 1.0}, {"b": 0.5}, {}, None, {"a": 0.3, "c": 1.0}]  # None: the pipeline's active adapters
PROMPTS = ["a fox", 'a sign that reads "open"', "a red ball on green grass", "a cat", "a boat at dusk"]


@functools.cache
def video_lora_pipe(config):
    pipe = VIDEO_CONFIGS[config][0]()
    add_random_lora_adapters(pipe.transformer)
    return pipe


@pytest.fixture
def packed_lora_forwards(monkeypatch):
    """Per per-row LoRA forward over packed token streams, the number of distinct adapter sets among its rows."""
    forwards = []
    real = adapter_state.per_row_lora

    def record(model, row_weights, token_rows=None):
        if token_rows:  # NOTE: plain forwards pass no streams (or LTX-2's empty list)
            forwards.append(len({tuple(sorted(w.items())) for w in row_weights}))
        return real(model, row_weights, token_rows)

    monkeypatch.setattr(adapter_state, "per_row_lora", record)
    return forwards


@pytest.mark.parametrize("config", list(VIDEO_CONFIGS))
def test_video_requests_of_different_sizes_with_adapters_pack_and_equal_plain_runs(config, packed_lora_forwards,
                                                                                   caplog):
    """Five requests with their own adapters over three frame counts and sizes share packed forwards (patch
    embeddings, image embeddings and cross-attention keys per size on their own rows); each equals the plain
    pipeline after set_adapters for it, run alone."""
    from diffusers_stepbatch import SchedulerConfig

    _, extra, sizes, image = VIDEO_CONFIGS[config]
    pipe = video_lora_pipe(config)
    lora_owner(pipe).set_adapters(*ACTIVE)
    requests = []
    for i, (adapters, (height, width, frames)) in enumerate(zip(MIXED_ADAPTERS, sizes)):
        kwargs = dict(extra, prompt=PROMPTS[i], height=height, width=width, num_frames=frames,
                      num_inference_steps=2 + i % 2, output_type="pt", seed=i)
        if adapters is not None:
            kwargs["adapters"] = adapters
        if image:
            kwargs["image"] = _video_image(height, width, i)
        requests.append(kwargs)
    expected = [plain_output(pipe, kwargs) for kwargs in requests]
    caplog.set_level("WARNING", logger="diffusers_stepbatch.engine.core")
    with StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=16, cost_aware=False)) as sb:
        with engine_held(sb, dict(requests[2], prompt="a blocker", num_inference_steps=1)):
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(300) for future in futures]
        mixed_calls = sb.stats()["mixed"]["calls"]
    for kwargs, got, want in zip(requests, results, expected):
        assert max_diff(got.frames, want.frames) <= TOLERANCE, kwargs
        if hasattr(want, "audio"):  # LTX-2
            assert max_diff(got.audio, want.audio) <= TOLERANCE, kwargs
    assert mixed_calls > 0
    assert not [r for r in caplog.records if "packed" in r.getMessage()]  # no packed call failed and fell back
    # every request's rows, with its own adapters, in one packed forward (not one forward per size)
    assert packed_lora_forwards and max(packed_lora_forwards) == len(requests), packed_lora_forwards


@pytest.mark.parametrize("config", ["wan-t2v", "ltx2-split", "hunyuan-video15-patch2-cfg"])
def test_video_teacache_requests_with_adapters_equal_their_solo_runs(config, caplog):
    """A TeaCache forward is the packed forward on one size's rows (on some of them where their decisions differ),
    adapters per row there too: each request equals itself run alone with the same TeaCache config."""
    from diffusers_stepbatch import SchedulerConfig
    from diffusers_stepbatch.cache import TeaCacheConfig

    _, extra, sizes, _ = VIDEO_CONFIGS[config]
    pipe = video_lora_pipe(config)
    pipe_adapters = [{"a": 1.0}, {"b": 0.5}, {"a": 0.3, "c": 1.0}]
    # NOTE: two requests of one size at other step counts: their merged forwards skip for one, not the other
    requests = [dict(extra, prompt=PROMPTS[i], height=height, width=width, num_frames=frames, adapters=adapters,
                     num_inference_steps=8 + i, output_type="pt", seed=i)
                for i, (adapters, (height, width, frames)) in enumerate(zip(pipe_adapters,
                                                                             [sizes[0], sizes[1], sizes[0]]))]
    exact = [plain_output(pipe, kwargs) for kwargs in requests]
    # NOTE: the tiny models' signals change far more than the real models' the published polynomials fit
    teacache = TeaCacheConfig(threshold=0.5, coefficients=(1.0, 0.0))
    with StepBatched(pipe, teacache=teacache) as sb:
        solo = [sb(**seeded(kwargs)) for kwargs in requests]
    caplog.set_level("WARNING", logger="diffusers_stepbatch.engine.core")
    with StepBatched(pipe, teacache=teacache, scheduler=SchedulerConfig(max_batch_size=16, cost_aware=False)) as sb:
        with engine_held(sb, dict(requests[1], prompt="a blocker", num_inference_steps=1)):
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(300) for future in futures]
    for kwargs, got, want in zip(requests, results, solo):
        assert max_diff(got.frames, want.frames) <= TOLERANCE, kwargs
        if hasattr(want, "audio"):
            assert max_diff(got.audio, want.audio) <= TOLERANCE, kwargs
    assert not [r for r in caplog.records if "packed" in r.getMessage()]
    assert max(max_diff(s.frames, e.frames) for s, e in zip(solo, exact)) > 10 * TOLERANCE, "TeaCache skipped no step"
