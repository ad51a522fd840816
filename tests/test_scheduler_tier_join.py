"""A rolling update below the engine (issue 37): a second engine on the disk path a first one
still holds starts at once and serves without the disk tier, which joins it once the first
engine lets the path go. Both engines are kvhal's real scheduler and worker sides, on the CPU
plugin and one real disk directory, driven as vLLM drives them (test_local_read.py's way); the
lock is the disk tier's real ``flock``, which two opens in one process contend for as two
processes do.

While it waits, the second engine's disk tier is out: a block the first engine left on disk is
a miss (the negative control), its stores write nothing there (the disk's files stay as they
were), host hits are served, ``tier_up{tier=disk}`` is 0. Once the first engine closes, the
tier joins at the next lookup with the first engine's blocks, and a hit copies the very bytes
the first engine stored into the second's KV cache.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvhal.vllm.config import LowerTierConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.scheduler_side import SchedulerSide
from kvhal.vllm.stats import KVHALStats
from kvhal.vllm.tier_list import SchedulerTier
from kvhal.vllm.worker_side import WorkerSide
from tests.test_local_read import run
from tests.test_scheduler_side import PROMPT, output, prefill, request
from tests.test_worker_side import block, connector_config, kv_caches, same

OTHER = list(range(100, 112))  # a second prompt of three blocks
UP = "tier_up{tier=disk}"


@dataclasses.dataclass
class Engine:
    scheduler: SchedulerSide
    worker: WorkerSide
    caches: dict

    @property
    def disk(self) -> SchedulerTier:
        [tier] = self.scheduler.tiers
        return tier

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.close()  # the disk's lock goes with it


def engine(path: Path, seed: int, lock_wait_s: int = 60) -> Engine:
    """An engine with 8 host slots over a disk tier at ``path``, its KV cache noise of ``seed``."""
    lower = LowerTierConfig(
        "disk",
        {"path": str(path), "bytes_to_use": 1 << 20, "lock_wait_s": lock_wait_s},
        "through",
        "clock",
        wait_policy="timeout",
    )
    config = dataclasses.replace(connector_config(slots=8), lower_tier=lower, fingerprint={"model": "join"})
    worker = WorkerSide(config)
    caches = kv_caches(split=False, seed=seed)
    worker.register(caches)
    return Engine(SchedulerSide(config, local=worker), worker, caches)


def stored(e: Engine, name: str, tokens: list[int], blocks: list[int]) -> list:
    """``tokens`` computed in device ``blocks`` and stored (and written below where it may);
    the store jobs' write-throughs."""
    req = request(name, tokens)
    meta = prefill(e.scheduler, req, blocks)
    run(e.scheduler, e.worker, meta)
    e.scheduler.request_finished(req)
    return [write for job in meta.stores for write in job.writes]


def hit_loaded(e: Engine, name: str, tokens: list[int], into: list[int]) -> int:
    """A new request's hit on ``tokens`` (its lookup reads a disk hit in the call) loaded into
    device blocks ``into``; the tokens hit."""
    req = request(name, tokens)
    e.scheduler.track(req)
    tokens_hit, asynchronous = e.scheduler.lookup(req, 0)
    assert not asynchronous
    if tokens_hit:
        ids = [KVCacheBlock(i) for i in into[: tokens_hit // 4]]
        e.scheduler.after_alloc(req, KVCacheBlocks((ids,)), tokens_hit)
        meta = e.scheduler.build_meta(output())
        assert meta.prefetches == [] and all(not load.reads for load in meta.loads)
        run(e.scheduler, e.worker, meta)
        assert e.worker.take_load_errors() == set()
    e.scheduler.request_finished(req)
    return tokens_hit


def gauges(e: Engine) -> dict:
    e.scheduler._gauges()
    return (e.scheduler.stats.take() or KVHALStats()).data


def disk_files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def ready_within(e: Engine, seconds: float) -> bool:
    """Whether the disk's backend turned ready (or gave up: False) within ``seconds``."""
    backend = e.disk.backend
    assert backend is not None
    deadline = time.monotonic() + seconds
    while not backend.ready and backend.ready_error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return backend.ready


def test_a_second_engine_serves_without_the_disk_then_joins_with_the_first_s_blocks(tmp_path):
    path = tmp_path / "disk"
    first = engine(path, seed=3)
    assert [w.tier for w in stored(first, "a", PROMPT, [1, 2, 3])] == ["disk"]
    assert [w.tier for w in stored(first, "d", OTHER, [4, 5, 6])] == ["disk"]
    assert len(first.disk.chain.index) == 6
    on_disk = disk_files(path)

    started = time.monotonic()
    second = engine(path, seed=4)  # the first still holds the path
    try:
        assert time.monotonic() - started < 5, "the second engine's start waited for the lock"
        assert not second.disk.chain.ready and second.disk.waiting
        assert gauges(second)[UP] == 0
        # negative control: the first engine's blocks are on disk, and a miss here
        assert hit_loaded(second, "d?", OTHER, [9, 10]) == 0
        # its stores go to host memory only: no write below, the disk's files as they were
        assert stored(second, "b", PROMPT, [1, 2, 3]) == []
        assert hit_loaded(second, "b again", PROMPT, [7, 8]) == 8, "a host hit"
        assert all(same(block(second.caches, 7), block(second.caches, 1)))
        data = second.scheduler.stats.data
        assert "tier_written_blocks{tier=disk}" not in data and "tier_recovered_blocks{tier=disk}" not in data
        assert len(second.disk.chain.index) == 0
        assert disk_files(path) == on_disk, "the waiting engine wrote to the disk"
        assert second.disk.chain.ready is False

        first.close()  # the first engine drained and exits
        assert ready_within(second, 10), second.disk.backend.ready_error
        before = [block(second.caches, i) for i in (9, 10)]
        assert not any(same(before[0], block(first.caches, 4))), "the caches differed before"
        # the next lookup joins the tier with the first engine's six blocks, and reads its hit
        assert hit_loaded(second, "d", OTHER, [9, 10]) == 8
        assert second.disk.chain.ready and not second.disk.waiting
        data = second.scheduler.stats.data
        assert data["tier_recovered_blocks{tier=disk}"] == 6
        assert data["tier_hit_tokens{tier=disk}"] == 8
        for i, source in ((9, 4), (10, 5)):  # the first engine's bytes, read from its disk
            assert all(same(block(second.caches, i), block(first.caches, source)))
        assert gauges(second)[UP] == 1
        # from now on its stores are written below too
        assert [w.tier for w in stored(second, "e", list(range(200, 212)), [11, 12, 13])] == ["disk"]
    finally:
        first.close()
        second.close()


def test_a_tier_whose_lock_never_comes_stays_out_and_the_engine_serves(tmp_path):
    path = tmp_path / "disk"
    first = engine(path, seed=3)
    stored(first, "d", OTHER, [4, 5, 6])
    second = engine(path, seed=4, lock_wait_s=1)
    try:
        assert not ready_within(second, 10)
        assert second.disk.backend.ready_error is not None and "lock_wait_s" in str(
            second.disk.backend.ready_error
        )
        assert hit_loaded(second, "d?", OTHER, [9, 10]) == 0  # the lookup sees it gave up
        assert second.disk.gave_up and not second.disk.waiting and second.scheduler._waiting == []
        assert gauges(second)[UP] == 0
        first.close()  # too late: the second engine gave up waiting, and does not take the path
        time.sleep(0.2)
        assert stored(second, "b", PROMPT, [1, 2, 3]) == []
        assert hit_loaded(second, "b again", PROMPT, [7, 8]) == 8, "it still serves host hits"
        assert hit_loaded(second, "d!", OTHER, [9, 10]) == 0, "and never the disk's"
        assert not second.disk.chain.ready and gauges(second).get(UP, 0) == 0
    finally:
        first.close()
        second.close()


def test_an_engine_alone_on_its_path_starts_with_the_tier_ready(tmp_path):
    """The control: no other engine, the tier is in the chain from the start (tier_up 1)."""
    e = engine(tmp_path / "disk", seed=3)
    try:
        assert e.disk.chain.ready and not e.disk.waiting and e.scheduler._waiting == []
        assert gauges(e)[UP] == 1
        assert [w.tier for w in stored(e, "a", PROMPT, [1, 2, 3])] == ["disk"]
        keys = [offload_key(h, 0) for h in request("a").block_hashes[:2]]
        assert e.disk.chain.index.lookup(keys) == 2
    finally:
        e.close()
