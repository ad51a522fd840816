"""The worker side's reads and writes of the remote tier, against a real Redis server.

Two workers that share nothing but the store: what one stores, the other
loads into its device cache, byte for byte. A load whose read hangs is
reported failed to vLLM at its deadline, while its host slots stay reserved
until the read ends.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from kvhal.testing.redis_servers import RedisServer
from kvhal.vllm.config import RemoteTierConfig
from kvhal.vllm.metadata import TierReads, TierWrite
from kvhal.vllm.worker_side import WorkerSide
from tests.test_worker_side import block, connector_config, kv_caches, load, same, settle, step, store

KEYS = [b"block-a" + bytes(29), b"block-b" + bytes(29)]


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as running:
        yield running


def worker(url: str, seed: int, **remote) -> tuple[WorkerSide, dict]:
    config = dataclasses.replace(
        connector_config(),
        remote_tier=RemoteTierConfig(url, **{"auth": "none", **remote}),
        fingerprint={"model": "worker-remote"},
    )
    caches = kv_caches(split=False, seed=seed)
    side = WorkerSide(config)
    side.register(caches)
    return side, caches


def stored_through(url: str) -> tuple[WorkerSide, dict]:
    """Worker A stores device blocks 3 and 5 into host slots 0 and 1, written through to the store."""
    a, caches = worker(url, seed=1)
    job = store(0, "r", [3, 5], [0, 1])
    job.remote_write = TierWrite(1, KEYS, [0, 1], [], snapshot=False, remote=True)
    step(a, stores=[job])
    settle(a)
    return a, caches


def test_what_one_worker_stores_another_loads_byte_for_byte(server):
    a, caches_a = stored_through(server.url)
    assert a.worker_meta().succeeded == {0: 1, 1: 1}
    assert a.stats.data["tier_written_bytes{tier=redis}"] == 2 * a.config.slot_bytes
    b, caches_b = worker(server.url, seed=2)
    before = [block(caches_b, i) for i in (7, 9)]
    fetch = load(2, "s", [7, 9], [4, 6])
    fetch.remote_reads = TierReads(KEYS, [], [4, 6])
    step(b, loads=[fetch])
    finished, failed, _ = settle(b)
    assert finished == {"s"} and not failed
    assert all(same(block(caches_b, 7), block(caches_a, 3))) and all(
        same(block(caches_b, 9), block(caches_a, 5))
    )
    assert not any(same(before[0], block(caches_a, 3))), "negative control: the blocks differed before"
    assert b.stats.data["tier_read_bytes{tier=redis}"] == 2 * b.config.slot_bytes
    a.shutdown()
    b.shutdown()


def test_a_read_that_hangs_fails_the_load_at_its_deadline_and_ends_later(server):
    a, _ = stored_through(server.url)
    a.shutdown()
    b, caches_b = worker(server.url, seed=2, load_timeout_ms=200)
    before = [block(caches_b, i) for i in (7, 9)]
    server.client().execute_command("CLIENT", "PAUSE", 1500)  # the store hangs
    fetch = load(2, "s", [7, 9], [4, 6])
    fetch.remote_reads = TierReads(KEYS, [], [4, 6])
    start = time.monotonic()
    finished, failed, _ = step(b, loads=[fetch])
    while not failed:
        assert time.monotonic() - start < 1.2, "the load was not given up at its deadline"
        finished, failed, _ = b.collect()
        time.sleep(0.01)
    assert finished == failed == {"s"}
    assert b.worker_meta() is None, "the job ended while its read could still write its host slots"
    assert b.jobs_in_flight == 1 and b.stats.data["tier_load_timeouts{tier=redis}"] == 1
    settle(b)  # the store answers once the pause ends; only then the job ends, failed
    assert b.worker_meta().failed == {2: 1}
    unchanged = [all(same(block(caches_b, i), old)) for i, old in zip((7, 9), before, strict=True)]
    assert unchanged == [True, True], "a load given up still copied into the device cache"
    b.shutdown()
