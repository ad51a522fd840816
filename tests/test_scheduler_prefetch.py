"""Hits below the host tier are prefetched at lookup: the request is asked again (``None``,
holding no device blocks) while its blocks are read from the disk tier into host slots, and
then loads them as a host hit in the step that schedules it. Past ``lower_tier_wait_ms`` the
part in host memory is the hit; past the budget, or with the prefetch off, the hit loads
asynchronously (read, then copy) as before. The scheduler side runs over a real disk tier
(its index; the workers' reads are reported as vLLM's aggregator would)."""

from __future__ import annotations

import logging
import time

import pytest

pytest.importorskip("vllm")
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvhal.offload.wait_policy import PROBE_S, WaitPolicy
from kvhal.vllm.config import LowerTierConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.metadata import KVHALMetadata, ReadJob
from kvhal.vllm.scheduler_side import SchedulerSide
from tests.test_scheduler_side import PAGE, output, prefill, reported, request, scheduler_config

SLOTS = 4


def tiered(
    tmp_path, wait_ms: int | None = 60_000, budget: int | None = SLOTS, policy: str = "timeout"
) -> SchedulerSide:
    """A scheduler side over a disk tier; by default every prefetch is waited for (the
    ``timeout`` policy: these tests are about the prefetch itself; ``auto``'s are below)."""
    lower = LowerTierConfig(
        "disk",
        {"path": str(tmp_path / "disk"), "bytes_to_use": 64 * PAGE},
        "through",
        "clock",
        wait_ms=wait_ms,
        prefetch_blocks=budget,
        wait_policy=policy,
    )
    return SchedulerSide(scheduler_config(slots=SLOTS, lower_tier=lower))


def disk_wait(scheduler: SchedulerSide) -> WaitPolicy:
    """The disk tier's wait policy."""
    [tier] = scheduler.tiers
    assert tier.name == "disk" and tier.wait is not None
    return tier.wait


def finish_stores(scheduler: SchedulerSide, meta: KVHALMetadata) -> None:
    """The workers stored every block of ``meta`` and wrote it through to the disk."""
    reported(scheduler, [job.job_id for job in meta.stores])
    reported(scheduler, [write.job_id for job in meta.stores for write in job.writes])


def only_on_disk(scheduler: SchedulerSide) -> None:
    """Request "a"'s prompt blocks are on the disk tier and evicted from the host tier."""
    a = request("a")
    finish_stores(scheduler, prefill(scheduler, a, [1, 2, 3]))
    scheduler.request_finished(a)
    for i, first in enumerate((100, 200)):  # two more prompts fill the four host slots
        other = request(f"x{i}", list(range(first, first + 12)))
        finish_stores(scheduler, prefill(scheduler, other, [10 + 3 * i, 11 + 3 * i, 12 + 3 * i]))
        scheduler.request_finished(other)
    keys = [offload_key(h, 0) for h in a.block_hashes[:2]]
    assert scheduler.manager.lookup(keys) == 0
    assert scheduler.chain.tier("disk").index.lookup(keys) == 2


def waiting(scheduler: SchedulerSide):
    """Request "b" (the prompt "a" stored) asked for: its prefetch is sent, it waits (``None``)."""
    b = request("b")
    scheduler.track(b)
    assert scheduler.lookup(b, 0) == (None, False)  # reading: ask again
    [prefetch] = scheduler.build_meta(output()).prefetches
    return b, prefetch


def test_a_disk_hit_is_read_into_host_memory_while_the_request_waits_then_loads_in_its_step(tmp_path):
    scheduler = tiered(tmp_path)
    only_on_disk(scheduler)
    b, prefetch = waiting(scheduler)
    # a read into host slots, no device copy (a ReadJob has no groups), from the disk
    assert isinstance(prefetch, ReadJob) and [(r.tier, len(r.keys)) for r in prefetch.reads] == [("disk", 2)]
    assert scheduler.lookup(b, 0) == (None, False)  # still reading
    assert scheduler.build_meta(output()).prefetches == []  # one read per request
    reported(scheduler, [prefetch.job_id])
    assert scheduler.lookup(b, 0) == (8, False)  # in host memory: a synchronous host hit
    scheduler.after_alloc(b, KVCacheBlocks(([KVCacheBlock(7), KVCacheBlock(8)],)), 8)
    [load] = scheduler.build_meta(output()).loads
    assert load.sync and load.reads == []
    assert scheduler.stats.data["tier_prefetched_blocks{tier=disk}"] == 2
    assert scheduler.stats.data["tier_hit_tokens{tier=disk}"] == 8  # the disk's share of the hit
    assert scheduler.stats.data["tier_loaded_blocks{tier=disk}"] == 2


def test_past_the_wait_the_host_part_is_the_hit_and_the_read_still_lands(tmp_path):
    scheduler = tiered(tmp_path, wait_ms=0)
    only_on_disk(scheduler)
    b, prefetch = waiting(scheduler)
    assert scheduler.lookup(b, 0) == (0, False)  # nothing in host yet: recompute
    assert scheduler.stats.data["tier_prefetch_timeouts{tier=disk}"] == 1
    reported(scheduler, [prefetch.job_id])  # the read ends later, for the next request
    c = request("c")
    scheduler.track(c)
    assert scheduler.lookup(c, 0) == (8, False)


def test_a_failed_read_leaves_nothing_to_load(tmp_path):
    scheduler = tiered(tmp_path)
    only_on_disk(scheduler)
    b, prefetch = waiting(scheduler)
    reported(scheduler, [prefetch.job_id], ok=False)
    assert scheduler.lookup(b, 0) == (0, False)  # forgotten in both tiers (it may be corrupt)
    assert scheduler.stats.data["tier_failed_loads{tier=disk}"] == 1
    assert scheduler.prefetcher.reading == 0 and not scheduler.has_jobs_in_flight()


PREFETCH_LOGGER = "vllm.kvhal.vllm.prefetch"  # under vLLM's logger, as vLLM's own


@pytest.mark.parametrize("slow", [True, False])
def test_a_tier_measured_slower_than_recompute_is_not_read(tmp_path, slow):
    scheduler = tiered(tmp_path, policy="auto")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(PREFETCH_LOGGER)
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    only_on_disk(scheduler)
    policy = disk_wait(scheduler)
    policy.observe_step(1000, 0.1)  # 8 tokens: recomputed in 0.8 ms
    policy.observe_step(2000, 0.2)
    policy.observe_read(PAGE, 1.0 if slow else 1e-9)
    b = request("b")
    scheduler.track(b)
    if slow:
        assert scheduler.lookup(b, 0) == (0, False)  # recompute at once: no wait, no read
        assert scheduler.build_meta(output()).prefetches == []
        assert scheduler.stats.data["tier_slow_blocks{tier=disk}"] == 2
        # the operator is told once why the tier's hits are recomputed
        assert [m for m in seen if "reads slower than recomputing" in m and "every 20 s" in m], seen
    else:  # the negative control: a fast tier is read as before
        assert scheduler.lookup(b, 0) == (None, False)
        assert len(scheduler.build_meta(output()).prefetches) == 1
        assert not [m for m in seen if "slower" in m], seen
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_slow_tier_is_probed_now_and_then_while_its_request_recomputes(tmp_path, monkeypatch):
    """PROBE_S after a slow tier's last read, one read checks whether it recovered: it is
    made, no request waits for it (its request recomputes), and once it lands its blocks
    serve the next request."""
    scheduler = tiered(tmp_path, policy="auto")
    only_on_disk(scheduler)
    policy = disk_wait(scheduler)
    policy.observe_step(1000, 0.1)
    policy.observe_step(2000, 0.2)
    policy.observe_read(PAGE, 1.0)  # slow
    monkeypatch.setattr(policy, "clock", lambda: time.monotonic() + PROBE_S)
    b, c = request("b"), request("c")
    scheduler.track(b)
    assert scheduler.lookup(b, 0) == (0, False)  # recompute now
    assert scheduler.lookup(b, 0) == (0, False)  # asked again: still no wait, no second read
    [probe] = scheduler.build_meta(output()).prefetches
    assert scheduler.stats.data["tier_probes{tier=disk}"] == 1
    scheduler.track(c)
    assert scheduler.lookup(c, 0) == (0, False)  # slow, and the probe has not landed
    assert scheduler.build_meta(output()).prefetches == []
    reported(scheduler, [probe.job_id])
    d = request("d")
    scheduler.track(d)
    assert scheduler.lookup(d, 0) == (8, False)  # a host hit now


@pytest.mark.parametrize("how", ["over budget", "prefetch off"])
def test_without_a_prefetch_the_hit_loads_asynchronously(tmp_path, how):
    scheduler = tiered(tmp_path, budget=1) if how == "over budget" else tiered(tmp_path, wait_ms=None)
    only_on_disk(scheduler)
    b = request("b")
    scheduler.track(b)
    assert scheduler.lookup(b, 0) == (8, True)  # read, then copy: vLLM parks the request
    scheduler.after_alloc(b, KVCacheBlocks(([KVCacheBlock(7), KVCacheBlock(8)],)), 8)
    [load] = scheduler.build_meta(output()).loads
    assert not load.sync and [(r.tier, len(r.keys)) for r in load.reads] == [("disk", 2)]
    assert ("tier_prefetch_skipped_blocks{tier=disk}" in scheduler.stats.data) is (how == "over budget")


def test_an_aborted_request_leaves_its_read_to_finish(tmp_path):
    """The read cannot be stopped mid-flight; it ends, is reported, and its blocks serve others."""
    scheduler = tiered(tmp_path)
    only_on_disk(scheduler)
    b, prefetch = waiting(scheduler)
    assert scheduler.request_finished(b)[0] is False  # nothing to hold: it has no blocks
    reported(scheduler, [prefetch.job_id])
    assert not scheduler.has_jobs_in_flight() and scheduler.prefetcher.reading == 0
    c = request("c")
    scheduler.track(c)
    assert scheduler.lookup(c, 0) == (8, False)


@pytest.mark.parametrize("slow", [True, False])
def test_a_tier_measured_slower_than_recompute_is_not_written_either(tmp_path, slow):
    """Blocks a tier is too slow to serve are not written to it (the negative control: a
    tier that is not slow gets its write-through)."""
    scheduler = tiered(tmp_path, policy="auto")
    disk_wait(scheduler).slow = slow
    meta = prefill(scheduler, request("a"), [1, 2, 3])
    assert [job.writes == [] for job in meta.stores] == [slow]
    skipped = scheduler.stats.data.get("tier_slow_skipped_writes{tier=disk}", 0)
    assert skipped == (3 if slow else 0)  # its 3 blocks
