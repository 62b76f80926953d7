"""Admission policies, starvation, SLO admission and cost-aware chunking, with made-up costs: no torch."""

import random
import statistics
from collections import Counter

import pytest

from diffusers_stepbatch.engine.costs import BatchCostModel
from diffusers_stepbatch.engine.request import RequestStatus
from diffusers_stepbatch.engine.scheduler import SchedulerConfig, StepScheduler

from .test_scheduler_and_batch import NOW, fake_request


def admitted_ids(scheduler, now=NOW):
    return [r.request_id for r in scheduler.schedule(now).admitted]


def test_fcfs_keeps_arrival_order_and_blocks_behind_the_head():
    scheduler = StepScheduler(SchedulerConfig(max_batch_size=3, policy="fcfs"))
    for i, rows in enumerate([2, 2, 1]):
        scheduler.add(fake_request(i, rows, arrival=NOW + i))
    assert admitted_ids(scheduler) == [0]  # request 1 does not fit; 2 may not overtake it


@pytest.mark.parametrize("steps, rows, tokens, expected", [
    ([20, 4, 10], [1, 1, 1], [1, 1, 1], [1, 2, 0]),
    ([4, 4, 4], [2, 1, 1], [256, 256, 64], [2, 1, 0]),
    ([8, 2, 8], [1, 2, 1], [16, 16, 4], [2, 1, 0]),
])
def test_sjf_orders_by_remaining_steps_times_step_cost(steps, rows, tokens, expected):
    scheduler = StepScheduler(SchedulerConfig(max_batch_size=1, policy="sjf"))
    for i in range(3):
        scheduler.add(fake_request(i, rows[i], steps=steps[i], tokens_per_row=tokens[i], arrival=NOW + i))
    order = []
    while scheduler.has_work():
        order += admitted_ids(scheduler)
        scheduler.finish(scheduler.running[0], RequestStatus.FINISHED_OK)
    assert order == expected


def test_sjf_and_priority_backfill_smaller_requests():
    scheduler = StepScheduler(SchedulerConfig(max_batch_size=3, policy="priority"))
    scheduler.add(fake_request(0, 2, priority=0, arrival=NOW))
    scheduler.add(fake_request(1, 2, priority=5, arrival=NOW + 1))
    scheduler.add(fake_request(2, 1, priority=1, arrival=NOW + 2))
    assert admitted_ids(scheduler) == [1, 2]  # highest priority first, then a small one that still fits


def test_max_wait_prevents_starvation():
    scheduler = StepScheduler(SchedulerConfig(max_batch_size=1, policy="sjf", max_wait_s=5.0))
    scheduler.add(fake_request(0, 1, steps=50, arrival=NOW))
    for i in range(1, 4):
        scheduler.add(fake_request(i, 1, steps=2, arrival=NOW + 1))
    assert admitted_ids(scheduler, now=NOW + 1) == [1]  # short jobs first while the long one is young
    scheduler.finish(scheduler.running[0], RequestStatus.FINISHED_OK)
    assert admitted_ids(scheduler, now=NOW + 6) == [0]  # waited 6 s > 5 s: it goes first now


def test_slo_admission_rejects_unmeetable_deadline_and_queues_when_configured():
    for mode, rejected in (("reject", True), ("queue", False)):
        scheduler = StepScheduler(SchedulerConfig(max_batch_size=4, on_unmeetable_deadline=mode))
        scheduler.step_seconds = 0.5
        scheduler.add(fake_request(0, 1, steps=10, deadline=NOW + 3.0))  # needs ~5 s
        scheduler.add(fake_request(1, 1, steps=4, deadline=NOW + 3.0))  # needs ~2 s
        plan = scheduler.schedule(NOW)
        assert [r.request_id for r, _ in plan.rejected] == ([0] if rejected else [])
        assert [r.request_id for r in plan.admitted] == ([1] if rejected else [0, 1])
        if rejected:
            assert "can't meet its deadline" in plan.rejected[0][1]


def test_deadline_counts_waiting_for_a_free_slot():
    scheduler = StepScheduler(SchedulerConfig(max_batch_size=1, policy="fcfs"))
    scheduler.step_seconds = 1.0
    scheduler.add(fake_request(0, 1, steps=5))
    scheduler.schedule(NOW)
    scheduler.add(fake_request(1, 1, steps=2, deadline=NOW + 4.0))  # 5 steps of waiting + 2 > 4 s
    plan = scheduler.schedule(NOW)
    assert [r.request_id for r, _ in plan.rejected] == [1]


def test_row_budget_caps_admission():
    scheduler = StepScheduler(SchedulerConfig(max_batch_size=8))
    scheduler.row_budget = 3
    for i in range(5):
        scheduler.add(fake_request(i, 1, arrival=NOW + i))
    assert admitted_ids(scheduler) == [0, 1, 2]


def feed(costs, key, seconds_for_rows, rounds=14, group=8):
    """Drive chunk() like the engine does for `rounds` groups of `group` one-row items: run what it decides,
    report made-up times."""
    return feed_groups(costs, key, seconds_for_rows, [group] * rounds)


def feed_groups(costs, key, seconds_for_rows, groups, new_size_warms_up=False):
    """`feed` for groups of the sizes in `groups`, in turn; one tuple of call rows per group."""
    decisions = []
    for group in groups:
        chunks = costs.chunk(key, [1] * group)
        decisions.append(tuple(len(c) for c in chunks))
        for chunk in chunks:
            costs.observe(key, len(chunk), seconds_for_rows(len(chunk)), new_size_warms_up=new_size_warms_up)
    return decisions


def test_overhead_bound_costs_keep_one_big_batch():
    costs = BatchCostModel(explore_every=0)
    decisions = feed(costs, "tiny", lambda rows: 0.010 + 0.001 * rows)
    # the whole group once (a first call at a new shape is not recorded, nor run again to be measured), one group
    # that measures one row, a quarter and a half (smallest first); the whole group, estimated from its half, is
    # then chosen
    assert decisions[:2] == [(8,), (1, 1, 2, 4)]
    assert set(decisions[2:]) == {(8,)}  # splits were slower: no further exploration


def test_compute_bound_costs_split_into_faster_forwards():
    costs = BatchCostModel(explore_every=0)
    decisions = feed(costs, "big", lambda rows: 0.1 * rows ** 1.2)  # superlinear: batching loses
    assert decisions[:2] == [(8,), (1, 1, 2, 4)]  # the whole group, then every smaller size in one group
    assert decisions[2:] == [(1,) * 8] * 12


def linear(rows):
    return 0.010 + 0.001 * rows  # overhead-bound: the whole group is fastest


def exploration_cost(costs, key, seconds_for_rows, group, rounds):
    """Drive chunk() for `rounds` groups of `group` one-row items; return the decisions and the seconds spent."""
    decisions, spent = [], 0.0
    for _ in range(rounds):
        chunks = costs.chunk(key, [1] * group)
        decisions.append(tuple(len(c) for c in chunks))
        for chunk in chunks:
            spent += seconds_for_rows(len(chunk))
            costs.observe(key, len(chunk), seconds_for_rows(len(chunk)))
    return decisions, spent


@pytest.mark.parametrize("seconds, best", [("linear", "whole"), ("decode_like", "one_each"),
                                           ("superlinear", "one_each")])
@pytest.mark.parametrize("group", [6, 8, 16, 32])
def test_a_key_whose_groups_come_once_per_burst_concludes_in_two_groups(group, seconds, best):
    # NOTE: a closed loop's decodes (and encodes) form one group per burst; exploring one split per group ran
    # whole groups at every halving size in turn: at 32 requests six rounds of decodes, up to 2x slower each
    seconds = globals()[seconds]
    best_split = (group,) if best == "whole" else (1,) * group
    decisions, spent = exploration_cost(BatchCostModel(explore_every=0), "k", seconds, group, rounds=8)
    assert decisions[2:] == [best_split] * 6, decisions
    fastest = sum(seconds(rows) for rows in best_split)
    assert spent <= 8 * fastest + 2 * seconds(group), (spent, decisions)  # the two exploring groups, at most


def test_periodic_reexploration_follows_a_change_in_costs():
    costs = BatchCostModel(explore_every=4)
    feed(costs, "k", lambda rows: 0.1 * rows ** 1.2, rounds=12)
    decisions = feed(costs, "k", lambda rows: 0.5 + 0.01 * rows, rounds=60)  # load changed: batching wins now
    assert max(decisions[0]) <= 2  # the old choice (or one 2-row re-measurement), until new measurements arrive
    assert decisions[-12:].count((8,)) == 9  # the other 3: one re-measured neighbour every 4 decisions
    assert (2, 2, 2, 2) in decisions and (4, 4) in decisions  # it climbed back through the neighbours


@pytest.mark.parametrize("group", [6, 8, 16])
def test_a_remeasurement_runs_one_call_of_the_neighbouring_size(group):
    # NOTE: as a burst's decodes on a CPU: every request finishes in the same step, one image per call is fastest;
    # re-measuring the 2-row neighbour as the whole group at 2 rows per call cost (group / 2) x 69 ms instead of
    # one 2-row call's 19 ms more
    decisions = feed(BatchCostModel(explore_first=2, explore_every=4), "decode", decode_like, rounds=40, group=group)
    one_each = (1,) * group
    concluded = decisions[decisions.index(one_each):]
    remeasured = [d for d in concluded if d != one_each]
    assert len(remeasured) >= 5, decisions
    # one call of the neighbouring option's size (halving: 2 rows of 8 or 16, 3 of 6), the rest one row each; up to
    # 5 one-row calls (the model's window) come first, so that its time is read against their load level
    neighbour = 3 if group == 6 else 2
    lead = min(5, group - neighbour)
    expected = (1,) * lead + (neighbour,) + (1,) * (group - lead - neighbour)
    assert all(d == expected for d in remeasured), remeasured


def test_an_early_outlier_is_measured_again_soon():
    # NOTE: as seen in the engine: the first recorded 16-row forward ran while callers' prologues held the GIL
    costs = BatchCostModel()  # the default schedule: explore_first=5, explore_every=50
    seen = Counter()

    def seconds(rows):
        seen[rows] += 1
        if rows == 16 and seen[rows] == 2:
            return 0.0216
        return {16: 0.016, 8: 0.0099, 4: 0.0049}.get(rows, 0.003 * rows)

    decisions = []
    for _ in range(60):
        chunks = costs.chunk("denoise", [1] * 16)
        decisions.append(tuple(len(c) for c in chunks))
        for chunk in chunks:
            costs.observe("denoise", len(chunk), seconds(len(chunk)))
    assert (8, 8) in decisions[:10]  # the outlier made halves look faster at first
    assert decisions[-20:].count((16,)) >= 18, decisions  # every 50 decisions: still split at decision 60


@pytest.mark.parametrize("slowdown", [2.0, 3.0])
@pytest.mark.parametrize("group", [8, 16, 32])
def test_a_remeasurement_replaces_stale_samples_of_its_size(group, slowdown):
    # NOTE: as seen in the engine at 16 tiny Flux requests: the first two recorded whole-group forwards ran slow
    # (47 and 38 ms, later 22-28 ms: the first calls at the largest size), while the halves, chosen from then on,
    # were timed at every step. A fresh whole-group sample beside the two stale ones left the median stale, and
    # the steps stayed split until the next re-measurement of that size, ~100 decisions later.
    costs = BatchCostModel()  # the default schedule: explore_first=5, explore_every=50
    seen = Counter()

    def seconds(rows):
        seen[rows] += 1
        true = 0.010 + 0.001 * rows  # overhead-bound: the whole group is fastest
        return slowdown * true if rows == group and seen[rows] <= 3 else true  # the warm-up, then two slow

    decisions = []
    for _ in range(60):
        chunks = costs.chunk("denoise", [1] * group)
        decisions.append(tuple(len(c) for c in chunks))
        for chunk in chunks:
            costs.observe("denoise", len(chunk), seconds(len(chunk)))
    halves = (group // 2,) * 2
    assert decisions[5:8] == [halves] * 3, decisions  # the slow samples made halves look faster
    # the whole group is measured again a few decisions after the switch (before the switch was confirmed that
    # way, at the next re-measurement of the neighbour on that side: decision 34), and stays the choice
    assert decisions[8] == (group,), decisions
    assert decisions[8:].count((group,)) >= len(decisions[8:]) - 4, decisions  # the rest: re-measurements
    assert costs.estimate("denoise", group) == pytest.approx(0.010 + 0.001 * group)


@pytest.mark.parametrize("first_alone", [False, True])
@pytest.mark.parametrize("group", [8, 32])
def test_a_slow_whole_group_runs_once_while_exploring(group, first_alone):
    # NOTE: as a burst's decodes on a CPU (32 images in one VAE call: 1.65 s, one by one 0.6 s): the key's first
    # call is a warm-up, not recorded; running the whole group again to measure it cost that much once more.
    # With `first_alone`, one request decoded alone first (its one-row call the warm-up): one-row calls must still
    # be measured, and chosen.
    costs = BatchCostModel(explore_every=0)
    if first_alone:
        assert costs.chunk("decode", [1]) == [[0]]
        costs.observe("decode", 1, decode_like(1))
    decisions = feed(costs, "decode", decode_like, rounds=10, group=group)
    assert decisions.count((group,)) == 1, decisions
    assert decisions[-5:] == [(1,) * group] * 5, decisions


def test_first_call_at_a_shape_is_not_recorded():
    costs = BatchCostModel()
    costs.observe("k", 4, 9.0)  # warm-up outlier
    assert costs.estimate("k", 4) is None
    costs.observe("k", 4, 0.3)
    assert costs.estimate("k", 4) == pytest.approx(0.3)


@pytest.mark.parametrize("largest", [4, 16])
def test_a_first_call_with_fewer_rows_than_before_is_recorded_one_with_more_is_not(largest):
    costs = BatchCostModel()
    costs.observe("k", largest, 9.0)  # the key's first call
    costs.observe("k", largest - 1, 0.5)  # fewer rows than a call before: the memory is there already
    assert costs.estimate("k", largest - 1) == pytest.approx(0.5)
    costs.observe("k", 2 * largest, 20.0)  # more rows than any call before: allocator pools may grow
    assert costs.estimate("k", 2 * largest) == pytest.approx(0.5 * 2 * largest / (largest - 1))  # scaled, not 20
    costs.observe("k", 2 * largest, 1.0)
    assert costs.estimate("k", 2 * largest) == pytest.approx(1.0)


@pytest.mark.parametrize("largest", [4, 16])
def test_on_cuda_every_row_count_has_its_first_call_unrecorded(largest):
    costs = BatchCostModel()
    costs.observe("k", largest, 9.0, new_size_warms_up=True)
    costs.observe("k", largest - 1, 3.0, new_size_warms_up=True)  # fewer rows, but a new shape (cuDNN, cuBLAS)
    assert costs.estimate("k", largest - 1) is None
    costs.observe("k", largest - 1, 0.5, new_size_warms_up=True)
    assert costs.estimate("k", largest - 1) == pytest.approx(0.5)
    costs.observe("k", largest, 1.0, new_size_warms_up=True)  # the first size's second call
    assert costs.estimate("k", largest) == pytest.approx(1.0)


def first_calls_dearer(seconds, extra: float):
    """`seconds(rows)`, plus `extra` at each row count's first call (as CUDA's per-shape plans cost)."""
    seen: set[int] = set()

    def timed(rows: int) -> float:
        first_call = rows not in seen
        seen.add(rows)
        return seconds(rows) + (extra if first_call else 0.0)

    return timed


def per_shape_warm_up_rounds(group: int, first_call_extra: float, new_size_warms_up: bool, rounds: int = 8):
    """A host-bound encode (5 ms + 0.2 ms a row) whose first call at each row count costs `first_call_extra` more;
    one group of `group` one-row items a round, as a closed loop's burst."""
    seconds = first_calls_dearer(lambda rows: 0.005 + 0.0002 * rows, first_call_extra)
    return feed_groups(BatchCostModel(), "encode", seconds, [group] * rounds, new_size_warms_up)


@pytest.mark.parametrize(("group", "first_call_extra"), [(8, 0.03), (8, 0.08), (16, 0.08), (6, 0.08)])
def test_one_time_costs_per_shape_leave_a_batching_group_whole(group, first_call_extra):
    decisions = per_shape_warm_up_rounds(group, first_call_extra, new_size_warms_up=True)
    assert decisions[0] == (group,)  # the whole group first (its warm-up)
    assert sum(len(d) > 1 for d in decisions[3:]) <= 1, decisions  # one re-measurement probe at most
    assert decisions[-3:] == [(group,)] * 3, decisions


def test_recorded_first_calls_per_shape_split_the_group_for_good():
    # NOTE: the contrast, as a profiled H200 round showed it: encodes one row at a time, then in pairs
    decisions = per_shape_warm_up_rounds(8, 0.08, new_size_warms_up=False)
    assert all(len(d) > 1 for d in decisions[2:]), decisions


def decode_like(rows):
    # NOTE: a CPU's tiny VAE: one image per call fastest, batches slower per image the more rows they hold
    return 0.014 if rows == 1 else 0.020 * rows * (1 + rows / 40)


def decode_groups_of_new_sizes(costs: BatchCostModel, requests: int, seed: int, seconds,
                               new_size_warms_up: bool = False) -> list[tuple[int, ...]]:
    """12 rounds of a burst's finishers decoding in two groups of random sizes; each call takes `seconds(rows)`."""
    rng = random.Random(seed)
    groups = []
    for _ in range(12):
        first = rng.randint(1, requests - 1)
        groups += [first, requests - first]
    return feed_groups(costs, "decode", seconds, groups, new_size_warms_up)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("requests", [24, 32])
def test_decode_groups_of_a_new_size_every_time_stop_exploring_whole_groups_soon(seed, requests):
    # NOTE: as a call log at 32 requests showed: each round's finishers decode in two groups of new sizes (11 + 21,
    # 20 + 12, ...); exploring each new size as a whole group first ran 16 whole-group decodes of 3-31 rows
    decisions = decode_groups_of_new_sizes(BatchCostModel(), requests, seed, decode_like)
    several = [d for d in decisions if max(d) > 1]  # calls of several rows: exploration or re-measurement
    assert len(several) <= 10, decisions
    assert sum(max(d) > 1 for d in decisions[-8:]) <= 1, decisions  # one image per call from then on


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("requests", [24, 32])
def test_on_cuda_decode_groups_of_a_new_size_every_time_still_settle_on_whole_groups(seed, requests):
    # NOTE: as above, with every row count's first call a warm-up and 50 ms dearer (CUDA's per-shape plans), and
    # a device where batching pays (8 ms a call + 1 ms a row): ever new sizes must not keep the groups exploring.
    # (Recording the first calls instead ran 30-87 calls for the same 24 groups, 47 or more in 7 of the 10 cases.)
    seconds = first_calls_dearer(lambda rows: 0.008 + 0.001 * rows, 0.05)
    decisions = decode_groups_of_new_sizes(BatchCostModel(), requests, seed, seconds, new_size_warms_up=True)
    # mostly whole groups: one exploration ladder and a few re-measurements in 24 decisions
    assert sum(len(d) == 1 for d in decisions) >= 18, decisions
    assert sum(len(d) for d in decisions) <= 36, decisions


def test_a_size_between_measured_sizes_counts_as_measured():
    costs = BatchCostModel()
    costs.observe("k", 1, 1.0)  # warm-up only
    for rows in (2, 6):
        costs.observe("k", rows, 0.1 * rows)
        costs.observe("k", rows, 0.1 * rows)
    assert costs.is_measured("k", 2) and costs.is_measured("k", 4)
    assert not costs.is_measured("k", 1) and not costs.is_measured("k", 7)


def superlinear(rows):
    return 0.01 * rows ** 1.5


def one_row_fastest(rows):
    # NOTE: as a CPU's tiny VAE decoded: 6 rows as fast as 2 x 3, one row 1.5x faster per row than any batch
    return 0.010 if rows == 1 else 0.015 * rows


@pytest.mark.parametrize("seconds", [superlinear, one_row_fastest])
@pytest.mark.parametrize("groups", [
    [(2, 6), (1, 7), (3, 5), (2, 6), (1, 7), (4, 4)],  # a burst's finishers: a few first, then the rest
    [(5,), (3,), (8,), (6,), (2,), (7,), (4,)],
])
def test_group_sizes_that_change_every_time_conclude_in_a_few_rounds(groups, seconds):
    # NOTE: like decodes on a CPU, where one image at a time is fastest: each round's groups have new sizes
    costs = BatchCostModel(explore_every=0)
    decisions = feed_groups(costs, "decode", seconds, [rows for _ in range(6) for group in groups for rows in group])
    trials = [i for i, d in enumerate(decisions) if max(d) > 1]  # decisions that ran calls of several rows
    # NOTE: exploring only while splitting helped and only exactly measured sizes, this took 12-15 decisions
    assert trials and trials[-1] < 10, decisions
    assert decisions[-12:] == [(1,) * len(d) for d in decisions[-12:]]  # one row per call: the fastest


def test_estimates_interpolate_and_never_invent_gains():
    costs = BatchCostModel()
    for rows, seconds in ((2, 0.2), (6, 0.4)):
        costs.observe("k", rows, seconds)
        costs.observe("k", rows, seconds)
    assert costs.estimate("k", 4) == pytest.approx(0.3)
    assert costs.estimate("k", 12) == pytest.approx(0.8)  # proportional beyond the largest measured size
    assert costs.estimate("other", 4) is None
    assert costs.rows_within("k", 0.36, limit=8) == 5


@pytest.mark.parametrize("rows, expected", [
    ([1] * 8, [(8,), (4, 4), (2, 2, 2, 2), (1,) * 8]),
    ([2, 2, 2], [(6,), (2, 2, 2)]),  # capacity 3 and capacity 1 give the same split: kept once
    ([1, 2, 1, 1], [(5,), (1, 2, 2), (1, 2, 1, 1)]),
])
def test_halving_options_have_no_repeats(rows, expected):
    from diffusers_stepbatch.engine.costs import _halving_options, _sizes

    assert [tuple(_sizes(rows, option)) for option in _halving_options(rows)] == expected


def test_new_group_sizes_use_estimates_once_exploration_concluded():
    costs = BatchCostModel(explore_every=0)
    feed(costs, "tiny", lambda rows: 0.010 + 0.001 * rows, rounds=4)
    assert costs.chunk("tiny", [1] * 7) == [list(range(7))]  # no new trial split for 7 rows
    assert costs.chunk("tiny", [1] * 5) == [list(range(5))]


@pytest.mark.parametrize("split_gain, splits", [(0.02, False), (0.04, False), (0.15, True), (0.30, True)])
def test_a_split_must_beat_the_whole_group_by_more_than_noise(split_gain, splits):
    costs = BatchCostModel(explore_every=0, split_margin=0.05)
    # halves are `split_gain` cheaper in total than the whole group; quarters and below are slower again
    whole = 0.080

    def seconds(rows):
        return {8: whole, 4: whole * (1 - split_gain) / 2}.get(rows, whole * rows / 4)

    decisions = feed(costs, "noisy", seconds)
    assert set(decisions[-6:]) == ({(4, 4)} if splits else {(8,)})


@pytest.mark.parametrize("slowdown", [1.3, 1.5, 2.0])
@pytest.mark.parametrize("group", [8, 16, 32])
def test_sizes_not_run_follow_the_load_that_the_size_run_measures(group, slowdown):
    # NOTE: as seen in the engine at 32 tiny Flux requests: a burst's decodes ran one image per call (16.5 ms) until a
    # busy round timed them at 21-25 ms; beside 4- and 8-row samples from a quiet round, bigger calls then looked as
    # fast, and later rounds decoded 4 or 8 images per call (~24 ms an image), one row never re-measured
    costs = BatchCostModel(explore_every=0)  # no re-measurement: only the load level can keep the choice right
    feed(costs, "decode", decode_like, rounds=4, group=group)
    busy = feed(costs, "decode", lambda rows: slowdown * decode_like(rows), rounds=4, group=group)
    assert busy == [(1,) * group] * 4, busy
    for rows in (1, 2, 4, group // 2):
        assert costs.estimate("decode", rows) == pytest.approx(slowdown * decode_like(rows))
    quiet = feed(costs, "decode", decode_like, rounds=2, group=group)
    assert quiet == [(1,) * group] * 2, quiet
    assert costs.estimate("decode", group // 2) == pytest.approx(decode_like(group // 2))


@pytest.mark.parametrize("seconds, group, steps, bound", [("decode_like", 32, 1, 1.10), ("decode_like", 16, 1, 1.08),
                                                          ("linear", 16, 8, 1.03), ("superlinear", 8, 8, 1.02)])
def test_load_that_changes_from_round_to_round_costs_little(seconds, group, steps, bound):
    # NOTE: load varies +-30% from round to round and each call a few percent more; a cost model without a
    # load level fails the 32, 16 and superlinear cases.
    cost = globals()[seconds]
    ratios = []
    for seed in range(20):
        rng = random.Random(seed)
        costs = BatchCostModel()
        spent = best = 0.0
        for _ in range(40):
            load = rng.lognormvariate(0, 0.3)
            for _ in range(steps):
                for chunk in costs.chunk("k", [1] * group):
                    took = cost(len(chunk)) * load * rng.lognormvariate(0, 0.05)
                    costs.observe("k", len(chunk), took)
                    spent += took
                best += load * min(cost(group), group * cost(1))
        ratios.append(spent / best)
    assert statistics.median(ratios) <= bound, sorted(ratios)


@pytest.mark.parametrize("ramp", [1.3, 1.6])
@pytest.mark.parametrize("group", [16, 32])
def test_a_remeasurement_is_read_against_the_load_of_its_own_group(group, ramp):
    # NOTE: as seen in the engine at 32 tiny Flux requests: a burst's decodes ran slower the later they came (the
    # finished callers' threads woke meanwhile); a 2-row probe run first in a burst, read against the last burst's
    # last calls, looked as fast as two 1-row calls, and the next burst decoded two images per call
    costs = BatchCostModel(explore_first=1, explore_every=2)
    assert feed(costs, "decode", decode_like, rounds=4, group=group)[-1] == (1,) * group  # concluded, load flat
    decisions = []
    for _ in range(40):
        chunks = costs.chunk("decode", [1] * group)
        decisions.append(tuple(len(c) for c in chunks))
        for position, chunk in enumerate(chunks):
            busy = 1 + (ramp - 1) * position / (len(chunks) - 1)  # each group's load rises from 1 to `ramp`
            costs.observe("decode", len(chunk), busy * decode_like(len(chunk)))
    assert all(max(d) <= 2 for d in decisions), decisions  # one image per call, or one 2-row re-measurement
    assert sum(d != (1,) * group for d in decisions) >= 10, decisions  # and re-measurements did run


@pytest.mark.parametrize("group", [8, 16, 32])
def test_an_exploring_group_runs_its_smallest_calls_first(group):
    # NOTE: as a burst's decodes on a CPU: each call finishes its requests, whose callers then run under the GIL
    # during the group's later calls; timed last, one-row decodes looked slower per image than batches
    costs = BatchCostModel(explore_every=0)
    decisions = []
    for _ in range(6):
        chunks = costs.chunk("decode", [1] * group)
        decisions.append(tuple(len(c) for c in chunks))
        finished = 0
        for chunk in chunks:
            busy = 1 + 0.6 * finished / group  # the callers woken so far in this group
            costs.observe("decode", len(chunk), busy * one_row_fastest(len(chunk)))
            finished += len(chunk)
    ladder = tuple(2 ** k for k in range(group.bit_length() - 1))  # 1, 2, 4, ..., group / 2
    assert decisions[1] == (1,) + ladder, decisions
    assert decisions[2:] == [(1,) * group] * 4, decisions


def test_calls_timed_at_zero_seconds_leave_the_load_level_alone():
    # NOTE: host arithmetic under a fake device clock (tests/test_engine_timing.py) takes 0 device seconds
    costs = BatchCostModel()
    for seconds in (0.0, 0.0, 0.0, 0.002, 0.0):
        costs.observe("k", 2, seconds)
    assert costs.estimate("k", 2) == 0.0
    costs.observe("other", 1, 0.004)
    costs.observe("other", 1, 0.004)
    costs.observe("other", 1, 0.0)
    assert costs.estimate("other", 1) == pytest.approx(0.002)  # the median of 0.004 and 0.0; the level still 1
