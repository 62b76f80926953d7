"""Z-Image's forward joins its rows' patch, caption and SigLIP tokens into single layer inputs; per-row LoRA maps
them to rows with `models/z_image/lora.py`, so rows of other sizes and caption lengths, each with its own
adapters, equal the model run on each row alone after `set_adapters`, in basic and omni mode."""

import pytest
import torch
from diffusers import ZImageTransformer2DModel

from diffusers_stepbatch.adapters.lora import per_row_lora, streams_ambiguous
from diffusers_stepbatch.models.z_image.lora import lora_token_rows
from diffusers_stepbatch.testing import add_random_lora_adapters

from .references import TOLERANCE, max_diff

ROWS = [{"a": 1.0}, {"b": 0.5, "c": 1.0}, {}]


def _model(siglip: bool, dim: int, heads: int, axes: tuple):
    torch.manual_seed(0)
    model = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=dim, n_layers=2, n_refiner_layers=1,
        n_heads=heads, n_kv_heads=heads, cap_feat_dim=8, siglip_feat_dim=8 if siglip else None,
        axes_dims=list(axes), axes_lens=[256, 32, 32]).eval()
    with torch.no_grad():  # NOTE: the pad tokens start as torch.empty
        model.x_pad_token.fill_(1.0)
        model.cap_pad_token.fill_(1.0)
        if siglip:
            model.siglip_pad_token.fill_(1.0)
    add_random_lora_adapters(model)
    return model


def _basic_arguments(g):
    # image tokens 16, 48 (padded to 32, 64) and 96; captions of 5, 40 and 33 tokens (padded to 32, 64, 64)
    x = [torch.randn(4, 1, h, w, generator=g) for h, w in [(8, 8), (8, 24), (24, 16)]]
    captions = [torch.randn(n, 8, generator=g) for n in (5, 40, 33)]
    return dict(x=x, t=torch.rand(3, generator=g), cap_feats=captions, return_dict=False)


def _omni_arguments(g):
    # per row: condition images with their captions and SigLIP grids, then the target (its SigLIP entry None)
    x = [[torch.randn(4, 1, 8, 8, generator=g), torch.randn(4, 1, 8, 16, generator=g)],
         [torch.randn(4, 1, 16, 8, generator=g), torch.randn(4, 1, 8, 8, generator=g), torch.randn(4, 1, 8, 8, generator=g)],
         [torch.randn(4, 1, 16, 32, generator=g)]]
    captions = [[torch.randn(n, 8, generator=g) for n in lengths] for lengths in [(4, 9), (3, 35, 6), (12,)]]
    siglip = [[torch.randn(3, 4, 8, generator=g), None], [torch.randn(9, 8, 8, generator=g), None, None], [None]]
    masks = [[0, 1], [0, 0, 1], [1]]
    return dict(x=x, t=torch.rand(3, generator=g), cap_feats=captions, siglip_feats=siglip, image_noise_mask=masks,
                return_dict=False)


def _row(arguments, row):
    return {name: value[row:row + 1] if name in ("x", "t", "cap_feats", "siglip_feats", "image_noise_mask") else value
            for name, value in arguments.items()}


@pytest.mark.parametrize("size", [(32, 2, (8, 4, 4)), (48, 4, (4, 4, 4))], ids=["narrow", "wide"])
@pytest.mark.parametrize("mode", ["basic", "omni"])
def test_rows_of_other_sizes_with_their_own_adapters_equal_each_row_alone(mode, size):
    omni = mode == "omni"
    model = _model(omni, *size)
    arguments = (_omni_arguments if omni else _basic_arguments)(torch.Generator().manual_seed(1))
    streams = lora_token_rows(arguments)
    assert len(streams) == (3 if omni else 2) and not streams_ambiguous(len(ROWS), streams)
    with torch.no_grad():
        with per_row_lora(model, ROWS, token_rows=streams):
            together = model(**arguments)[0]
        for row, adapters in enumerate(ROWS):
            model.set_adapters(list(adapters) or ["a"], list(adapters.values()) or [0.0])
            alone = model(**_row(arguments, row))[0]
            assert max_diff(together[row], alone[0]) <= TOLERANCE, row
        model.set_adapters(["a"], [0.0])
        base = model(**_row(arguments, 0))[0]
    assert max_diff(together[0], base[0]) > 1e-3  # the adapters matter


def test_token_rows_follow_the_models_padding():
    arguments = _basic_arguments(torch.Generator().manual_seed(0))
    image, caption = lora_token_rows(arguments)
    assert torch.equal(torch.bincount(image), torch.tensor([32, 64, 96]))
    assert torch.equal(torch.bincount(caption), torch.tensor([32, 64, 64]))
    omni = lora_token_rows(_omni_arguments(torch.Generator().manual_seed(0)))
    # images: 16 + 32 tokens -> 32 + 32; 32 + 16 + 16 -> 3 x 32; 128. Captions: 4 + 9; 3 + 35 + 6; 12.
    # SigLIP: 12 + None (32 pad tokens); 72 + None x 2; None
    assert [torch.bincount(stream).tolist() for stream in omni] == [[64, 96, 128], [64, 128, 32], [64, 160, 32]]


def test_requests_whose_token_streams_coincide_in_length_equal_plain_runs(monkeypatch):
    """A 32x32 image (64 patch tokens per row) with CFG and a caption padded to 96 tokens (its negative to 32): the
    patch and caption inputs both hold 128 tokens per request, mapped to rows differently. One request's rows
    carry the same adapters, so that doesn't matter; two such requests merged run apart, adapters per row."""
    from diffusers_stepbatch import StepBatched
    from diffusers_stepbatch.adapters import state as adapter_state
    from diffusers_stepbatch.testing.image_models import tiny_z_image_pipeline

    from .references import seeded
    from .test_lora_requests import ACTIVE, plain_run

    pipe = tiny_z_image_pipeline(seed=3)
    add_random_lora_adapters(pipe.transformer)
    pipe.set_adapters(*ACTIVE)
    prompt = ("a red circle " * 5)[:60]  # 79 caption tokens with the chat template
    requests = [dict(prompt=prompt, height=32, width=32, guidance_scale=4.0, num_inference_steps=2, output_type="pt",
                     seed=seed, adapters=adapters) for seed, adapters in [(0, {"a": 1.0}), (1, {"b": 0.5, "c": 1.0})]]
    expected = [plain_run(pipe, kwargs) for kwargs in requests]
    ambiguous = []
    real = adapter_state.per_row_lora

    def record(model, rows, token_rows=None):
        ambiguous.append((len(rows), streams_ambiguous(len(rows), token_rows or [])))
        return real(model, rows, token_rows)

    monkeypatch.setattr(adapter_state, "per_row_lora", record)
    with StepBatched(pipe, max_batch_size=8) as sb:
        alone = sb(**seeded(requests[0])).images
        futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        together = [future.result(300).images for future in futures]
    assert max_diff(alone, expected[0]) <= TOLERANCE
    assert max(max_diff(got, want) for got, want in zip(together, expected)) <= TOLERANCE
    assert (2, True) in ambiguous, ambiguous  # a request's two rows over streams that coincide in length
    assert max_diff(expected[0], expected[1]) > 1e-3
