"""Tenants apart (issue 38, item 3): two tenants with different ``cache_salt`` never load each
other's KV from kvhal's host tier, its disk tier or a shared Redis store; the same tenant does
(the positive control); and it is the salt that separates them: the same prompt without a salt,
or with one salt, is served (the control that the tier holds the blocks and would serve them).

Below the engine, with kvhal's real halves: the scheduler side fed vLLM's own ``Request``
objects, hashed by vLLM's own block hasher (which puts ``cache_salt`` into the first block's
extra keys), and the worker side in the scheduler's process on the CPU plugin, over a real
directory and a real Redis server on loopback, with the fleet's secret set. A hit is checked on
bytes: the device blocks it loads hold the writer's blocks, and did not before.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request

from kvhal.testing.redis_servers import RedisServer
from kvhal.tiers.index import TierIndex
from kvhal.vllm.config import LowerTierConfig, RemoteTierConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.scheduler_side import SchedulerSide
from kvhal.vllm.worker_side import WorkerSide
from tests.test_local_read import loaded_in_its_step, run
from tests.test_scheduler_side import HASHER, PROMPT, output, prefill
from tests.test_worker_side import block, connector_config, kv_caches, same

#: Another prompt with ``PROMPT``'s first two blocks (a system prompt), then its own block.
ASKED = [*PROMPT[:8], 70, 71, 72, 73]
SECRET = "the-fleet-secret"


def salted(req_id: str, tokens: list[int], salt: str | None) -> Request:
    """A request as vLLM makes one from an API call with ``cache_salt`` (``None``: without)."""
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, block_hasher=HASHER, cache_salt=salt)


def keys(req: Request, blocks: int = 2) -> list[bytes]:
    return [offload_key(h, 0) for h in req.block_hashes[:blocks]]


@dataclasses.dataclass
class Engine:
    """One engine's kvhal: its scheduler side, its one worker (in the same process), its KV."""

    scheduler: SchedulerSide
    worker: WorkerSide
    caches: dict

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.close()


def engine(seed: int, disk: Path | None = None, url: str | None = None) -> Engine:
    """An engine with a host tier of 8 slots, over a disk tier at ``disk`` and/or the store at
    ``url`` (the timeout policies: these tests wait for their reads)."""
    lower = None
    if disk is not None:
        options = {"path": str(disk), "bytes_to_use": 1 << 20}
        lower = LowerTierConfig("disk", options, "through", "clock", wait_policy="timeout")
    store = RemoteTierConfig(url, wait_policy="timeout", lookup_timeout_ms=5000) if url else None
    config = dataclasses.replace(
        connector_config(slots=8), lower_tier=lower, remote_tier=store, fingerprint={"model": "tenants"}
    )
    worker = WorkerSide(config)
    caches = kv_caches(split=False, seed=seed)
    worker.register(caches)
    return Engine(SchedulerSide(config, local=worker), worker, caches)


def answer(scheduler: SchedulerSide, req: Request) -> tuple[int | None, bool]:
    """Ask as vLLM does, once per step, until answered (a store's answer takes a round trip)."""
    scheduler.track(req)
    deadline = time.monotonic() + 10
    while (found := scheduler.lookup(req, 0))[0] is None:
        assert time.monotonic() < deadline, "the lookup never answered"
        scheduler.build_meta(output())
        time.sleep(0.002)
    return found


def stored(e: Engine, req: Request, tier: str | None) -> None:
    """``req``'s prompt computed into device blocks 1-3 and stored, written through to ``tier``."""
    assert answer(e.scheduler, req) == (0, False)
    e.scheduler.after_alloc(req, KVCacheBlocks(([],)), 0)  # vLLM's call for a miss
    run(e.scheduler, e.worker, prefill(e.scheduler, req, [1, 2, 3]))
    deadline = time.monotonic() + 10
    while tier is not None and e.scheduler.stats.data.get(f"tier_written_blocks{{tier={tier}}}", 0) < 3:
        assert time.monotonic() < deadline, f"the write to {tier} never ended"
        run(e.scheduler, e.worker, e.scheduler.build_meta(output()))
        time.sleep(0.005)
    e.scheduler.request_finished(req)


@pytest.fixture
def secret(monkeypatch) -> None:
    monkeypatch.setenv("KVHAL_REMOTE_SECRET", SECRET)


@pytest.fixture
def redis_url(request, secret) -> Iterator[str | None]:
    """A Redis server for the store's cases only."""
    if "redis" not in request.node.name:
        yield None
        return
    with RedisServer() as server:
        yield server.url


def writer_then_reader(tier: str, tmp_path: Path, url: str | None, salt: str | None) -> tuple[Engine, Engine]:
    """Tenant ``salt`` stores ``PROMPT`` on a writer engine; the reader is the engine that asks
    next: the writer itself (its host tier holds the blocks), or one started afresh over the
    writer's disk tier (a restart: its host tier is empty), or over the store (another engine)."""
    disk = tmp_path / "disk" if tier == "disk" else None
    writer = engine(1, disk=disk, url=url)
    stored(writer, salted("w", PROMPT, salt), None if tier == "host" else tier)
    if tier == "host":
        return writer, writer
    writer.close()
    return writer, engine(2, disk=disk, url=url)


CASES = [
    pytest.param("alice", "bob", False, id="two-tenants"),
    pytest.param("alice", "alice", True, id="one-tenant"),
    pytest.param(None, None, True, id="no-salt"),
    pytest.param("alice", None, False, id="salt-then-none"),
    pytest.param(None, "alice", False, id="none-then-salt"),
]


@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
@pytest.mark.parametrize(("stored_by", "asked_by", "served"), CASES)
def test_a_tenant_is_served_its_own_kv_and_never_anothers(
    tier, stored_by, asked_by, served, tmp_path, redis_url
):
    writer, reader = writer_then_reader(tier, tmp_path, redis_url, stored_by)
    scheduler = reader.scheduler
    w, asked = salted("w", PROMPT, stored_by), salted("q", ASKED, asked_by)
    assert (keys(w) == keys(asked)) is served, "the salt did not decide the keys"
    found = answer(scheduler, asked)
    data = scheduler.stats.data
    if served:
        assert found == (8, False), "the same tenant's system prompt was not served"
        loaded_in_its_step(scheduler, reader.worker, reader.caches, asked, source=writer.caches)
        if tier != "host":
            assert (
                data[f"tier_loaded_blocks{{tier={tier}}}"] == 2
                and data[f"tier_hit_tokens{{tier={tier}}}"] == 8
            )
    else:
        assert found == (0, False), f"tenant {asked_by!r} was offered tenant {stored_by!r}'s KV"
        # the control: the tier holds the writer's blocks, and was asked (a store) or looked in
        if tier == "host":
            assert scheduler.manager.lookup(keys(w)) == 2 and scheduler.manager.lookup(keys(asked)) == 0
        elif tier == "disk":
            index = scheduler.chain.tier("disk").index
            assert index.lookup(keys(w)) == 2 and index.lookup(keys(asked)) == 0
        else:
            assert data["tier_lookups{tier=redis}"] == 1, "the store was not asked"
            [store] = scheduler.stores
            held = store.store.exist(keys(w)).result(5), store.store.exist(keys(asked)).result(5)
            assert held == ([True, True], [False, False])
        assert not any(k.startswith("tier_loaded_blocks") for k in data), "a tier was read for it"
        before = [block(reader.caches, i) for i in (7, 8)]
        scheduler.after_alloc(asked, KVCacheBlocks(([],)), 0)  # vLLM's call for a miss
        meta = scheduler.build_meta(output())
        assert meta.loads == [] and meta.prefetches == []
        assert all(same(block(reader.caches, 7), before[0])), "a device block was written"
    reader.close()
    if reader is not writer:
        writer.close()


def test_a_salt_changes_every_block_hash_of_a_prompt_not_only_the_first():
    """vLLM salts the first block's extra keys; each later hash chains its parent, so a salted
    prompt shares no block with another salt's, however long the common prefix. An empty salt
    is no salt (vLLM leaves it out)."""
    long = list(range(1, 41))  # ten blocks
    a, b, none = (salted(n, long, s) for n, s in (("a", "alice"), ("b", "bob"), ("n", None)))
    assert len(a.block_hashes) == 10
    for x, y in ((a, b), (a, none), (b, none)):
        assert not set(x.block_hashes) & set(y.block_hashes)
    assert salted("a2", long, "alice").block_hashes == a.block_hashes
    assert salted("e", long, "").block_hashes == none.block_hashes


def test_a_collision_in_the_disk_index_costs_a_recompute_never_another_tenants_kv(tmp_path, monkeypatch):
    """The disk tier's index knows a key by its 64-bit hash: made to collide (every key of
    tenant bob's prompt with alice's), bob's lookup believes the disk holds his blocks, and its
    read finds alice's under the same slot. The tier checks the full key on every read: bob is
    recomputed, counted as missing, and his device blocks never get alice's KV."""
    disk = tmp_path / "disk"
    writer = engine(1, disk=disk)
    alice, bob = salted("w", PROMPT, "alice"), salted("q", PROMPT, "bob")
    stored(writer, alice, "disk")
    writer.close()
    of_alice = dict(zip(keys(bob, 3), keys(alice, 3), strict=True))
    real = TierIndex.key_hash
    monkeypatch.setattr(TierIndex, "key_hash", staticmethod(lambda key: real(of_alice.get(key, key))))
    reader = engine(2, disk=disk)
    index = reader.scheduler.chain.tier("disk").index
    assert index.lookup(keys(bob)) == 2, "the collision was not made: the test shows nothing"
    before = [block(reader.caches, i) for i in (7, 8)]
    assert answer(reader.scheduler, bob) == (0, False), "bob was offered alice's blocks"
    data = reader.scheduler.stats.data
    assert data["tier_missing_blocks{tier=disk}"] >= 1 and data["tier_failed_loads{tier=disk}"] == 1
    for i, was in zip((7, 8), before, strict=True):
        assert all(same(block(reader.caches, i), was)), "a device block was written"
    assert not any(any(same(block(reader.caches, i), block(writer.caches, 1))) for i in range(16))
    reader.close()
