"""One worker in the scheduler's process, and a shared store: a lookup whose hit continues in
the store reads it into host slots through the worker's own remote tier, and the request
then loads a host hit in the step that schedules it (no parked step); the device blocks get
the very bytes another engine stored. Both engines are kvhal's real sides on the CPU plugin,
over a real Redis server on loopback."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from kvhal.testing.redis_servers import RedisServer
from kvhal.vllm.config import RemoteTierConfig
from kvhal.vllm.scheduler_side import SchedulerSide
from kvhal.vllm.worker_side import WorkerSide
from tests.test_local_read import loaded_in_its_step, run
from tests.test_scheduler_side import output, prefill, request
from tests.test_worker_side import connector_config, kv_caches


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as running:
        yield running


def engine(url: str, engine_id: str, seed: int) -> tuple[SchedulerSide, WorkerSide, dict]:
    config = dataclasses.replace(
        connector_config(slots=8),
        # the timeout policy: these tests wait for their reads, not for the store's speed
        remote_tier=RemoteTierConfig(url, wait_policy="timeout", auth="none"),
        fingerprint={"model": "remote-local"},
        engine_id=engine_id,
    )
    worker = WorkerSide(config)
    caches = kv_caches(split=False, seed=seed)
    worker.register(caches)
    return SchedulerSide(config, local=worker), worker, caches  # as the connector hands it over


def stored(url: str) -> dict:
    """Engine "a" computes request "a" into device blocks 1-3 and writes it to the store."""
    scheduler, worker, caches = engine(url, "a", seed=1)
    req = request("a")
    scheduler.track(req)
    deadline = time.monotonic() + 5
    while scheduler.lookup(req, 0)[0] is None:  # the store's answer (a miss)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    run(scheduler, worker, prefill(scheduler, req, [1, 2, 3]))
    meta = scheduler.build_meta(output())  # the step after: the writes' results come back
    run(scheduler, worker, meta)
    deadline = time.monotonic() + 5
    while scheduler.stats.data.get("tier_written_blocks{tier=redis}", 0) < 3:
        assert time.monotonic() < deadline, "the store write never ended"
        run(scheduler, worker, scheduler.build_meta(output()))
        time.sleep(0.01)
    worker.shutdown()
    scheduler.close()
    return caches


def lookup(scheduler: SchedulerSide, req) -> tuple[int | None, bool]:
    """Ask as vLLM does, once per step, until answered: the answer and how many steps it took."""
    deadline, steps = time.monotonic() + 5, 0
    while True:
        answer = scheduler.lookup(req, 0)
        if answer[0] is not None:
            return answer, steps
        steps += 1
        assert time.monotonic() < deadline, "the lookup never answered"
        scheduler.build_meta(output())
        time.sleep(0.002)


def test_a_store_hit_is_read_by_the_lookup_and_loaded_in_its_step(server):
    caches_a = stored(server.url)
    scheduler, worker, caches = engine(server.url, "b", seed=2)
    b = request("b")
    scheduler.track(b)
    answer, _ = lookup(scheduler, b)
    assert answer == (8, False), "a host hit, loaded in the step that schedules it"
    assert (
        scheduler.stats.data["tier_loaded_blocks{tier=redis}"] == 2 and not scheduler.prefetcher.local_reads
    )
    loaded_in_its_step(scheduler, worker, caches, b, source=caches_a)
    assert scheduler.stats.data["tier_hit_tokens{tier=redis}"] == 8
    worker.shutdown()
    scheduler.close()


def test_a_corrupt_value_in_the_store_is_recomputed_not_served(server):
    stored(server.url)
    client = server.client()
    for name in client.keys("kvhal/*"):
        value = bytearray(client.get(name))
        value[-1] ^= 1  # the block's last byte
        client.set(name, bytes(value))
    scheduler, worker, _ = engine(server.url, "b", seed=2)
    b = request("b")
    scheduler.track(b)
    answer, _ = lookup(scheduler, b)
    assert answer == (0, False), "a corrupt block was offered"
    assert scheduler.stats.data["tier_corrupt_blocks{tier=redis}"] >= 1
    assert scheduler.stats.data["tier_failed_loads{tier=redis}"] == 1
    worker.shutdown()
    scheduler.close()
