"""The packed layout (no token sees another row's) and the packed-or-per-size decision, with made-up costs."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from diffusers_stepbatch.engine.costs import BatchCostModel, PackingCostModel
from diffusers_stepbatch.models.packing import layout as layout_module
from diffusers_stepbatch.models.packing.attention import AUTO_CHOICE, check_packed_attention, resolve
from diffusers_stepbatch.models.packing.layout import PackedLayout, attend


def sdpa(query, key, value):
    return F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2),
                                          value.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("rows, lengths", [
    ([2, 1], [(3, 4), (5, 16)]),
    ([1, 3, 2], [(2, 1), (2, 9), (7, 4)]),
])
def test_attend_keeps_each_row_to_itself(rows, lengths):
    layout = PackedLayout(rows, lengths)
    heads, dim = 2, 4
    generator = torch.Generator().manual_seed(0)
    streams = [[torch.randn(layout.tokens(k), heads, dim, generator=generator) for k in range(2)] for _ in range(3)]
    packed = attend(layout, *streams, sdpa)
    for part, part_rows in enumerate(rows):
        for inner in range(part_rows):
            slices = [layout.row_tokens(k, part, inner, inner + 1) for k in range(2)]
            q, k, v = (torch.cat([s[k_][slices[k_]] for k_ in range(2)]).unsqueeze(0) for s in streams)
            alone = sdpa(q, k, v).flatten(2, 3)[0]
            got = torch.cat([packed[k_][slices[k_]] for k_ in range(2)])
            assert torch.allclose(got, alone, atol=1e-6)


def test_layout_round_trips_and_selects_rows():
    layout = PackedLayout([2, 1], [(3, 4), (5, 16)])
    parts = [torch.arange(2 * 4).reshape(2, 4, 1).float(), 100 + torch.arange(16).reshape(1, 16, 1).float()]
    packed = layout.pack(1, parts)
    assert packed.shape == (24, 1)
    assert all(torch.equal(a, b) for a, b in zip(layout.unpack(1, packed), parts))
    assert layout.per_token(1, torch.tensor([10.0, 20.0, 30.0])).tolist() == [10.0] * 4 + [20.0] * 4 + [30.0] * 16
    sub, (text_index, image_index) = layout.select_rows([1, 2])
    assert sub.rows == [1, 1] and sub.lengths == [(3, 4), (5, 16)]
    assert image_index.tolist() == list(range(4, 24)) and text_index.tolist() == list(range(3, 11))
    with pytest.raises(ValueError, match="one lengths tuple per part"):
        PackedLayout([1, 2], [(1, 1)])


def warm(costs, key, rows, seconds, times=2):
    for _ in range(times):  # the first observation at a shape is warm-up and not recorded
        costs.observe(key, rows, seconds)


PARTS = [("small", 4), ("large", 2)]


@pytest.mark.parametrize("packed_seconds, separate_seconds, expected", [(0.05, (0.04, 0.05), True),
                                                                         (0.12, (0.04, 0.05), False)])
def test_packing_follows_the_measurements(packed_seconds, separate_seconds, expected):
    costs = BatchCostModel()
    packing = PackingCostModel(costs, explore_every=0)
    assert packing.should_pack("flux", PARTS)  # nothing measured: explore the packed call
    packing.observe("flux", PARTS, packed_seconds)  # warm-up
    assert packing.should_pack("flux", PARTS)
    packing.observe("flux", PARTS, packed_seconds)
    assert not packing.should_pack("flux", PARTS)  # per-size calls unmeasured: measure them
    for (key, rows), seconds in zip(PARTS, separate_seconds):
        warm(costs, key, rows, seconds)
    assert [packing.should_pack("flux", PARTS) for _ in range(5)] == [expected] * 5


@pytest.mark.parametrize("item_rows, expected", [([[1, 1], [1]], False), ([[2], [1]], True), (None, True)])
def test_per_shape_calls_are_estimated_at_their_own_best_split(item_rows, expected):
    # NOTE: compute-bound: "small" runs 2 rows slower than 2 x 1 row, so its per-shape calls would split
    costs = BatchCostModel()
    for key, rows, seconds in [("small", 2, 0.05), ("small", 1, 0.01), ("large", 1, 0.03)]:
        warm(costs, key, rows, seconds)
    packing = PackingCostModel(costs, explore_every=0)
    parts = [("small", 2), ("large", 1)]
    for _ in range(2):
        packing.observe("flux", parts, 0.06)  # above the split per-shape calls (0.05), below one call each (0.08)
    assert packing.separate_estimate(parts, item_rows) == pytest.approx(0.05 if item_rows == [[1, 1], [1]] else 0.08)
    assert packing.should_pack("flux", parts, item_rows) is expected


def test_unseen_mixes_are_estimated_from_the_measured_ratio_and_explored_again():
    costs = BatchCostModel()
    packing = PackingCostModel(costs, explore_every=10)
    for key, rows, seconds in [("small", 4, 0.04), ("large", 2, 0.05), ("small", 2, 0.03), ("large", 1, 0.04)]:
        warm(costs, key, rows, seconds)
    for _ in range(2):
        packing.observe("flux", PARTS, 0.045)  # half the per-size estimate of 0.09
    other = [("small", 2), ("large", 1)]
    assert packing.packed_estimate("flux", other) == pytest.approx(0.07 * 0.5)
    decisions = [packing.should_pack("flux", other) for _ in range(20)]
    # measured again once after explore_every decisions; with packed estimated at half the per-size calls, the
    # next re-measurement waits max_interval_scale x explore_every decisions (see the next test)
    assert decisions.count(False) == 1 and decisions[9] is False


def test_packed_calls_measured_before_their_shapes_still_estimate_unseen_mixes():
    # the engine explores a packed call first, while no per-shape call has been measured yet
    costs = BatchCostModel()
    packing = PackingCostModel(costs, explore_every=0)
    warm(packing, "flux", PARTS, 0.135)
    other = [("small", 2), ("large", 1)]
    assert packing.packed_estimate("flux", other) is None  # nothing to compare the packed call with yet
    for key, rows, seconds in [("small", 4, 0.05), ("large", 2, 0.075), ("small", 2, 0.03), ("large", 1, 0.04)]:
        warm(costs, key, rows, seconds)
    # packed measured 1.08x its per-shape calls (0.135 vs 0.125): an unseen mix is estimated at 1.08x its own
    assert packing.packed_estimate("flux", other) == pytest.approx(0.07 * 1.08)
    assert not packing.should_pack("flux", other)  # estimated slower: kept per shape without a trial
    # the ratio follows the per-shape estimates as they move (the machine's load), not their values back then
    for _ in range(5):
        costs.observe("large", 2, 0.1)
    assert costs.estimate("large", 2) == pytest.approx(0.1)
    # NOTE: "large" at 1 row moves with its key's load level too (tests/test_scheduler_policies.py)
    assert 0.04 < costs.estimate("large", 1) < 0.04 * 0.1 / 0.075
    other_now = costs.estimate("small", 2) + costs.estimate("large", 1)
    assert packing.packed_estimate("flux", other) == pytest.approx(other_now * 0.135 / 0.15)


def test_only_the_most_recently_measured_mixes_are_kept():
    costs = BatchCostModel()
    for key, rows, seconds in [("small", 1, 0.01), ("large", 1, 0.02)]:
        warm(costs, key, rows, seconds)
    packing = PackingCostModel(costs, explore_every=0, max_signatures=3)
    mixes = [[("small", k), ("large", 1)] for k in range(1, 6)]
    for parts in mixes:  # packed at 0.5x the per-shape estimate, then the first mix again
        warm(packing, "flux", parts, 0.5 * packing.separate_estimate(parts))
    packing.observe("flux", mixes[0], 0.5 * packing.separate_estimate(mixes[0]))
    assert list(packing._packed["flux"]) == [packing.signature(m) for m in (mixes[3], mixes[4], mixes[0])]
    # a mix no longer kept is estimated from the kept ones' ratio
    assert packing.packed_estimate("flux", mixes[1]) == pytest.approx(0.5 * packing.separate_estimate(mixes[1]))


@pytest.mark.parametrize("explore_every", [10, 50])
def test_the_other_option_is_measured_again_less_often_the_further_apart_they_are(explore_every):
    def reexplorations(packed_seconds, decisions=40 * explore_every):
        costs = BatchCostModel()
        for (key, rows), seconds in zip(PARTS, (0.04, 0.06)):  # per-size calls: 0.10 s
            warm(costs, key, rows, seconds)
        packing = PackingCostModel(costs, explore_every=explore_every)
        warm(packing, "flux", PARTS, packed_seconds)
        return [d for d in range(decisions) if not packing.should_pack("flux", PARTS)]

    close, apart, far_apart = reexplorations(0.098), reexplorations(0.07), reexplorations(0.02)
    first = explore_every - 1
    # a 2% margin: about every explore_every decisions (x 1.2); 43%: x 5.3; 400%: at most x 8
    assert close[:3] == [first, first + round(1.2 * explore_every), first + 2 * round(1.2 * explore_every)]
    assert apart[:2] == [first, first + round(explore_every * (1 + 0.03 / 0.07 / 0.1))]
    assert far_apart[:2] == [first, first + 8 * explore_every]
    assert len(close) > len(apart) > len(far_apart) >= 5


SIZE_MIXES = [
    ([2, 1], [(3, 4), (5, 16)]),
    ([1, 3, 2], [(2, 1), (2, 9), (7, 4)]),
    ([1, 1, 1, 1], [(4, 4), (4, 64), (2, 15), (6, 15)]),  # a 16x image-token ratio
    ([3], [(5, 130)]),  # one part, rows longer than flex's 128-token blocks
]


def random_streams(layout, heads, dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(layout.tokens(k), heads, dim, generator=generator) for k in range(layout.num_streams)]
            for _ in range(3)]


@pytest.mark.parametrize("rows, lengths", SIZE_MIXES)
@pytest.mark.parametrize("heads, dim", [(2, 4), (3, 16)])
def test_flex_attention_equals_recover_scatter(rows, lengths, heads, dim):
    layout = PackedLayout(rows, lengths)
    streams = random_streams(layout, heads, dim)
    want = attend(layout, *streams, sdpa)
    got = attend(layout, *streams, sdpa, method="flex")
    assert all(g.shape == w.shape and (g - w).abs().max() <= 1e-5 for g, w in zip(got, want))
    joint = PackedLayout(rows, [(sum(part),) for part in lengths])  # one stream, already in row order
    streams = random_streams(joint, heads, dim, seed=1)
    out = [torch.empty(joint.tokens(0), heads * dim)]
    attend(joint, *streams, sdpa, method="flex", out=out)
    assert (out[0] - attend(joint, *streams, sdpa)[0]).abs().max() <= 1e-5


def test_varlen_and_unknown_backends_are_refused_clearly():
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve("varlen", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="packed_attention='fast' is not one of"):
        check_packed_attention("fast")
    assert resolve("auto", torch.device("cpu"), torch.float32) == AUTO_CHOICE["cpu"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen attention (flash) needs CUDA")
@pytest.mark.parametrize("rows, lengths", SIZE_MIXES)
def test_varlen_attention_equals_recover_scatter_on_cuda(rows, lengths):
    layout = PackedLayout(rows, lengths, device="cuda")
    streams = [[t.to("cuda", torch.bfloat16) for t in s] for s in random_streams(layout, 2, 64)]
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        resolve("varlen", torch.device("cuda"), torch.float32)
    want = attend(layout, *streams, sdpa)
    got = attend(layout, *streams, sdpa, method="varlen")
    assert all((g.float() - w.float()).abs().max() <= 2e-2 for g, w in zip(got, want))  # bfloat16 flash vs SDPA


@pytest.mark.parametrize("broadcast", [False, True])
def test_row_values_reach_only_their_rows_tokens(broadcast, monkeypatch):
    monkeypatch.setattr(layout_module, "_BROADCAST_MIN_TOKENS", 0 if broadcast else 10**9)
    layout = PackedLayout([2, 1, 3], [(3, 4), (5, 16), (2, 9)])
    assert layout.broadcasts(1) is broadcast
    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(layout.tokens(1), 6, generator=generator) for _ in range(2))
    emb = torch.randn(layout.num_rows, 3 * 6, generator=generator)
    shift, scale1, gate = layout_module.adaln_values(layout, 1, emb, 3)
    per_token = emb.index_select(0, layout.token_rows[1]).chunk(3, dim=1)
    assert torch.allclose(layout.modulate(1, x, scale1, shift), x * (1 + per_token[1]) + per_token[0], atol=1e-6)
    want = residual + per_token[2] * torch.tanh(x)
    assert torch.allclose(layout.gated_add(1, residual, gate, torch.tanh(x)), want, atol=1e-6)
    assert torch.allclose(layout.gated_apply(1, residual, gate, torch.tanh, x), want, atol=1e-6)
    out = torch.empty(layout.tokens(1), 12)
    layout.apply_into(1, lambda t: torch.cat([t, -t], dim=1), x, out)
    assert torch.equal(out, torch.cat([x, -x], dim=1))


def test_flux_rotary_is_computed_once_per_ids_and_again_after_an_in_place_change():
    from diffusers_stepbatch.models.flux import packing as packed_flux
    from diffusers_stepbatch.models.packing import rotary_memo
    from diffusers_stepbatch.testing import tiny_flux_transformer

    transformer = tiny_flux_transformer()
    pos_embed = transformer.pos_embed
    calls = []
    hook = pos_embed.register_forward_hook(lambda module, args, out: calls.append(1))

    def rotary(txt_ids, img_ids):
        return packed_flux._part_rotary(transformer, [SimpleNamespace(txt_ids=txt_ids, img_ids=img_ids)])[0]

    txt_ids, img_ids = torch.zeros(3, 3), torch.arange(12.0).reshape(4, 3)
    first = rotary(txt_ids, img_ids)
    again = rotary(txt_ids, img_ids)
    assert again is first and len(calls) == 1
    expected = pos_embed(torch.cat((txt_ids, img_ids)))
    assert all(torch.equal(a, b) for a, b in zip(first, expected))
    img_ids[0, 1] = 7.0  # in place: the cached embedding is stale
    changed = rotary(txt_ids, img_ids)
    assert all(torch.equal(a, b) for a, b in zip(changed, pos_embed(torch.cat((txt_ids, img_ids)))))
    assert not torch.equal(changed[0], first[0])
    other_txt = torch.zeros(3, 3)  # same values, another request's tensor: computed for it
    rotary(other_txt, img_ids)
    count = len(calls)
    held = rotary_memo.held_bytes()
    del img_ids, changed, other_txt, first, again
    import gc

    gc.collect()
    rotary(txt_ids, torch.ones(1, 3))  # a lookup drops the entries of collected ids
    assert count == 5  # two cached calls, two direct ones, one for the other text ids
    assert rotary_memo.held_bytes() < held  # forgotten with its ids
    hook.remove()
