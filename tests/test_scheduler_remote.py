"""The scheduler side's use of the remote tier, against a real Redis server.

Lookups are asked again while the store has not answered, and are a miss
after the timeout; blocks the store holds are prefetched into host slots while
the request waits, then loaded as a host hit (or, over the prefetch budget, read
by the request's load); writes beyond the in-flight cap, or to a store that is down, are
dropped and counted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvhal.testing.redis_servers import RedisServer
from kvhal.tiers.backend import TierSpec
from kvhal.tiers.remote.tier import RemoteTier
from kvhal.vllm.config import ConnectorConfig, GroupInfo, RemoteTierConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.metadata import ReadJob
from kvhal.vllm.scheduler_side import SchedulerSide
from tests.test_scheduler_side import BS, PAGE, PROMPT, output, prefill, reported, request


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as running:
        yield running


def side(url: str, cpu_slots: int = 64, world_size: int = 1, **remote) -> SchedulerSide:
    # the timeout policy unless asked: these tests are about the reads, not the store's speed
    remote.setdefault("wait_policy", "timeout")
    config = ConnectorConfig(
        cpu_bytes_to_use=cpu_slots * PAGE,
        device=None,
        eviction_policy="lru",
        offload_prompt_only=True,
        block_size=BS,
        groups=(GroupInfo(0, ("l0",), PAGE, 8),),
        world_size=world_size,
        layout="LBHNC",
        remote_tier=RemoteTierConfig(url, **{"auth": "none", **remote}),
        fingerprint={"model": "scheduler-remote-test"},
    )
    return SchedulerSide(config)


def redis_tier(scheduler: SchedulerSide) -> RemoteTier:
    """The scheduler side's client of the Redis store."""
    [tier] = scheduler.stores
    assert tier.name == "redis" and tier.store is not None
    return tier.store


def hit(scheduler: SchedulerSide, req, timeout: float = 5.0) -> tuple[int, int]:
    """Ask until the lookup answers: ``(tokens, times asked)``."""
    deadline, asked = time.monotonic() + timeout, 0
    while True:
        asked += 1
        tokens, _ = scheduler.lookup(req, 0)
        if tokens is not None:
            return tokens, asked
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.005)


def put_blocks(scheduler: SchedulerSide, url: str, hashes: list[bytes]) -> None:
    """What another engine of the same KV wrote: values under this engine's names."""
    config = scheduler.config
    spec = TierSpec({}, config.slot_bytes, fingerprint=config.fingerprint, role="index")
    tier = RemoteTier(url, spec)
    raw = redis.Redis.from_url(url)
    for name in tier.names([offload_key(h, 0) for h in hashes]):
        raw.set(name, b"x")  # existence is all a lookup asks; reads verify the bytes later
    raw.close()
    tier.close()


def answered(scheduler: SchedulerSide, req, timeout: float = 5.0) -> tuple[int | None, bool]:
    """Ask until the store's answer to the lookup came: the answer after it."""
    deadline = time.monotonic() + timeout
    while (probe := scheduler.track(req).probes.get("redis")) is None or not probe.future.done():
        answer = scheduler.lookup(req, 0)
        assert answer[0] is None, "the lookup answered before the store did"
        assert time.monotonic() < deadline, "the store never answered"
        time.sleep(0.005)
    return scheduler.lookup(req, 0)


def test_a_store_hit_is_prefetched_at_lookup_then_loaded_as_a_host_hit(server):
    scheduler = side(server.url)
    req = request("a")
    put_blocks(scheduler, server.url, list(req.block_hashes[:2]))
    assert answered(scheduler, req) == (None, False), "the store's blocks are read first: ask again"
    [prefetch] = scheduler.build_meta(output()).prefetches
    keys = [offload_key(h, 0) for h in req.block_hashes[:2]]
    assert isinstance(prefetch, ReadJob)
    [read] = prefetch.reads  # from the store alone
    assert read.tier == "redis" and read.slots == []
    assert read.keys == keys and len(set(read.host_slots)) == 2
    assert scheduler.lookup(req, 0) == (None, False), "waits while the read is in flight"
    reported(scheduler, [prefetch.job_id])  # the workers read the blocks into host memory
    assert scheduler.lookup(req, 0) == (2 * BS, False), "then a host hit, loaded in its step"
    assert scheduler.stats.data["tier_lookups{tier=redis}"] == 1, "the store was asked once"
    assert scheduler.stats.data["tier_loaded_blocks{tier=redis}"] == 2
    scheduler.after_alloc(req, KVCacheBlocks(([KVCacheBlock(i) for i in (5, 6, 7)],)), 2 * BS)
    [load] = scheduler.build_meta(output()).loads
    assert load.sync and load.reads == []
    assert scheduler.stats.data["tier_hit_tokens{tier=redis}"] == 2 * BS
    scheduler.close()


def test_a_failed_prefetch_from_the_store_is_recomputed_and_not_read_again(server):
    scheduler = side(server.url)
    req = request("a")
    put_blocks(scheduler, server.url, list(req.block_hashes[:2]))
    assert answered(scheduler, req) == (None, False)
    [prefetch] = scheduler.build_meta(output()).prefetches
    reported(scheduler, [prefetch.job_id], ok=False)  # e.g. a checksum mismatch on a worker
    assert scheduler.stats.data["tier_failed_loads{tier=redis}"] == 1
    assert scheduler.manager.lookup([offload_key(req.block_hashes[0], 0)]) == 0, "a failed read left a block"
    assert scheduler.lookup(req, 0) == (0, False), "recomputed: the store is not read for it again"
    assert scheduler.build_meta(output()).prefetches == []
    scheduler.close()


def test_past_its_deadline_a_store_prefetch_is_recomputed_and_its_slots_freed_when_it_ends(server):
    scheduler = side(server.url, load_timeout_ms=50)
    req = request("a")
    put_blocks(scheduler, server.url, list(req.block_hashes[:2]))
    assert answered(scheduler, req) == (None, False)
    [prefetch] = scheduler.build_meta(output()).prefetches
    time.sleep(0.1)
    assert scheduler.lookup(req, 0) == (0, False), "past the wait: recompute"
    assert scheduler.stats.data["tier_prefetch_timeouts{tier=redis}"] == 1
    free = scheduler.manager.num_free
    reported(scheduler, [prefetch.job_id], ok=False)  # the stalled read ends, failed
    assert scheduler.manager.num_free == free + 2, "the read's host slots were not freed"
    scheduler.close()


def test_over_the_prefetch_budget_a_store_hit_is_read_by_its_load(server):
    scheduler = side(server.url, cpu_slots=4)  # a budget of 2 blocks in flight
    a, b = request("a"), request("b", [t + 100 for t in PROMPT])
    put_blocks(scheduler, server.url, list(a.block_hashes[:2]) + list(b.block_hashes[:2]))
    assert answered(scheduler, a) == (None, False)  # its prefetch takes the whole budget
    tokens, _ = hit(scheduler, b)
    assert tokens == 2 * BS and scheduler.stats.data["tier_prefetch_skipped_blocks{tier=redis}"] == 2
    scheduler.after_alloc(b, KVCacheBlocks(([KVCacheBlock(i) for i in (5, 6, 7)],)), 2 * BS)
    meta = scheduler.build_meta(output())
    [load] = meta.loads
    assert not load.sync
    [read] = load.reads  # from the store alone
    assert read.tier == "redis" and read.keys == [offload_key(h, 0) for h in b.block_hashes[:2]]
    reported(scheduler, [load.job_id], ok=False)  # the read failed on the worker: recompute
    assert scheduler.stats.data["tier_failed_loads{tier=redis}"] == 1
    assert scheduler.manager.lookup([offload_key(b.block_hashes[0], 0)]) == 0, "a failed read left a block"
    scheduler.close()


def test_a_store_that_does_not_answer_in_time_is_a_miss(server):
    scheduler = side(server.url, lookup_timeout_ms=100)
    client = server.client()
    client.execute_command("CLIENT", "PAUSE", 1500)  # the store hangs
    try:
        start = time.monotonic()
        tokens, asked = hit(scheduler, request("a"))
        waited = time.monotonic() - start
    finally:
        client.execute_command("CLIENT", "UNPAUSE")
    assert tokens == 0 and asked > 1, "the engine was not asked to come back while the store hung"
    assert 0.1 <= waited < 1.0, f"the lookup waited {waited:.2f} s for a 100 ms timeout"
    assert scheduler.stats.data["tier_lookup_timeouts{tier=redis}"] == 1
    scheduler.close()


def test_writes_beyond_the_in_flight_cap_or_to_a_down_store_are_dropped(server):
    scheduler = side(server.url, max_inflight_blocks=4)
    a, b = request("a"), request("b", [t + 100 for t in PROMPT])
    assert hit(scheduler, a)[0] == 0 and hit(scheduler, b)[0] == 0  # the store answered: it is up
    [store_a] = prefill(scheduler, a, [1, 2, 3]).stores
    [write_a] = store_a.writes
    assert write_a.tier == "redis" and write_a.slots == []
    assert len(write_a.keys) == 3
    [store_b] = prefill(scheduler, b, [4, 5, 6]).stores
    assert store_b.writes == [], "3 + 3 blocks in flight exceed the cap of 4"
    assert scheduler.stats.data["tier_dropped_blocks{tier=redis}"] == 3
    # the store's copy and then its write end: room again
    reported(scheduler, [store_a.job_id])
    reported(scheduler, [write_a.job_id])
    assert scheduler.stats.data["tier_written_blocks{tier=redis}"] == 3
    server.stop()
    c = request("c", [t + 200 for t in PROMPT])
    assert hit(scheduler, c)[0] == 0
    assert scheduler.stats.data["tier_lookup_errors{tier=redis}"] == 1 and not redis_tier(scheduler).up
    [store_c] = prefill(scheduler, c, [7, 8, 9]).stores
    assert store_c.writes == [], "a write was planned to a store that is down"
    assert scheduler.stats.data["tier_dropped_blocks{tier=redis}"] == 6
    scheduler.close()


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_failed_store_keeps_its_slots_until_every_ranks_write_from_them_ended(server, world_size):
    """With tensor parallelism, rank 0's store fails while rank 1's succeeds and rank 1 writes
    its share to the store from the host slots: freed at the store's failure, a new store could
    overwrite them mid-write (wrong KV in the store). They are freed once every rank reported
    the write. The control: one rank, whose failed store's write never runs, frees at once."""
    scheduler = side(server.url, world_size=world_size)
    a = request("a")
    assert hit(scheduler, a)[0] == 0
    [store] = prefill(scheduler, a, [1, 2, 3]).stores
    [write_job] = store.writes
    write = write_job.job_id
    free = scheduler.manager.num_free
    reported(scheduler, [store.job_id], ok=False)  # rank 0: failed (its write never runs)
    reported(scheduler, [write], ok=False)
    if world_size == 2:
        reported(scheduler, [store.job_id])  # rank 1: stored, and writing from the slots
        assert scheduler.manager.num_free == free, "freed while rank 1 still writes from them"
        reported(scheduler, [write])  # rank 1's write ended
    assert scheduler.manager.num_free == free + 3
    assert not scheduler.planner._quarantined and scheduler.stats.data["failed_stores"] == 1
    scheduler.close()
