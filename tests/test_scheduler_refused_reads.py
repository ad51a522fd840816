"""A store's blocks whose read failed (a refused value: planted, torn, another secret's) are
written again once recomputed, so the engine's value can replace the refused one; before
issue 38 they were left out of the write as blocks the store held, and the name stayed taken."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from kvhal.testing.redis_servers import RedisServer
from kvhal.vllm.keys import offload_key
from tests.test_scheduler_remote import answered, put_blocks, side
from tests.test_scheduler_side import output, prefill, reported, request


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as running:
        yield running


def test_the_blocks_of_a_failed_read_are_written_to_the_store_after_their_recompute(server):
    scheduler = side(server.url)
    req = request("a")
    put_blocks(scheduler, server.url, list(req.block_hashes[:2]))
    assert answered(scheduler, req) == (None, False)
    [prefetch] = scheduler.build_meta(output()).prefetches
    reported(scheduler, [prefetch.job_id], ok=False)  # a worker refused the values
    [store] = prefill(scheduler, req, [1, 2, 3]).stores
    [write] = store.writes
    assert write.tier == "redis"
    assert write.keys == [offload_key(h, 0) for h in req.block_hashes[:3]], "the refused blocks too"
    scheduler.close()
