"""Per-tenant figures (issue 38, item 3): tokens asked about, hits and bytes stored by a short
digest of the request's ``cache_salt``, the first ``tenant_labels`` salts each under their own
label and the rest under ``"other"``; requests without a salt count in the engine-wide counters
only; ``tenant_labels: 0`` records none. Counted by kvhal's real scheduler side and worker side
(CPU plugin), fed vLLM's own requests; vLLM's Prometheus output is tests/test_vllm_stats.py's."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvhal.vllm.extra_config import check_extra_config
from kvhal.vllm.stats import TENANT_COUNTERS, KVHALStats, tenant_key
from kvhal.vllm.tenants import DEFAULT_TENANT_LABELS, OTHER, TenantLabels, tenant_label
from tests.test_local_read import run
from tests.test_scheduler_side import output
from tests.test_tenants import ASKED, PROMPT, Engine, answer, salted, stored
from tests.test_worker_side import connector_config, kv_caches

# -- the labels ---------------------------------------------------------------------------


def test_the_first_salts_get_their_own_label_and_the_rest_other():
    labels = TenantLabels(2)
    alice, bob = labels.label("alice"), labels.label("bob")
    assert alice == tenant_label("alice") and bob == tenant_label("bob") and alice != bob
    assert labels.label("carol") == OTHER and labels.label("dave") == OTHER
    assert labels.label("alice") == alice, "a labelled salt keeps its label past the limit"
    assert labels.label(None) is None and labels.label("") is None, "no salt: not a tenant"
    assert TenantLabels(0).label("alice") is None, "0 turns the figures off"
    assert TenantLabels().limit == DEFAULT_TENANT_LABELS


def test_a_label_is_a_short_digest_the_same_in_every_engine():
    salt = "tenant-42/8f0c2b"
    label = tenant_label(salt)
    assert len(label) == 8 and int(label, 16) >= 0 and label != OTHER
    assert salt not in label and "42" not in label
    assert TenantLabels(4).label(salt) == label, "another engine's (another process's) label"
    assert len({tenant_label(f"salt-{i}") for i in range(1000)}) == 1000


@pytest.mark.parametrize("bad", [-1, 1.5, True, "16"])
def test_a_bad_limit_is_refused(bad):
    with pytest.raises(ValueError, match="tenant_labels"):
        TenantLabels(bad)


@pytest.mark.parametrize("bad", [-1, 1025, "16", True, None])
def test_the_key_is_checked_naming_it(bad):
    from kvhal.errors import ValidationError

    with pytest.raises(ValidationError, match=r"kv_connector_extra_config\.tenant_labels"):
        check_extra_config({"cpu_bytes_to_use": 1 << 20, "tenant_labels": bad})
    assert check_extra_config({"cpu_bytes_to_use": 1 << 20}).tenant_labels == DEFAULT_TENANT_LABELS
    assert check_extra_config({"cpu_bytes_to_use": 1 << 20, "tenant_labels": 0}).tenant_labels == 0


def test_a_tenant_key_is_its_family_labelled_and_nothing_else():
    stats = KVHALStats()
    stats.add_tenant("tenant_hit_tokens", "1f2e3d4c", 8)
    stats.add_tenant("tenant_hit_tokens", "1f2e3d4c", 4)
    stats.add_tenant("tenant_stored_bytes", OTHER, 0)  # nothing counted: no key
    assert stats.data == {tenant_key("tenant_hit_tokens", "1f2e3d4c"): 12}
    with pytest.raises(KeyError):
        stats.add_tenant("tier_hit_tokens", "1f2e3d4c", 1)
    for bogus in ("hit_tokens{tenant=x}", "tier_hit_tokens{tenant=x}", "tenant_hit_tokens{tier=disk}"):
        with pytest.raises(ValueError, match="unknown kvhal counters"):
            KVHALStats(data={bogus: 1})
    summed = KVHALStats(data=dict(stats.data)).aggregate(KVHALStats(data=dict(stats.data)))
    assert summed.data == {tenant_key("tenant_hit_tokens", "1f2e3d4c"): 24}


# -- counted by the scheduler side --------------------------------------------------------


def host_engine(tenant_labels: int) -> Engine:
    """An engine with a host tier only, counting ``tenant_labels`` tenants apart."""
    from kvhal.vllm.scheduler_side import SchedulerSide
    from kvhal.vllm.worker_side import WorkerSide

    config = dataclasses.replace(connector_config(slots=16), tenant_labels=tenant_labels)
    worker = WorkerSide(config)
    caches = kv_caches(split=False, seed=1)
    worker.register(caches)
    return Engine(SchedulerSide(config, local=worker), worker, caches)


def miss(e: Engine, req) -> None:
    """``req`` asked about and not served: vLLM allocates it nothing from kvhal."""
    assert answer(e.scheduler, req) == (0, False)
    e.scheduler.after_alloc(req, KVCacheBlocks(([],)), 0)


def served(e: Engine, req, tokens: int) -> None:
    """``req`` served ``tokens`` from the host tier, loaded into device blocks from 7."""
    assert answer(e.scheduler, req) == (tokens, False)
    ids = [KVCacheBlock(7 + i) for i in range(tokens // e.scheduler.config.block_size)]
    e.scheduler.after_alloc(req, KVCacheBlocks((ids,)), tokens)
    run(e.scheduler, e.worker, e.scheduler.build_meta(output()))


def figures(stats: KVHALStats) -> dict[str, dict[str, int]]:
    """The tenant counters by family, then by label."""
    found: dict[str, dict[str, int]] = {}
    for key, value in stats.data.items():
        family, _, label = key.partition("{tenant=")
        if family in TENANT_COUNTERS:
            found.setdefault(family, {})[label[:-1]] = value
    return found


def test_each_tenants_lookups_hits_and_stored_bytes_are_counted_under_its_label():
    e = host_engine(tenant_labels=2)
    slot = e.scheduler.config.slot_bytes
    stored(e, salted("a1", PROMPT, "alice"), None)  # asked about 12 tokens, stored 3 blocks
    worker_stored = e.worker.stats.data["stored_bytes"]
    served(e, salted("a2", ASKED, "alice"), 8)  # alice's system prompt: 8 of 12 served
    miss(e, salted("b1", ASKED, "bob"))  # the same prompt, another tenant: not served
    miss(e, salted("c1", ASKED, "carol"))  # past the limit of 2
    miss(e, salted("d1", ASKED, "dave"))
    miss(e, salted("n1", ASKED, None))  # no salt: engine-wide only
    alice, bob = tenant_label("alice"), tenant_label("bob")
    assert figures(e.scheduler.stats) == {
        "tenant_lookup_tokens": {alice: 24, bob: 12, OTHER: 24},
        "tenant_hit_tokens": {alice: 8},
        "tenant_stored_bytes": {alice: 3 * slot},
    }
    assert worker_stored == 3 * slot, "the worker side's stored_bytes for alice's store"
    data = e.scheduler.stats.data
    assert data["lookup_tokens"] == 24 + 12 + 24 + 12 and data["hit_tokens"] == 8
    e.close()


def test_with_tenant_labels_0_nothing_is_counted_per_tenant():
    e = host_engine(tenant_labels=0)
    stored(e, salted("a1", PROMPT, "alice"), None)
    served(e, salted("a2", ASKED, "alice"), 8)
    assert figures(e.scheduler.stats) == {}
    assert e.scheduler.stats.data["hit_tokens"] == 8 and e.scheduler.stats.data["lookup_tokens"] == 24
    e.close()


def test_a_miss_counts_the_tokens_asked_about():
    """vLLM calls ``update_state_after_alloc`` with 0 for a miss: its tokens were asked about
    (they were counted for hits only before issue 38: a hit ratio of hits among hits)."""
    e = host_engine(tenant_labels=DEFAULT_TENANT_LABELS)
    miss(e, salted("n1", PROMPT, None))
    assert e.scheduler.stats.data["lookup_tokens"] == 12 and "hit_tokens" not in e.scheduler.stats.data
    e.close()
