"""One worker, in the scheduler's process (vLLM's engine core without tensor parallelism): a
lookup whose hit continues on the disk tier reads it into host slots through the worker's
tier itself and answers with a host hit in the same call, no step lost; the request's load
then copies the very bytes the disk held. Both sides are kvhal's real ones, on the CPU
plugin and a real disk tier, driven as vLLM drives them."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.outputs import KVConnectorOutput

from kvhal.vllm import local
from kvhal.vllm.config import LowerTierConfig
from kvhal.vllm.metadata import KVHALMetadata
from kvhal.vllm.scheduler_side import SchedulerSide
from kvhal.vllm.worker_side import WorkerSide
from tests.test_scheduler_side import output, prefill, request
from tests.test_worker_side import block, connector_config, kv_caches, same, settle


def engine(tmp_path, engine_id: str | None = "engine-1") -> tuple[SchedulerSide, WorkerSide, dict]:
    base = connector_config(slots=4)
    # the timeout policy: these tests wait for their reads (the auto policy's probes: below)
    lower = LowerTierConfig(
        "disk",
        {"path": str(tmp_path / "disk"), "bytes_to_use": 1 << 20},
        "through",
        "clock",
        wait_policy="timeout",
    )
    config = dataclasses.replace(base, lower_tier=lower, fingerprint={"model": "local"}, engine_id=engine_id)
    worker = WorkerSide(config)
    caches = kv_caches(split=False, seed=3)
    worker.register(caches)
    return SchedulerSide(config), worker, caches


def run(scheduler: SchedulerSide, worker: WorkerSide, meta: KVHALMetadata) -> None:
    """One step's copies on the worker, everything reported back to the scheduler side."""
    worker.begin_step(meta)
    worker.start_loads(meta)
    worker.start_stores(meta)
    settle(worker)
    scheduler.on_output(KVConnectorOutput(kv_connector_worker_meta=worker.worker_meta()))


def only_on_disk(scheduler: SchedulerSide, worker: WorkerSide) -> None:
    """Request "a"'s prompt in device blocks 1-3, stored and written through to the disk, then
    evicted from the four host slots by two other prompts."""
    for name, tokens, blocks in (
        ("a", None, [1, 2, 3]),
        ("x0", range(100, 112), [4, 5, 6]),
        ("x1", range(200, 212), [9, 10, 11]),
    ):
        req = request(name, list(tokens)) if tokens else request(name)
        run(scheduler, worker, prefill(scheduler, req, blocks))
        scheduler.request_finished(req)
    keys = scheduler._keys(request("a").block_hashes[:2], 0)
    assert scheduler.manager.lookup(keys) == 0 and scheduler.chain.lower.lookup(keys) == 2


def loaded_in_its_step(scheduler: SchedulerSide, worker: WorkerSide, caches: dict, req, source: dict) -> None:
    """``req``'s 8-token host hit loaded synchronously into device blocks 7 and 8 (no
    prefetch left), which then hold ``source``'s blocks 1 and 2 (and did not before)."""
    before = [block(caches, i) for i in (7, 8)]
    scheduler.after_alloc(req, KVCacheBlocks(([KVCacheBlock(7), KVCacheBlock(8)],)), 8)
    meta = scheduler.build_meta(output())
    assert meta.prefetches == [] and [job.sync for job in meta.loads] == [True]
    run(scheduler, worker, meta)
    assert worker.take_load_errors() == set()
    assert all(same(block(caches, 7), block(source, 1))) and all(same(block(caches, 8), block(source, 2)))
    assert not any(same(before[0], block(source, 1))), "negative control: the blocks differed before"


def test_a_disk_hit_is_read_in_the_lookup_and_loaded_in_its_step(tmp_path):
    scheduler, worker, caches = engine(tmp_path)
    only_on_disk(scheduler, worker)
    b = request("b")
    scheduler.track(b)
    assert scheduler.lookup(b, 0) == (8, False)  # read while vLLM asked: a host hit at once
    assert scheduler.stats.data["tier_loaded_blocks{tier=disk}"] == 2 and not scheduler.prefetcher.local_reads
    loaded_in_its_step(scheduler, worker, caches, b, source=caches)
    assert scheduler.stats.data["tier_hit_tokens{tier=disk}"] == 8
    worker.shutdown()
    scheduler.close()


def test_a_corrupt_block_on_disk_is_recomputed_not_served(tmp_path):
    scheduler, worker, _ = engine(tmp_path)
    only_on_disk(scheduler, worker)
    (data,) = list((tmp_path / "disk").rglob("data-0.bin"))
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1  # a byte of slot 0's block: the first one "a" wrote
    data.write_bytes(bytes(raw))
    b = request("b")
    scheduler.track(b)
    assert scheduler.lookup(b, 0) == (0, False)
    assert (
        scheduler.stats.data["tier_corrupt_blocks{tier=disk}"] == 1
        and scheduler.stats.data["tier_failed_loads{tier=disk}"] == 1
    )
    worker.shutdown()
    scheduler.close()


def test_without_a_worker_in_the_process_the_read_goes_to_the_workers(tmp_path):
    scheduler, worker, _ = engine(tmp_path, engine_id=None)
    assert local.find(None) is None
    only_on_disk(scheduler, worker)
    b = request("b")
    scheduler.track(b)
    assert scheduler.lookup(b, 0) == (None, False)
    assert len(scheduler.build_meta(output()).prefetches) == 1
    worker.shutdown()
    scheduler.close()
