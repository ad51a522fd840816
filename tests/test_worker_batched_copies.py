"""A step's stores, and its loads, submitted as one copy per KV cache group (issue 40, item 5):
one plan and one ordering after the compute stream for all of them, each job still reported on
its own; a batch the device refuses falls back to job by job, so that a bad job fails alone;
a batch's copy that fails fails each of its jobs."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvhal.device import Device
from tests.test_worker_side import (  # noqa: F401 (gate: a fixture)
    block,
    gate,
    load,
    registered,
    same,
    settle,
    step,
    store,
    sync_load,
)


def _counting(monkeypatch) -> dict[str, int]:
    calls = {"plan_copy": 0, "order_after_compute": 0}
    for name in calls:
        original = getattr(Device, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Device, name, counted)
    return calls


def test_a_steps_stores_and_loads_are_one_copy_each_and_land_whole(monkeypatch):
    worker, caches = registered(split=False)
    before = {b: block(caches, b) for b in range(1, 11)}
    calls = _counting(monkeypatch)
    stores = [store(0, "a", [1, 2], [0, 1]), store(1, "b", [3], [2]), store(2, "c", [4, 5], [3, 4])]
    step(worker, stores=stores)
    assert calls == {"plan_copy": 1, "order_after_compute": 1}
    (shared,) = worker._job_of_copy.values()  # one copy, every store's
    assert sorted(shared) == [0, 1, 2]
    settle(worker)
    assert worker.worker_meta().succeeded == {0: 1, 1: 1, 2: 1}
    calls.update(plan_copy=0, order_after_compute=0)
    loads = [load(3, "d", [6, 7], [4, 3]), load(4, "e", [8], [0]), sync_load(5, "f", [9, 10], [1, 2])]
    finished, failed, _ = step(worker, loads=loads)
    assert calls == {"plan_copy": 2, "order_after_compute": 2}  # the synchronous one apart
    more, more_failed, _ = settle(worker)
    finished, failed = finished | more, failed | more_failed
    assert finished >= {"d", "e"} and not failed
    for dst, src in ((6, 5), (7, 4), (8, 1), (9, 2), (10, 3)):
        assert all(same(block(caches, dst), before[src])), (dst, src)
    assert worker.worker_meta().succeeded == {3: 1, 4: 1, 5: 1}
    worker.shutdown()


def test_a_refused_batch_is_submitted_job_by_job_and_the_bad_job_fails_alone():
    worker, caches = registered(split=False)
    before = block(caches, 2)
    step(worker, stores=[store(0, "a", [2], [0]), store(1, "b", [99], [1])])  # block 99: none such
    settle(worker)
    meta = worker.worker_meta()
    assert meta.succeeded == {0: 1} and meta.failed == {1: 1}
    step(worker, loads=[load(2, "c", [5], [0])])
    settle(worker)
    assert all(same(block(caches, 5), before))
    worker.shutdown()


def test_a_failed_batch_copy_fails_each_of_its_jobs(gate):  # noqa: F811
    worker, _ = registered(split=False)
    gate.fail = True
    step(worker, stores=[store(0, "a", [2], [0]), store(1, "b", [3], [1])])
    settle(worker)
    assert worker.worker_meta().failed == {0: 1, 1: 1}
    worker.shutdown()
