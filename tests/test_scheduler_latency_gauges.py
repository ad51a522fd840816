"""The scheduler side's histograms and gauges (issue 37) over a disk tier then a Redis store
(a real server): each job timed from its start to the step that reports it, by tier; the
occupancy and health gauges reported once, and again only when they change."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvhal.vllm.scheduler_side import SchedulerSide
from kvhal.vllm.stats import KVHALStats
from tests import test_scheduler_tier_list as tier_list
from tests.test_scheduler_remote import hit, redis_tier
from tests.test_scheduler_side import BS, output, reported, request
from tests.test_scheduler_tier_list import split_hit, stored

server, scheduler = tier_list.server, tier_list.scheduler  # its fixtures: a disk tier, then Redis


def gauges(scheduler: SchedulerSide) -> dict[str, int]:
    """The gauges the next report carries (those changed since the last)."""
    scheduler._gauges()
    taken = scheduler.stats.take() or KVHALStats()
    return {k: v for k, v in taken.data.items() if "bytes" in k or "slots" in k or "tier_up" in k}


def test_each_job_is_timed_by_tier(scheduler, server):
    a, prefetch = split_hit(scheduler, server)
    data = scheduler.stats.data
    # one wait per store lookup (three stored prompts' and "a"'s), each its answer's round trip
    assert len(data["lookup_wait_seconds{tier=redis}"]) == data["tier_lookups{tier=redis}"] == 4
    assert len(data["tier_write_seconds{tier=host}"]) == 3  # the three prompts' stores
    assert len(data["tier_write_seconds{tier=disk}"]) == 3  # and their write-throughs
    assert "tier_read_seconds{tier=disk}" not in data, "not timed before it ends"
    reported(scheduler, [prefetch.job_id])
    assert scheduler.lookup(a, 0) == (2 * BS, False)
    for name in ("disk", "redis"):
        [seconds] = data[f"tier_read_seconds{{tier={name}}}"]
        assert 0 <= seconds < 5
        [waited] = data[f"lookup_wait_seconds{{tier={name}}}"][-1:]  # the request's wait for it
        assert waited >= seconds
    scheduler.after_alloc(a, KVCacheBlocks(([KVCacheBlock(7), KVCacheBlock(8)],)), 2 * BS)
    [load] = scheduler.build_meta(output()).loads
    assert "device_load_seconds{tier=host}" not in data
    reported(scheduler, [load.job_id])
    assert len(data["device_load_seconds{tier=host}"]) == 1, "a host hit's load"


def test_gauges_say_occupancy_and_health_once_and_on_change(scheduler, server):
    slot = scheduler.config.slot_bytes
    z = request("z", list(range(300, 312)))
    assert hit(scheduler, z)[0] == 0
    first = gauges(scheduler)
    assert first["tier_up{tier=redis}"] == 1
    assert first["tier_used_bytes{tier=disk}"] == 0
    assert first["tier_budget_bytes{tier=disk}"] == scheduler.chain.tier("disk").index.num_slots * slot > 0
    assert first["host_slots"] == 4 and first["host_used_slots"] == 0
    assert gauges(scheduler) == {}, "unchanged: not sent again"
    stored(scheduler, "q", list(range(500, 512)), [20, 21, 22])  # stores and writes reported
    now = gauges(scheduler)
    assert now["host_used_slots"] == 3 and now["tier_used_bytes{tier=disk}"] == 3 * slot
    assert "tier_up{tier=redis}" not in now
    # a prefetch in flight: its bytes, by tier, until it is reported
    _, prefetch = split_hit(scheduler, server)
    flying = gauges(scheduler)
    assert flying["tier_inflight_bytes{tier=disk}"] == slot
    assert flying["tier_inflight_bytes{tier=redis}"] == slot
    reported(scheduler, [prefetch.job_id])
    landed = gauges(scheduler)
    assert landed["tier_inflight_bytes{tier=disk}"] == 0 == landed["tier_inflight_bytes{tier=redis}"]
    server.stop()
    c = request("c", list(range(700, 712)))
    assert hit(scheduler, c)[0] == 0 and not redis_tier(scheduler).up
    assert gauges(scheduler)["tier_up{tier=redis}"] == 0
