"""One worker, in the scheduler's process (vLLM's engine core without tensor parallelism): a
lookup whose hit continues on the disk tier reads it into host slots through the worker's
tier itself and answers with a host hit in the same call, no step lost; the request's load
then copies the very bytes the disk held. Both sides are kvhal's real ones, on the CPU
plugin and a real disk tier, driven as vLLM drives them."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.outputs import KVConnectorOutput

from kvhal.vllm import KVHALConnector
from kvhal.vllm.config import LowerTierConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.local import in_process_worker
from kvhal.vllm.metadata import KVHALMetadata
from kvhal.vllm.scheduler_side import SchedulerSide
from kvhal.vllm.worker_side import WorkerSide
from tests.test_scheduler_side import output, prefill, request
from tests.test_worker_side import (
    HEAD,
    LAYERS,
    PAGE,
    TOKENS,
    block,
    connector_config,
    kv_caches,
    same,
    settle,
)


def engine(tmp_path, in_process: bool = True) -> tuple[SchedulerSide, WorkerSide, dict]:
    """The scheduler side is handed the worker where it runs ``in_process`` (as the connector
    does: :func:`kvhal.vllm.local.in_process_worker`, tested below)."""
    base = connector_config(slots=4)
    # the timeout policy: these tests wait for their reads (the auto policy's probes: below)
    lower = LowerTierConfig(
        "disk",
        {"path": str(tmp_path / "disk"), "bytes_to_use": 1 << 20},
        "through",
        "clock",
        wait_policy="timeout",
    )
    config = dataclasses.replace(base, lower_tier=lower, fingerprint={"model": "local"})
    worker = WorkerSide(config)
    caches = kv_caches(split=False, seed=3)
    worker.register(caches)
    return SchedulerSide(config, local=worker if in_process else None), worker, caches


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
    keys = [offload_key(h, 0) for h in request("a").block_hashes[:2]]
    assert scheduler.manager.lookup(keys) == 0 and scheduler.chain.tier("disk").index.lookup(keys) == 2


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
    scheduler, worker, _ = engine(tmp_path, in_process=False)
    only_on_disk(scheduler, worker)
    b = request("b")
    scheduler.track(b)
    assert scheduler.lookup(b, 0) == (None, False)
    assert len(scheduler.build_meta(output()).prefetches) == 1
    worker.shutdown()
    scheduler.close()


# -- finding the in-process worker: vLLM's KV-transfer agent --------------------------


def connector(role: KVConnectorRole, engine_id: str) -> KVHALConnector:
    """A real KVHALConnector of engine ``engine_id`` (one worker), as vLLM builds it, on a
    config without a model; the worker's registers its KV caches."""
    kv = KVTransferConfig(
        kv_connector="KVHALConnector",
        kv_connector_module_path="kvhal.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"cpu_bytes_to_use": 8 * len(LAYERS) * PAGE},
        engine_id=engine_id,
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=kv,
        cache_config=SimpleNamespace(block_size=TOKENS),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, world_size=1),
        kv_events_config=None,  # a VllmConfig always has it: None without KV events
    )
    spec = SimpleNamespace(page_size_bytes=PAGE, head_size=HEAD)
    kv_cache_config = SimpleNamespace(
        prefix_cacheable_group_ids=[0],
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=list(LAYERS))],
        kv_cache_layout=None,
    )
    built = KVHALConnector(vllm_config, role, kv_cache_config)
    if role is KVConnectorRole.WORKER:
        built.register_kv_caches(kv_caches(split=False))
    return built


@pytest.fixture
def agent(monkeypatch) -> KVHALConnector:
    """Engine "engine-1"'s worker connector as this process's KV-transfer agent (what vLLM's
    ensure_kv_transfer_initialized sets); the global is restored after the test."""
    worker = connector(KVConnectorRole.WORKER, "engine-1")
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", worker)
    yield worker
    worker.shutdown()


def test_the_in_process_worker_is_the_agents_worker_of_the_same_engine(agent):
    config = agent.worker_side.config
    assert config.engine_id == "engine-1" and config.world_size == 1
    assert in_process_worker(config) is agent.worker_side
    # the negative controls: each differs from the match by one thing
    assert in_process_worker(dataclasses.replace(config, world_size=2)) is None
    assert in_process_worker(dataclasses.replace(config, engine_id="engine-2")) is None
    assert in_process_worker(dataclasses.replace(config, engine_id=None)) is None


def test_without_an_agent_there_is_no_in_process_worker(monkeypatch):
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    assert in_process_worker(dataclasses.replace(connector_config(), engine_id="engine-1")) is None


def test_an_agent_without_a_worker_side_is_not_one(monkeypatch):
    """Another connector as the agent (no ``worker_side``), or kvhal's scheduler-role one."""
    scheduler = connector(KVConnectorRole.SCHEDULER, "engine-1")
    config = scheduler.config
    for other in (SimpleNamespace(), scheduler):
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", other)
        assert in_process_worker(config) is None
    scheduler.shutdown()


@pytest.mark.parametrize("engine_id", ["engine-1", "engine-2"])
def test_the_scheduler_connector_is_handed_its_engines_worker_only(agent, engine_id):
    """The connector hands its scheduler side the agent's worker side of its own engine."""
    scheduler = connector(KVConnectorRole.SCHEDULER, engine_id)
    handed = scheduler.scheduler_side.local
    assert handed is (agent.worker_side if engine_id == "engine-1" else None)
    scheduler.shutdown()


def test_a_tier_refusing_the_read_at_once_costs_a_recompute_not_the_lookup(tmp_path):
    # a plugin's backend may raise instead of returning a future: the lookup must not raise
    # into vLLM, and the promotion's host slots and the disk's index must end as a failed read
    scheduler, worker, _ = engine(tmp_path)
    only_on_disk(scheduler, worker)
    disk = worker.tiers["disk"]

    class Refusing:
        def read(self, keys, slots, host_slots):
            raise OSError("the medium refused the read")

        def write(self, *args):
            return disk.write(*args)

        def close(self):
            disk.close()

    worker.tiers["disk"] = Refusing()
    b = request("b")
    scheduler.track(b)
    assert scheduler.lookup(b, 0) == (0, False), "recomputed: its blocks were not read"
    assert scheduler.stats.data["tier_io_errors{tier=disk}"] == 2
    assert scheduler.stats.data["tier_failed_loads{tier=disk}"] == 1
    assert not scheduler.prefetcher.local_reads and scheduler.prefetcher.reading == 0
    assert scheduler.manager.num_storing == 0, "the promotion's host slots were given back"
    worker.tiers["disk"] = disk
    worker.shutdown()
    scheduler.close()


def test_a_lookup_waiting_whole_waits_three_predicted_reads_at_most(tmp_path):
    """On the CPU plugin the lookup waits for its read whole, but only up to three times the
    read's predicted time: a read that stalls is then waited for as a prefetch while the engine
    steps. Before a tier's first read there is no prediction: its deadline bounds the wait."""
    from kvhal.vllm.local import waits_whole
    from kvhal.vllm.prefetch import WHOLE_WAIT_READS

    scheduler, worker, _ = engine(tmp_path)
    prefetcher = scheduler.prefetcher
    assert waits_whole(worker)
    assert prefetcher._whole_wait({"disk": 4}) == float("inf"), "not measured yet"
    policy = prefetcher.waits["disk"]
    assert policy is not None
    slot = scheduler.config.slot_bytes
    for _ in range(3):
        policy.observe_read(64 * slot, 0.01)  # a read of 64 blocks alone: 10 ms
    predicted = policy.read_seconds(64 * slot)
    assert predicted == pytest.approx(0.01)
    assert prefetcher._whole_wait({"disk": 64}) == pytest.approx(WHOLE_WAIT_READS * predicted)
    worker.shutdown()
    scheduler.close()
