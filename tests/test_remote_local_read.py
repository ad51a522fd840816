"""One worker in the scheduler's process, and a shared store: a lookup whose hit continues in
the store reads it into host slots through the worker's own remote tier, and the request
then loads a host hit in the step that schedules it (no parked step); the device blocks get
the very bytes another engine stored; with a disk tier above the store, one lookup reads each
block from the first tier holding it, both tiers at once. Both engines are kvhal's real sides
on the CPU plugin, over a real Redis server on loopback."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvhal.testing.redis_servers import RedisServer
from kvhal.vllm.arrivals import arrived
from kvhal.vllm.config import LowerTierConfig, RemoteTierConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.scheduler_side import SchedulerSide
from kvhal.vllm.worker_side import WorkerSide
from tests.test_local_read import loaded_in_its_step, run
from tests.test_scheduler_side import output, prefill, request
from tests.test_worker_side import block, connector_config, kv_caches, same


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as running:
        yield running


def engine(
    url: str | None, engine_id: str, seed: int, disk: Path | None = None
) -> tuple[SchedulerSide, WorkerSide, dict]:
    """An engine over the store at ``url`` (``None``: none), below a disk tier at ``disk``."""
    lower = None
    if disk is not None:
        options = {"path": str(disk), "bytes_to_use": 1 << 20}
        lower = LowerTierConfig("disk", options, "through", "clock", wait_policy="timeout")
    config = dataclasses.replace(
        connector_config(slots=8),
        lower_tier=lower,
        # the timeout policy: these tests wait for their reads, not for the store's speed
        remote_tier=RemoteTierConfig(url, wait_policy="timeout", auth="none") if url else None,
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


def test_a_request_arriving_starts_its_lookup_and_read_and_its_lookup_waits_for_the_rest(server):
    """On the CPU plugin, ``on_new_request`` (``arrived``) asks the store and starts the read
    without waiting for it, so requests arriving together read at once; the request's lookup
    in its step then answers the host hit in one call. The control: without the in-process
    worker nothing starts at arrival."""
    caches_a = stored(server.url)
    scheduler, worker, caches = engine(server.url, "b", seed=2)
    b = request("b")
    arrived(scheduler, b)
    state = scheduler._requests[b.request_id]
    assert state.prefetched and state.probes, "the store asked and the read started at arrival"
    assert scheduler.lookup(b, 0) == (8, False), "answered in the step's first lookup"
    loaded_in_its_step(scheduler, worker, caches, b, source=caches_a)
    worker.shutdown()
    scheduler.close()
    scheduler, worker, _ = engine(server.url, "c", seed=3)
    scheduler.local = None  # the workers in other processes: their reads are their jobs
    c = request("b")
    arrived(scheduler, c)
    assert not scheduler._requests[c.request_id].prefetched and not scheduler._requests[c.request_id].probes
    worker.shutdown()
    scheduler.close()


def test_arrivals_stop_being_looked_up_while_many_wait_unasked(server, monkeypatch):
    """A saturated engine: past ARRIVING requests looked up at arrival and not yet asked about
    by vLLM, an arrival waits for vLLM's lookup (blocks read for a request far back in the
    queue could be evicted before it runs); one asked makes room again."""
    import kvhal.vllm.arrivals

    monkeypatch.setattr(kvhal.vllm.arrivals, "ARRIVING", 2)
    scheduler, worker, _ = engine(server.url, "b", seed=2)
    first, second, third, fourth = (request(name) for name in ("r1", "r2", "r3", "r4"))
    for req in (first, second, third):
        arrived(scheduler, req)
    assert scheduler.arriving == {"r1", "r2"}, "the third arrival is not looked up"
    assert not scheduler._requests["r3"].probes
    scheduler.lookup(first, 0)  # vLLM asks about the first
    arrived(scheduler, fourth)
    assert scheduler.arriving == {"r2", "r4"}
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


def test_a_block_whose_read_fails_costs_the_hit_from_that_block_on_not_the_whole_hit(server):
    """The lookup said the store holds both blocks; the read finds the second corrupt (as it
    finds an object expired between the names an S3 lookup asks). The first block, read
    whole, is still the hit, with the bytes engine "a" stored; the control: the whole prefix
    corrupt is no hit at all."""
    caches_a = stored(server.url)
    client = server.client()
    scheduler, worker, caches = engine(server.url, "b", seed=2)
    b = request("b")
    scheduler.track(b)
    (tier,) = worker.tiers.values()
    second = offload_key(b.block_hashes[1], 0)
    (name,) = tier.store.names([second])  # type: ignore[attr-defined]
    value = bytearray(client.get(name))
    value[-1] ^= 1
    client.set(name, bytes(value))
    answer, _ = lookup(scheduler, b)
    assert answer == (4, False), "the first block is the hit, loaded in its step"
    assert scheduler.stats.data["tier_corrupt_blocks{tier=redis}"] == 1
    assert scheduler.stats.data["tier_failed_loads{tier=redis}"] == 1
    scheduler.after_alloc(b, KVCacheBlocks(([KVCacheBlock(7)],)), 4)
    run(scheduler, worker, scheduler.build_meta(output()))
    assert worker.take_load_errors() == set()
    assert all(same(block(caches, 7), block(caches_a, 1))), "block 7 is not what the store held"
    worker.shutdown()
    scheduler.close()
    first = offload_key(b.block_hashes[0], 0)
    (name,) = tier.store.names([first])  # type: ignore[attr-defined]
    value = bytearray(client.get(name))
    value[-1] ^= 1
    client.set(name, bytes(value))
    scheduler, worker, _ = engine(server.url, "c", seed=3)
    c = request("b")
    scheduler.track(c)
    assert lookup(scheduler, c)[0] == (0, False), "a corrupt first block: no hit"
    worker.shutdown()
    scheduler.close()


def test_a_hit_on_the_disk_then_in_the_store_is_read_from_both_in_one_lookup(server, tmp_path):
    """Engine "b" has a disk tier above the store. Its disk holds the first block of "a"'s
    prompt (from a prompt of its own sharing that block, before a restart), the store all of
    "a"'s blocks (engine "a" stored them). One lookup reads the first block from the disk (the
    first tier of the list holding it, though the store holds it too) and the second from the
    store, at once, into host slots: a host hit loaded in its step, each block with the bytes
    of the tier that served it."""
    scheduler, worker, caches_b = engine(None, "b", seed=3, disk=tmp_path / "disk")
    p = request("p", request("a").prompt_token_ids[:4] + list(range(500, 508)))
    assert p.block_hashes[0] == request("a").block_hashes[0] != p.block_hashes[1]
    run(scheduler, worker, prefill(scheduler, p, [1, 2, 3]))  # written through to the disk
    worker.shutdown()
    scheduler.close()
    caches_a = stored(server.url)
    scheduler, worker, caches = engine(server.url, "b", seed=2, disk=tmp_path / "disk")  # restarted
    assert [tier.chain.name for tier in scheduler.tiers] == ["disk", "redis"]
    a = request("a")
    scheduler.track(a)
    answer, _ = lookup(scheduler, a)
    assert answer == (8, False), "a host hit, loaded in the step that schedules it"
    assert not scheduler.prefetcher.local_reads
    assert scheduler.stats.data["tier_loaded_blocks{tier=disk}"] == 1
    assert scheduler.stats.data["tier_loaded_blocks{tier=redis}"] == 1
    before = [block(caches, i) for i in (7, 8)]
    scheduler.after_alloc(a, KVCacheBlocks(([KVCacheBlock(7), KVCacheBlock(8)],)), 8)
    meta = scheduler.build_meta(output())
    assert meta.prefetches == [] and [(job.sync, job.reads) for job in meta.loads] == [(True, [])]
    run(scheduler, worker, meta)
    assert worker.take_load_errors() == set()
    assert all(same(block(caches, 7), block(caches_b, 1))), "block 7 is not what the disk held"
    assert all(same(block(caches, 8), block(caches_a, 2))), "block 8 is not what the store held"
    # the controls: the store's first block (engine "a"'s) differs from the disk's, and the
    # device blocks held neither before
    assert not any(same(block(caches_a, 1), block(caches_b, 1)))
    assert not any(same(before[0], block(caches_b, 1))) and not any(same(before[1], block(caches_a, 2)))
    assert scheduler.stats.data["tier_hit_tokens{tier=disk}"] == 4
    assert scheduler.stats.data["tier_hit_tokens{tier=redis}"] == 4
    worker.shutdown()
    scheduler.close()
