"""per_row_lora: one forward whose rows use different adapters == set_adapters + a plain forward per row."""

import pytest
import torch

from diffusers_stepbatch.adapters.lora import per_row_lora
from diffusers_stepbatch.testing import add_random_lora_adapters, tiny_flux_transformer, tiny_sd_pipeline

from .references import TOLERANCE, max_diff

# (adapters {name: weight}, LoRA scale): one per row
ROWS = [({"a": 1.0}, 1.0), ({"b": 1.0}, 1.0), ({"a": 0.7, "c": 0.3}, 1.0), ({}, 1.0), ({"b": 0.8}, 0.5),
        ({"a": 1.0, "b": 1.0, "c": 1.0}, 1.0), ({}, 0.5), ({"a": 1.0}, 1.0)]
ROW_SETS = {  # scattered rows with different weights (index path), every row, one contiguous run, no adapters
    "mixed": ROWS,
    "every-row": [({"a": 0.5}, 1.0)] * 3,
    "contiguous": [({}, 1.0), ({"b": 1.0}, 1.0), ({"b": 1.0}, 1.0), ({"c": 0.5}, 2.0)],
    "base-only": [({}, 1.0), ({}, 0.3)],
}


def flux_model(rows=len(ROWS)):
    model = tiny_flux_transformer(guidance_embeds=True)
    add_random_lora_adapters(model)
    cfg = model.config
    tokens = 16
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(rows, tokens, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(rows, 8, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(rows, cfg.pooled_projection_dim, generator=g),
        timestep=torch.rand(rows, generator=g), guidance=torch.full((rows,), 3.5),
        img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(8, 3),
    )
    return model, inputs, "joint_attention_kwargs"


def unet_model(rows=len(ROWS)):
    model = tiny_sd_pipeline().unet
    add_random_lora_adapters(model)
    g = torch.Generator().manual_seed(0)
    inputs = dict(sample=torch.randn(rows, 4, 8, 8, generator=g), timestep=torch.randint(0, 1000, (rows,), generator=g),
                  encoder_hidden_states=torch.randn(rows, 16, model.config.cross_attention_dim, generator=g))
    return model, inputs, "cross_attention_kwargs"


def plain_row(model, inputs, kwargs_name, row, adapters, scale):
    one = {k: (v[row:row + 1] if k not in ("img_ids", "txt_ids") else v) for k, v in inputs.items()}
    if adapters:
        model.enable_lora()
        model.set_adapters(list(adapters), list(adapters.values()))
    else:
        model.disable_lora()
    try:
        return model(**one, **{kwargs_name: {"scale": scale}}, return_dict=False)[0]
    finally:
        model.enable_lora()


@pytest.mark.parametrize("row_set", sorted(ROW_SETS))
@pytest.mark.parametrize("build", [flux_model, unet_model], ids=["flux", "unet"])
def test_rows_equal_set_adapters_per_row(build, row_set):
    requests = ROW_SETS[row_set]
    model, inputs, kwargs_name = build(len(requests))
    rows = [{name: weight * scale for name, weight in adapters.items()} for adapters, scale in requests]
    model.set_adapters(["c"], [2.0])  # the model's own active state must not leak into the per-row forward
    with torch.no_grad():
        with per_row_lora(model, rows):
            batched = model(**inputs, return_dict=False)[0]
        for row, (adapters, scale) in enumerate(requests):
            expected = plain_row(model, inputs, kwargs_name, row, adapters, scale)
            assert max_diff(batched[row:row + 1], expected) <= TOLERANCE, (row, adapters, scale)
        lora_delta = max_diff(plain_row(model, inputs, kwargs_name, 0, {"a": 1.0}, 1.0),
                              plain_row(model, inputs, kwargs_name, 0, {}, 1.0))
    assert lora_delta > 1e-2  # the adapters change the output (random non-zero B)
    assert all("forward" not in vars(m) and "forward" not in m._modules for m in model.modules())  # undone


def test_per_token_weights_in_a_packed_input():
    model, _, _ = flux_model()
    layer = model.transformer_blocks[0].attn.to_q  # a LoRA layer of adapter "a"
    g = torch.Generator().manual_seed(1)
    lengths, rows = [5, 3, 7], [{"a": 1.0}, {}, {"a": 0.4, "c": 2.0}]
    x = torch.randn(1, sum(lengths), layer.in_features, generator=g)
    token_rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    per_request = torch.randn(len(lengths), layer.in_features, generator=g)  # e.g. a per-request embedding
    with torch.no_grad():
        with per_row_lora(model, rows, token_rows=token_rows):
            packed, by_row = layer(x), layer(per_request)
        start = 0
        for row, (length, adapters) in enumerate(zip(lengths, rows)):
            segment = x[:, start:start + length]
            model.set_adapters(list(adapters) or ["a"], list(adapters.values()) or [0.0])
            assert max_diff(packed[:, start:start + length], layer(segment)) <= TOLERANCE
            assert max_diff(by_row[row], layer(per_request[row:row + 1])[0]) <= TOLERANCE
            start += length


def test_mismatched_input_shape_is_an_error():
    model, inputs, _ = flux_model()
    with torch.no_grad(), per_row_lora(model, [{"a": 1.0}] * 3):
        with pytest.raises(RuntimeError, match="matches neither 3 rows"):
            model(**inputs, return_dict=False)


def test_streams_that_coincide_in_length_but_not_in_rows_are_refused():
    from diffusers_stepbatch.adapters.lora import RowPlan, streams_ambiguous

    same = torch.tensor([0, 0, 1])
    assert not streams_ambiguous(2, [same, same.clone(), torch.tensor([0, 1, 1, 1])])
    assert streams_ambiguous(2, [same, torch.tensor([0, 1, 1])])  # 3 tokens each, different rows
    assert streams_ambiguous(2, [torch.tensor([1, 0])])  # as long as the rows, in another order
    with pytest.raises(ValueError, match="can't be told apart by shape"):
        RowPlan([{"a": 1.0}, {}], [same, torch.tensor([0, 1, 1])])


def test_rows_that_all_carry_the_same_adapters_need_no_token_mapping():
    """One request's rows: ambiguous streams are accepted, since every token takes the same adapters."""
    model, _, _ = flux_model()
    layer = model.transformer_blocks[0].attn.to_q  # a LoRA layer of adapter "a"
    rows = [{"a": 0.4, "c": 2.0}] * 2
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with per_row_lora(model, rows, token_rows=[torch.tensor([0, 0, 1]), torch.tensor([0, 1, 1])]):
            got = layer(x)
        model.set_adapters(["a", "c"], [0.4, 2.0])
        want = layer(x)
        model.set_adapters(["a"], [0.0])
        base = layer(x)
    assert max_diff(got, want) <= TOLERANCE and max_diff(got, base) > 1e-3
    with pytest.raises(RuntimeError, match="matches neither 2 rows or 3 tokens"):  # other shapes stay errors
        with torch.no_grad(), per_row_lora(model, rows, token_rows=[torch.tensor([0, 0, 1])]):
            layer(torch.randn(5, layer.in_features))


def test_a_sub_batch_of_rows_keeps_each_rows_adapters():
    """`row_subset`: inside a per-row forward, layer inputs holding only some of its rows (a step cache's rows that
    compute) take those rows' adapters."""
    from diffusers_stepbatch.adapters.lora import row_subset

    model, _, _ = flux_model()
    layer = model.transformer_blocks[0].attn.to_q  # a LoRA layer of adapters "a" and "c"
    rows = [{"a": 1.0}, {}, {"a": 0.4, "c": 2.0}, {"c": 0.5}]
    x = torch.randn(2, 6, layer.in_features, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with per_row_lora(model, rows):
            with row_subset(model, [2, 0]):
                got = layer(x)
            with pytest.raises(RuntimeError, match="matches neither 4 rows"):  # the subset ends with its block
                layer(x)
        for i, adapters in enumerate([rows[2], rows[0]]):
            model.set_adapters(list(adapters), list(adapters.values()))
            assert max_diff(got[i], layer(x[i:i + 1])[0]) <= TOLERANCE
        model.set_adapters(["a"], [0.0])
        assert max_diff(got[0], layer(x[:1])[0]) > 1e-3  # the adapters matter



def test_a_layout_maps_a_steps_inputs_to_other_rows_of_the_forward():
    """`lora_layout`: inside it a layer input holds the rows it names (a packed forward's per-shape step); the
    forward's own rows again after it, and a no-op outside a per-row forward."""
    from diffusers_stepbatch.adapters.lora import LoraLayout, lora_layout

    model, _, _ = flux_model()
    layer = model.transformer_blocks[0].attn.to_q  # a LoRA layer of adapters "a" and "c"
    rows = [{"a": 1.0}, {}, {"a": 0.4, "c": 2.0}]
    g = torch.Generator().manual_seed(2)
    x, own = torch.randn(2, 5, layer.in_features, generator=g), torch.randn(3, 5, layer.in_features, generator=g)
    with torch.no_grad():
        with lora_layout(model, LoraLayout([2, 0])):  # no per-row forward: the layer as it is
            assert max_diff(layer(x), layer.base_layer(x)) > 1e-3  # its own active adapter ("c") applies
        with per_row_lora(model, rows):
            with lora_layout(model, LoraLayout([2, 0])):  # rows 2 and 0 of the forward, in that order
                mapped = layer(x)
            with lora_layout(model, LoraLayout([1])):  # a row without adapters
                base = layer(x[:1])
                with pytest.raises(RuntimeError, match="matches neither 1 rows"):
                    layer(x)
            by_row = layer(own)
        expected = []
        for adapters, inputs in [(rows[2], x[0:1]), (rows[0], x[1:2]), ({}, x[:1])] + [
                (adapters, own[r:r + 1]) for r, adapters in enumerate(rows)]:
            model.set_adapters(list(adapters) or ["a"], list(adapters.values()) or [0.0])
            expected.append(layer(inputs))
    got = [mapped[0:1], mapped[1:2], base] + [by_row[r:r + 1] for r in range(3)]
    assert max(max_diff(a, b) for a, b in zip(got, expected)) <= TOLERANCE
    assert max_diff(mapped[0:1], layer.base_layer(x[0:1])) > 1e-3  # the adapters apply
