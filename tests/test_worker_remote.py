"""The worker side's reads and writes of the remote tier, against a real Redis server.

Two workers that share nothing but the store: what one stores, the other
loads into its device cache, byte for byte. A load whose read hangs is
reported failed to vLLM at its deadline, while its host slots stay reserved
until the read ends.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from kvhal.testing.redis_servers import RedisServer
from kvhal.tiers.chain import TierRead
from kvhal.vllm import versions
from kvhal.vllm.config import LowerTierConfig, RemoteTierConfig
from kvhal.vllm.metadata import LoadJob, WriteJob
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
    job.writes = [WriteJob(1, "redis", KEYS, [0, 1], [])]
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
    fetch.reads = [TierRead("redis", KEYS, [], [4, 6])]
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
    fetch.reads = [TierRead("redis", KEYS, [], [4, 6])]
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


# -- one load reading two tiers: a disk tier and the store ---------------------------


def two_tiers(tmp_path, url: str) -> tuple[WorkerSide, dict]:
    """A worker over a disk tier then the store; device blocks 3 and 5 stored into host slots
    0 and 1, block 3 (KEYS[0]) written to disk slot 0 only, block 5 (KEYS[1]) to the store only.
    Both tiers wait 10 s: no deadline passes in these tests."""
    disk = LowerTierConfig(
        "disk", {"path": str(tmp_path / "disk"), "bytes_to_use": 1 << 20}, "through", "clock", wait_ms=10_000
    )
    config = dataclasses.replace(
        connector_config(slots=8),
        lower_tier=disk,
        remote_tier=RemoteTierConfig(url, auth="none", load_timeout_ms=10_000),
        fingerprint={"model": "worker-two-tiers"},
    )
    assert [tier.name for tier in config.tiers] == ["disk", "redis"]
    caches = kv_caches(split=False, seed=3)
    side = WorkerSide(config)
    side.register(caches)
    job = store(0, "r", [3, 5], [0, 1])
    job.writes = [WriteJob(1, "disk", KEYS[:1], [0], [0]), WriteJob(2, "redis", KEYS[1:], [1], [])]
    step(side, stores=[job])
    settle(side)
    assert side.worker_meta().succeeded == {0: 1, 1: 1, 2: 1}
    return side, caches


def load_from_both(job_id: int) -> LoadJob:
    """Device blocks 7 and 9 from host slots 4 and 6, read first: KEYS[0] from disk slot 0
    into host slot 4, KEYS[1] from the store into host slot 6."""
    reads = [TierRead("disk", KEYS[:1], [0], [4]), TierRead("redis", KEYS[1:], [], [6])]
    return LoadJob(job_id, "s", {0: ([7, 9], [4, 6])}, reads=reads)


def test_a_load_reading_a_disk_tier_and_the_store_copies_what_each_held(tmp_path, server):
    side, caches = two_tiers(tmp_path, server.url)
    before = [block(caches, i) for i in (7, 9)]
    step(side, loads=[load_from_both(3)])
    finished, failed, _ = settle(side)
    assert finished == {"s"} and not failed
    assert side.worker_meta().succeeded == {3: 1}
    assert all(same(block(caches, 7), block(caches, 3))), "block 7 is not what the disk held"
    assert all(same(block(caches, 9), block(caches, 5))), "block 9 is not what the store held"
    assert not any(same(before[0], block(caches, 3))) and not any(same(before[1], block(caches, 5))), (
        "negative control: the blocks differed before"
    )
    for tier in ("disk", "redis"):
        assert side.stats.data[f"tier_read_bytes{{tier={tier}}}"] == side.config.slot_bytes
    side.shutdown()


def stall_disk(side: WorkerSide) -> threading.Event:
    """Every read of a disk data file hangs until the returned event is set (30 s at most)."""
    backend, release = side.tiers["disk"].backend, threading.Event()
    read = backend._preadv

    def stalling(fd, buffers, offset):
        if fd != backend._index_fd:
            release.wait(timeout=30)
        read(fd, buffers, offset)

    backend._preadv = stalling
    return release


@pytest.mark.parametrize("failing", ["redis", "disk"])
def test_one_tiers_failed_read_fails_the_load_and_the_other_read_is_still_waited_for(
    tmp_path, server, failing
):
    """One tier's read fails (a corrupt value) while the other's is still running: the load
    is reported failed to vLLM (its request recomputed) and copies nothing, but the job ends
    -- its host slots released -- only once the other read ended, whose bytes do land in
    their host slot afterwards (released earlier, that slot could have been reused)."""
    side, caches = two_tiers(tmp_path, server.url)
    before = [block(caches, i) for i in (7, 9)]
    if failing == "redis":
        client = server.client()
        (name,) = client.keys("kvhal/*")
        value = bytearray(client.get(name))
        value[-1] ^= 1
        client.set(name, bytes(value))
        release = stall_disk(side)
        late_slot, late_source = 4, 3
    else:
        (data,) = list((tmp_path / "disk").rglob("data-0.bin"))
        raw = bytearray(data.read_bytes())
        raw[100] ^= 1  # a byte of disk slot 0's block
        data.write_bytes(bytes(raw))
        server.client().execute_command("CLIENT", "PAUSE", 1000)  # the store hangs a second
        release = None
        late_slot, late_source = 6, 5
    finished, failed, _ = step(side, loads=[load_from_both(3)])
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # the other read is still running
        more, more_failed, _ = side.collect()
        finished, failed = finished | more, failed | more_failed
        assert side.jobs_in_flight == 1 and side.worker_meta() is None, (
            "the job ended while a read could still write its host slots"
        )
        time.sleep(0.02)
    if release is not None:
        release.set()
    more, more_failed, _ = settle(side)
    finished, failed = finished | more, failed | more_failed
    if versions.REQUEST_LEVEL_LOAD_FAILURES:
        assert finished == failed == {"s"}
    else:  # vLLM 0.27.1: the load's blocks, recomputed from the first
        assert finished == {"s"} and side.take_load_errors() == {7, 9}
    assert side.worker_meta().failed == {3: 1}
    assert side.stats.data[f"tier_corrupt_blocks{{tier={failing}}}"] == 1
    other = "disk" if failing == "redis" else "redis"
    assert side.stats.data[f"tier_read_bytes{{tier={other}}}"] == side.config.slot_bytes
    assert f"tier_load_timeouts{{tier={other}}}" not in side.stats.data
    unchanged = [all(same(block(caches, i), old)) for i, old in zip((7, 9), before, strict=True)]
    assert unchanged == [True, True], "a failed load still copied into the device cache"
    # the other read did land in its host slot, after vLLM was told
    step(side, loads=[load(4, "t", [11], [late_slot])])
    settle(side)
    assert all(same(block(caches, 11), block(caches, late_source)))
    side.shutdown()
