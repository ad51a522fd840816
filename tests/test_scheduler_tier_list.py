"""The scheduler side over a list of tiers below the host tier: a disk tier, then a Redis
store (a real server), in that order (issue 35).

A request's hit that lies partly on disk and partly in the store is read by one prefetch
(one :class:`~kvhal.vllm.metadata.ReadJob`, one read per tier), each block from the first
tier holding it, and then loaded as a host hit. A request's blocks are read from the store
once, at its prefetch: a store-only hit after it is recomputed, the store not asked again,
while the disk's part still loads. A store that is down is not written (its blocks are
dropped, counted under its name) while the disk tier still is.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvhal.testing.redis_servers import RedisServer
from kvhal.vllm.config import LowerTierConfig, RemoteTierConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.metadata import ReadJob
from kvhal.vllm.scheduler_side import SchedulerSide
from tests.test_scheduler_prefetch import finish_stores
from tests.test_scheduler_remote import answered, hit, put_blocks, redis_tier
from tests.test_scheduler_side import BS, PAGE, PROMPT, output, prefill, reported, request, scheduler_config

SLOTS = 4  # host slots: two prompts of three blocks evict a third's
LOOKUPS = "tier_lookups{tier=redis}"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as running:
        yield running


@pytest.fixture
def scheduler(tmp_path, server) -> Iterator[SchedulerSide]:
    """A scheduler side over a disk tier, then the Redis store; every prefetch is waited for
    (the ``timeout`` policy: these tests are about which tier serves what)."""
    disk = LowerTierConfig(
        "disk",
        {"path": str(tmp_path / "disk"), "bytes_to_use": 64 * PAGE},
        "through",
        "clock",
        wait_ms=60_000,
        prefetch_blocks=SLOTS,
        wait_policy="timeout",
    )
    store = RemoteTierConfig(server.url, auth="none", wait_policy="timeout")
    config = scheduler_config(
        slots=SLOTS, lower_tier=disk, remote_tier=store, fingerprint={"model": "scheduler-tier-list-test"}
    )
    side = SchedulerSide(config)
    assert [tier.name for tier in side.tiers] == ["disk", "redis"]
    yield side
    side.close()


def stored(scheduler: SchedulerSide, req_id: str, tokens: list[int], blocks: list[int]) -> None:
    """``req_id``'s prompt stored to the host tier and written through to the disk (the store
    asked first, as a lookup does; its write is reported but writes nothing to the server)."""
    req = request(req_id, tokens)
    assert hit(scheduler, req)[0] == 0
    finish_stores(scheduler, prefill(scheduler, req, blocks))
    scheduler.request_finished(req)


def host_filled(scheduler: SchedulerSide, first: int) -> None:
    """Two other prompts (tokens from ``first``) take every host slot: older blocks leave it."""
    for i in range(2):
        start = first + 100 * i
        stored(scheduler, f"x{start}", list(range(start, start + 12)), [10 + 3 * i, 11 + 3 * i, 12 + 3 * i])


def keys_of(req, blocks: int = 2) -> list[bytes]:
    return [offload_key(h, 0) for h in req.block_hashes[:blocks]]


def split_hit(scheduler: SchedulerSide, server: RedisServer):
    """Request "a"'s first block on disk only (evicted from the host tier), both its hit's
    blocks in the store: ``(a, its prefetch)`` once the lookup sent it."""
    stored(scheduler, "p", PROMPT[:4] + list(range(900, 908)), [1, 2, 3])  # "a"'s first block
    host_filled(scheduler, 1000)
    a = request("a")
    k0, k1 = keys_of(a)
    assert scheduler.manager.lookup([k0]) == 0 and scheduler.chain.tier("disk").index.lookup([k0, k1]) == 1
    put_blocks(scheduler, server.url, list(a.block_hashes[:2]))
    lookups = scheduler.stats.data[LOOKUPS]
    assert answered(scheduler, a) == (None, False), "the blocks below are read first: ask again"
    assert scheduler.stats.data[LOOKUPS] == lookups + 1
    [prefetch] = scheduler.build_meta(output()).prefetches
    return a, prefetch


def test_a_hit_partly_on_disk_partly_in_the_store_is_one_prefetch_then_a_host_hit(scheduler, server):
    a, prefetch = split_hit(scheduler, server)
    k0, k1 = keys_of(a)
    # the store was asked only past the local hit (the disk's block), though it holds k0 too
    probe = scheduler.track(a).probes["redis"]
    assert probe.first == 1 and probe.hashes == [a.block_hashes[1]]
    # one job reads both tiers, each its own block
    assert isinstance(prefetch, ReadJob) and prefetch.req_id == "a"
    assert [(read.tier, read.keys) for read in prefetch.reads] == [("disk", [k0]), ("redis", [k1])]
    disk, store = prefetch.reads
    assert len(disk.slots) == 1 and store.slots == []
    assert len(set(disk.host_slots + store.host_slots)) == 2
    assert scheduler.lookup(a, 0) == (None, False), "waits while the read is in flight"
    assert scheduler.build_meta(output()).prefetches == [], "one prefetch per request"
    reported(scheduler, [prefetch.job_id])  # the worker read both tiers into host memory
    assert scheduler.lookup(a, 0) == (2 * BS, False), "then a host hit, loaded in its step"
    scheduler.after_alloc(a, KVCacheBlocks(([KVCacheBlock(7), KVCacheBlock(8)],)), 2 * BS)
    [load] = scheduler.build_meta(output()).loads
    assert load.sync and load.reads == []
    data = scheduler.stats.data
    for name in ("disk", "redis"):  # each tier's share: one block
        assert data[f"tier_prefetched_blocks{{tier={name}}}"] == 1
        assert data[f"tier_loaded_blocks{{tier={name}}}"] == 1
        assert data[f"tier_hit_tokens{{tier={name}}}"] == BS
    assert scheduler.prefetcher.reading == 0


@pytest.mark.parametrize("where", ["store only", "disk and store"])
def test_a_store_hit_after_the_requests_prefetch_is_recomputed_not_asked_again(scheduler, server, where):
    """The prefetch's blocks left the host tier before the request was scheduled: what the
    store held is recomputed (its blocks are read once per request), the store is not asked
    again; the disk's part still loads, asynchronously (read, then copy)."""
    if where == "disk and store":
        a, prefetch = split_hit(scheduler, server)
        assert len(prefetch.reads) == 2
    else:
        a = request("a")
        put_blocks(scheduler, server.url, list(a.block_hashes[:2]))
        assert answered(scheduler, a) == (None, False)
        [prefetch] = scheduler.build_meta(output()).prefetches
        assert [read.tier for read in prefetch.reads] == ["redis"]
    reported(scheduler, [prefetch.job_id])
    host_filled(scheduler, 2000)  # the read blocks are evicted again
    assert scheduler.manager.lookup(keys_of(a)) == 0
    lookups = scheduler.stats.data[LOOKUPS]
    if where == "store only":
        assert scheduler.lookup(a, 0) == (0, False), "recomputed"
        assert scheduler.build_meta(output()).prefetches == []
    else:
        assert scheduler.lookup(a, 0) == (BS, True), "the disk's block only, loaded asynchronously"
        scheduler.after_alloc(a, KVCacheBlocks(([KVCacheBlock(7)],)), BS)
        meta = scheduler.build_meta(output())
        assert meta.prefetches == []
        [load] = meta.loads
        assert not load.sync and [(read.tier, read.keys) for read in load.reads] == [("disk", keys_of(a, 1))]
        reported(scheduler, [load.job_id])  # the block it promotes is a host block again
    assert scheduler.stats.data[LOOKUPS] == lookups, "the store was asked again"
    # the control: the store still holds the blocks, and a new request is served from it
    c = request("c")
    assert answered(scheduler, c) == (None, False)
    assert scheduler.stats.data[LOOKUPS] == lookups + 1
    [again] = scheduler.build_meta(output()).prefetches
    assert "redis" in [read.tier for read in again.reads]


def test_a_store_that_is_down_is_not_written_and_the_disk_still_is(scheduler, server):
    a = request("a")
    assert hit(scheduler, a)[0] == 0  # the store answered: it is up
    [store_a] = prefill(scheduler, a, [1, 2, 3]).stores
    assert [w.tier for w in store_a.writes] == ["disk", "redis"], "the control: both written while up"
    reported(scheduler, [store_a.job_id])
    reported(scheduler, [w.job_id for w in store_a.writes])
    server.stop()
    c = request("c", [t + 200 for t in PROMPT])
    assert hit(scheduler, c)[0] == 0
    assert scheduler.stats.data["tier_lookup_errors{tier=redis}"] == 1 and not redis_tier(scheduler).up
    [store_c] = prefill(scheduler, c, [4, 5, 6]).stores
    [write] = store_c.writes
    assert write.tier == "disk" and len(write.keys) == 3
    data = scheduler.stats.data
    assert data["tier_dropped_blocks{tier=redis}"] == 3 and "tier_dropped_blocks{tier=disk}" not in data
    reported(scheduler, [store_c.job_id])
    reported(scheduler, [write.job_id])
    data = scheduler.stats.data
    assert data["tier_written_blocks{tier=disk}"] == 6 and data["tier_written_blocks{tier=redis}"] == 3
    assert scheduler.chain.tier("disk").index.lookup(keys_of(c, 3)) == 3
