"""Which tier served a hit, for vLLM 0.32's ``vllm:prompt_tokens_cached_by_source`` (issue 37):
the scheduler side over a disk tier then a Redis store (a real server) splits each hit by the
kind of tier that served it, and vLLM's own ``PrefixCacheStats`` takes the split as it is
(a split that does not sum to the hit would be counted ``external_unspecified``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.metrics.stats import PrefixCacheStats

from kvhal.vllm.hit_sources import by_kind, split_hit, vllm_sources
from kvhal.vllm.versions import HIT_SOURCES
from tests import test_scheduler_tier_list as tier_list
from tests.test_scheduler_side import BS, output, reported, request

server, scheduler = tier_list.server, tier_list.scheduler  # its fixtures: a disk tier, then Redis

needs_sources = pytest.mark.skipif(HIT_SOURCES is None, reason="this vLLM has no hit sources (0.27.1)")


def recorded(sources: dict, hits: int) -> dict:
    """What vLLM's scheduler records of a hit and its split (its own stats object)."""
    stats = PrefixCacheStats()
    stats.record(num_tokens=hits, num_hits=hits, preempted=False, hits_by_source=sources)
    return {source.value: tokens for source, tokens in stats.hits_by_source.items()}


def test_each_block_counts_once_for_the_farthest_tier_it_was_read_from_the_rest_for_host():
    a0, a1, b0, b1, c0 = b"a0", b"a1", b"b0", b"b1", b"c0"
    block_of = {a0: 5, a1: 5, b0: 6, b1: 6, c0: 7}  # three blocks of two KV cache groups (c: one)
    # block 5's groups from the disk and the store: the store's; block 6 from the disk; 7 in host
    split = split_hit(3, BS, block_of, {"disk": {a0, b0, b1}, "redis": {a1}}, ["disk", "redis"])
    assert split == {"redis": BS, "disk": BS, "host": BS}
    assert by_kind(split, {"redis"}, 3 * BS) == {"shared": BS, "local": BS, "host": BS}
    assert by_kind({}, {"redis"}, 2 * BS) == {"host": 2 * BS}, "no split recorded: all host"
    assert by_kind({"disk": BS}, set(), 2 * BS) == {"host": 2 * BS}, "a split of another hit"
    assert by_kind({}, set(), 0) == {}


@needs_sources
def test_a_hit_from_the_disk_and_the_store_is_counted_by_vllm_under_disk_and_the_remote_source(
    scheduler, server
):
    a, prefetch = tier_list.split_hit(scheduler, server)  # "a"'s 1st block on disk, 2nd in Redis
    reported(scheduler, [prefetch.job_id])
    assert scheduler.lookup(a, 0) == (2 * BS, False)
    scheduler.after_alloc(a, KVCacheBlocks(([KVCacheBlock(7), KVCacheBlock(8)],)), 2 * BS)
    kinds = scheduler.hit_sources(a, 2 * BS)
    assert kinds == {"local": BS, "shared": BS}
    assert recorded(vllm_sources(kinds), 2 * BS) == {"disk": BS, "external_unspecified": BS}
    # the control: a prompt whose blocks are in host memory only is a host hit
    [load] = scheduler.build_meta(output()).loads
    reported(scheduler, [load.job_id])
    x = request("x", list(range(1100, 1112)))  # stored by split_hit's host_filled, still in host
    assert scheduler.lookup(x, 0) == (2 * BS, False)
    scheduler.after_alloc(x, KVCacheBlocks(([KVCacheBlock(9), KVCacheBlock(10)],)), 2 * BS)
    assert recorded(vllm_sources(scheduler.hit_sources(x, 2 * BS)), 2 * BS) == {"host": 2 * BS}


@needs_sources
def test_a_disk_hit_loaded_by_its_load_is_the_disk_source(scheduler, server):
    """No prefetch left (the request's was spent): the disk's block is read by the load."""
    a, prefetch = tier_list.split_hit(scheduler, server)
    reported(scheduler, [prefetch.job_id])
    tier_list.host_filled(scheduler, 2000)  # the read blocks leave the host tier again
    assert scheduler.lookup(a, 0) == (BS, True), "the disk's block, loaded asynchronously"
    scheduler.after_alloc(a, KVCacheBlocks(([KVCacheBlock(7)],)), BS)
    assert recorded(vllm_sources(scheduler.hit_sources(a, BS)), BS) == {"disk": BS}
