"""Fair share between tenants (deficit round robin at admission), simulated with made-up requests: no torch.

Each simulated engine step admits what the scheduler plans, advances every running request by one step and
finishes those done, as the engine does."""

import random
from collections import Counter

import pytest

from diffusers_stepbatch.engine.fair_share import FairShare
from diffusers_stepbatch.engine.request import RequestStatus
from diffusers_stepbatch.engine.scheduler import SchedulerConfig, StepScheduler

from .test_scheduler_and_batch import NOW, fake_request


def simulate(scheduler, arrivals, steps_limit=10_000):
    """Run until everything finished; `arrivals`: {step: [requests]}. Returns ({id: admitted step},
    {id: finished step}, {tenant: row-steps served per step})."""
    admitted, finished, served = {}, {}, []
    for step in range(steps_limit):
        for request in arrivals.get(step, ()):
            scheduler.add(request)
        if not scheduler.has_work() and step > max(arrivals):
            break
        for request in scheduler.schedule(NOW + step).admitted:
            admitted[request.request_id] = step
        row_steps = Counter()
        for request in list(scheduler.running):
            request.steps_done += 1
            row_steps[request.tenant] += request.num_rows
            if request.remaining_steps == 0:
                scheduler.finish(request, RequestStatus.FINISHED_OK)
                finished[request.request_id] = step
        served.append(row_steps)
    return admitted, finished, served


def burst_and_lone(fair_share: bool):
    scheduler = StepScheduler(SchedulerConfig(max_batch_size=8, fair_share=fair_share))
    burst = [fake_request(i, 2, steps=8, arrival=NOW, tenant="burst") for i in range(200)]
    lone = fake_request(1000, 2, steps=8, arrival=NOW + 3, tenant="lone")
    return simulate(scheduler, {0: burst, 3: [lone]})


def test_a_burst_of_200_does_not_starve_another_tenants_single_request():
    fcfs_admitted, fcfs_finished, _ = burst_and_lone(fair_share=False)
    fair_admitted, fair_finished, _ = burst_and_lone(fair_share=True)
    assert fcfs_admitted[1000] == 400  # behind all 200 (4 at a time, 8 steps each)
    assert fair_admitted[1000] == 8  # the first slot that frees after it arrived
    # the burst loses nothing: it finishes at the same step, one request's steps later at most
    assert max(fair_finished[i] for i in range(200)) - max(fcfs_finished[i] for i in range(200)) <= 8


def test_row_steps_follow_the_weights_under_contention():
    scheduler = StepScheduler(SchedulerConfig(max_batch_size=6, fair_share=True,
                                              tenant_weights={"gold": 2.0, "free": 1.0}))
    arrivals = [fake_request(i, 1, steps=5, arrival=NOW, tenant="gold") for i in range(300)]
    arrivals += [fake_request(1000 + i, 1, steps=5, arrival=NOW, tenant="free") for i in range(300)]
    random.Random(0).shuffle(arrivals)
    _, _, served = simulate(scheduler, {0: arrivals})
    busy = served[20:200]  # both backlogged, past the first admissions
    gold, free = sum(c["gold"] for c in busy), sum(c["free"] for c in busy)
    assert gold / free == pytest.approx(2.0, rel=0.1)
    assert all(sum(c.values()) == 6 for c in busy)  # the batch stays full


def test_equal_weights_share_row_steps_not_request_counts():
    scheduler = StepScheduler(SchedulerConfig(max_batch_size=4, fair_share=True))
    long = [fake_request(i, 2, steps=16, arrival=NOW, tenant="long") for i in range(50)]
    short = [fake_request(100 + i, 1, steps=4, arrival=NOW, tenant="short") for i in range(400)]
    _, _, served = simulate(scheduler, {0: long + short})
    busy = served[10:300]
    ratio = sum(c["long"] for c in busy) / sum(c["short"] for c in busy)
    assert ratio == pytest.approx(1.0, rel=0.15)


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "priority"])
def test_one_tenant_admits_exactly_as_without_fair_share(policy):
    rng = random.Random(1)
    specs = [(i, rng.choice([1, 2, 3]), rng.randint(1, 12), rng.randint(0, 3), rng.randint(0, 40))
             for i in range(120)]

    def run(fair: bool):
        scheduler = StepScheduler(SchedulerConfig(max_batch_size=5, policy=policy, fair_share=fair, max_wait_s=15))
        arrivals = {}
        for i, rows, steps, priority, at in specs:
            arrivals.setdefault(at, []).append(fake_request(i, rows, steps=steps, priority=priority, arrival=NOW + at))
        return simulate(scheduler, arrivals)[0]

    assert run(True) == run(False)


def test_an_idle_tenant_keeps_no_credit():
    share = FairShare()

    class Row:
        def __init__(self, tenant, cost):
            self.tenant, self.num_rows, self.remaining_steps = tenant, 1, cost

    a = [Row("a", 4) for _ in range(3)]
    b = [Row("b", 4)]
    first = share.pick({"a": a, "b": b})
    share.charge(first)
    assert share.pick({"a": a[1:], "b": []}) is a[1]  # b left: its deficit is dropped
    assert "b" not in share.deficit
