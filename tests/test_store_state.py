"""Each store's state now (issue 37): the ``tier_state`` gauge says up (1), down (0) or
refused (2: the store answers, but kvhal refuses what it read there). Engines are kvhal's
real sides on the CPU plugin over a real Redis server; "refused" is a fleet secret's
mismatch, as an engine started with another secret meets it, read in the scheduler's process
(an in-process worker's prefetch) and by a worker of its own (its counters reach the
scheduler in the step's output, as vLLM hands them over)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput

from kvhal.testing.redis_servers import RedisServer
from kvhal.vllm.config import RemoteTierConfig
from kvhal.vllm.metadata import KVHALMetadata
from kvhal.vllm.scheduler_side import SchedulerSide
from kvhal.vllm.store_state import DOWN, REFUSED, UP, StoreStates
from kvhal.vllm.worker_side import WorkerSide
from tests.test_local_read import run
from tests.test_remote_local_read import lookup
from tests.test_scheduler_remote import answered
from tests.test_scheduler_side import output, prefill, request
from tests.test_worker_side import connector_config, kv_caches, settle

STATE, UP_GAUGE = "tier_state{tier=redis}", "tier_up{tier=redis}"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as running:
        yield running


def engine(url: str, engine_id: str, in_process: bool = True) -> tuple[SchedulerSide, WorkerSide]:
    """An engine over the store at ``url``, its values signed with KVHAL_REMOTE_SECRET (hmac,
    the default): the worker in the scheduler's process, or its own (``in_process`` False)."""
    config = dataclasses.replace(
        connector_config(slots=8),
        remote_tier=RemoteTierConfig(url, wait_policy="timeout"),
        fingerprint={"model": "store-state"},
        engine_id=engine_id,
    )
    worker = WorkerSide(config)
    worker.register(kv_caches(split=False, seed=1))
    return SchedulerSide(config, local=worker if in_process else None), worker


def gauges(scheduler: SchedulerSide) -> dict[str, int]:
    """The store's gauges as the next report carries them (each sent when it changes)."""
    scheduler._gauges()
    data = (scheduler.stats.take() or scheduler.stats).data
    sent = scheduler._gauges_sent
    return {key: data.get(key, sent[key]) for key in (STATE, UP_GAUGE)}


def step(scheduler: SchedulerSide, worker: WorkerSide, meta: KVHALMetadata) -> None:
    """One step on a worker of its own: its jobs, then its report with its counters, as
    vLLM's model runner hands them to the scheduler (``KVConnectorOutput.kv_connector_stats``)."""
    worker.begin_step(meta)
    worker.start_loads(meta)
    worker.start_stores(meta)
    settle(worker)
    scheduler.on_output(
        KVConnectorOutput(
            kv_connector_worker_meta=worker.worker_meta(), kv_connector_stats=worker.take_stats(True)
        )
    )


def written(scheduler: SchedulerSide, worker: WorkerSide, name: str) -> None:
    """Request ``name`` computed and written to the store."""
    req = request(name)
    scheduler.track(req)
    assert lookup(scheduler, req)[0] == (0, False)
    run(scheduler, worker, prefill(scheduler, req, [1, 2, 3]))
    deadline = time.monotonic() + 10
    while scheduler.stats.data.get("tier_written_blocks{tier=redis}", 0) < 3:
        assert time.monotonic() < deadline, "the store write never ended"
        run(scheduler, worker, scheduler.build_meta(output()))
        time.sleep(0.01)
    scheduler.request_finished(req)


def test_a_store_of_another_secret_is_refused_until_a_read_is_served_and_down_when_it_stops(
    server, monkeypatch
):
    monkeypatch.setenv("KVHAL_REMOTE_SECRET", "the-old-fleet")
    old, old_worker = engine(server.url, "old")
    written(old, old_worker, "a")  # the prompt's blocks in Redis, signed with the old secret
    old_worker.shutdown()
    old.close()

    monkeypatch.setenv("KVHAL_REMOTE_SECRET", "the-new-fleet")
    new, worker = engine(server.url, "new")
    try:
        assert gauges(new) == {STATE: UP, UP_GAUGE: 1}, "it answers; nothing read yet"
        b = request("b")  # the same prompt: the store holds its blocks, under the old secret
        new.track(b)
        assert lookup(new, b)[0] == (0, False), "refused values are recomputed"
        assert new.stats.data["tier_unauthenticated_blocks{tier=redis}"] == 2
        assert gauges(new) == {STATE: REFUSED, UP_GAUGE: 1}, "up, and refused"
        assert gauges(new) == {STATE: REFUSED, UP_GAUGE: 1}, "it stays refused while nothing is read"
        # the new engine's recompute replaces the refused values; read again, they are served
        written(new, worker, "c")
        assert new.reset(), "the host tier forgets them: the next hit is read from the store"
        d = request("d")
        new.track(d)
        assert lookup(new, d)[0] == (8, False) and new.stats.data["tier_read_bytes{tier=redis}"] > 0
        assert gauges(new) == {STATE: UP, UP_GAUGE: 1}
        server.stop()
        e = request("e", list(range(300, 312)))
        new.track(e)
        assert lookup(new, e)[0] == (0, False)
        assert gauges(new) == {STATE: DOWN, UP_GAUGE: 0}
    finally:
        worker.shutdown()
        new.close()


def test_a_workers_refusals_reach_the_state_through_the_steps_output(server, monkeypatch):
    """The worker in a process of its own: its counters are in its step's output only."""
    monkeypatch.setenv("KVHAL_REMOTE_SECRET", "the-old-fleet")
    old, old_worker = engine(server.url, "old")
    written(old, old_worker, "a")
    old_worker.shutdown()
    old.close()

    monkeypatch.setenv("KVHAL_REMOTE_SECRET", "the-new-fleet")
    new, worker = engine(server.url, "new", in_process=False)
    try:
        b = request("b")
        new.track(b)
        assert answered(new, b) == (None, False), "a prefetch, for the worker to read"
        meta = new.build_meta(output())
        assert len(meta.prefetches) == 1
        step(new, worker, meta)
        assert "tier_unauthenticated_blocks{tier=redis}" not in new.stats.data, "the worker's count"
        assert gauges(new) == {STATE: REFUSED, UP_GAUGE: 1}
    finally:
        worker.shutdown()
        new.close()


def test_a_store_answering_with_values_it_partly_serves_is_up():
    """Counts from one report: a served read wins over refusals (the store serves); refusals
    alone refuse; a store down forgets its refusals (back up, it is up until a read says
    otherwise)."""
    states = StoreStates(["redis"])
    states.count({"tier_read_bytes{tier=redis}": 4096, "tier_corrupt_blocks{tier=redis}": 1})
    assert states.states({"redis": True}) == {"redis": UP}
    states.count({"tier_foreign_blocks{tier=redis}": 2, "tier_missing_blocks{tier=redis}": 1})
    assert states.states({"redis": True}) == {"redis": REFUSED}
    states.count({"tier_io_errors{tier=redis}": 3})  # the network, not a refusal: no change
    assert states.states({"redis": True}) == {"redis": REFUSED}
    assert states.states({"redis": False}) == {"redis": DOWN}
    assert states.states({"redis": True}) == {"redis": UP}
    states.count({"tier_missing_blocks{tier=redis}": 2})  # not there: no refusal
    assert states.states({"redis": True}) == {"redis": UP}
