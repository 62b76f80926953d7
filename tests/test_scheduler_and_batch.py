"""StepScheduler and make_batch/split on hand-made inputs: no models, no engine thread."""

import pytest
import torch

from diffusers_stepbatch.engine.batch import WorkItem, make_batch, split
from diffusers_stepbatch.engine.request import Request, RequestHandle, RequestStatus
from diffusers_stepbatch.engine.scheduler import SchedulerConfig, StepScheduler

NOW = 1000.0


def fake_request(request_id, rows, steps=4, arrival=NOW, **fields):
    request = Request(request_id=request_id, program=iter(()), handle=RequestHandle(request_id), num_rows=rows,
                      num_steps=steps, **fields)
    request.stats.arrival_time = arrival
    return request


@pytest.mark.parametrize("limit, rows, admitted_first", [(8, [2, 2, 2, 2, 2], 4), (4, [1, 2, 1, 3], 3), (3, [5, 1], 1)])
def test_admission_respects_rows_in_arrival_order(limit, rows, admitted_first):
    scheduler = StepScheduler(SchedulerConfig(max_batch_size=limit))
    requests = [fake_request(i, r) for i, r in enumerate(rows)]
    for request in requests:
        scheduler.add(request)
    plan = scheduler.schedule(NOW)
    assert [r.request_id for r in plan.admitted] == list(range(admitted_first))
    assert all(r.status == RequestStatus.RUNNING for r in plan.admitted)
    assert list(scheduler.waiting) == requests[admitted_first:]


def test_oversized_request_runs_alone_then_others_join():
    scheduler = StepScheduler(SchedulerConfig(max_batch_size=2))
    big, small = fake_request(0, 5), fake_request(1, 1)
    scheduler.add(big)
    scheduler.add(small)
    assert scheduler.schedule(NOW).admitted == [big]
    assert scheduler.schedule(NOW).admitted == []  # still full
    scheduler.finish(big, RequestStatus.FINISHED_OK)
    assert scheduler.schedule(NOW).admitted == [small]
    assert big.status.is_finished and not small.status.is_finished


def test_finish_requires_finished_status_and_removes_waiting():
    scheduler = StepScheduler(SchedulerConfig(max_batch_size=1))
    first, second = fake_request(0, 1), fake_request(1, 1)
    scheduler.add(first)
    scheduler.add(second)
    scheduler.schedule(NOW)
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish(second, RequestStatus.RUNNING)
    scheduler.finish(second, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.waiting and scheduler.running == [first]
    assert RequestStatus.FINISHED_ABORTED > RequestStatus.PREEMPTED > RequestStatus.RUNNING


def test_invalid_max_batch_size():
    with pytest.raises(ValueError, match="max_batch_size=0"):
        SchedulerConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="policy='lifo'"):
        SchedulerConfig(policy="lifo")


@pytest.mark.parametrize("rows", [[1], [2, 1, 3], [4, 4]])
def test_make_batch_and_split_round_trip(rows):
    items = [
        WorkItem("denoise", "k", {"x": torch.full((r, 3), float(i)), "names": [f"{i}"] * r, "none": None},
                 run=lambda x, names, none: (x * 2, x.sum(-1)), rows=r)
        for i, r in enumerate(rows)
    ]
    batch = make_batch(items)
    assert batch.num_rows == sum(rows) and batch.inputs["none"] is None
    assert batch.inputs["names"] == [name for item in items for name in item.inputs["names"]]
    parts = split(batch.run(**batch.inputs), batch.bounds)
    for i, (item, (doubled, summed)) in enumerate(zip(items, parts)):
        assert torch.equal(doubled, item.inputs["x"] * 2)
        assert doubled.shape[0] == item.rows and torch.equal(summed, torch.full((item.rows,), 3.0 * i))


def test_split_rejects_non_tensor_output():
    with pytest.raises(TypeError, match="rows along dim 0"):
        split("oops", [(0, 1)])
