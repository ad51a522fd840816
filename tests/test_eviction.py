"""Eviction policies: the built-in ones, and third-party ones through the hook."""

from __future__ import annotations

import pytest

from kvhal.errors import MalformedResultError, PluginError, PolicyError, ValidationError
from kvhal.hookspecs import DEVICE_HOOKS, hookimpl
from kvhal.offload.eviction import ClockPolicy, LRUPolicy, S3FIFOPolicy, available_policies, create_policy
from kvhal.offload.manager import OffloadingManager


def test_builtin_policies_come_through_the_hook(registry):
    assert set(available_policies(registry)) >= {"lru", "s3fifo", "clock"}
    assert isinstance(create_policy("clock", 4, registry), ClockPolicy)
    assert isinstance(create_policy("lru", 4, registry), LRUPolicy)
    assert isinstance(create_policy("s3fifo", 4, registry), S3FIFOPolicy)
    assert "kvhal_eviction_policies" not in DEVICE_HOOKS
    # Not a device plugin, so selection does not probe it.
    assert [p.name for p in registry.device_plugins()] == ["cpu"]


def test_builtin_policies_survive_an_allowlist():
    from kvhal.registry import PluginRegistry

    registry = PluginRegistry(autoload=False, allow="someaccelerator")
    assert "lru" in available_policies(registry)


def test_unknown_policy_lists_the_known_ones(registry):
    known = r"unknown eviction policy 'lfu'; known: clock, lru, s3fifo"
    with pytest.raises(ValidationError, match=known) as info:
        OffloadingManager(4, "lfu", registry=registry)
    assert info.value.argument == "policy"


class MostRecentFirst(LRUPolicy):
    """A third-party policy: evicts the most recently used block (MRU)."""

    def evict(self, n, pinned):
        victims = []
        slot = self._prev[self._nil]
        while len(victims) < n:
            before = self._prev[slot]
            if not pinned[slot]:
                self.remove([slot])
                victims.append(slot)
            slot = before
        return victims


class MRUPlugin:
    @hookimpl
    def kvhal_eviction_policies(self):
        return {"mru": MostRecentFirst}


def test_third_party_policy_plugin_is_used(registry):
    registry.register(MRUPlugin(), "mru-plugin", "kvhal-mru 1.0")
    manager = OffloadingManager(3, "mru", registry=registry)
    assert isinstance(manager.policy, MostRecentFirst)
    keys = [bytes([i]) * 8 for i in range(3)]
    plan = manager.prepare_store(keys)
    manager.complete_store(plan.keys)
    # LRU would evict keys[0]; MRU evicts the newest.
    assert manager.prepare_store([b"new"]).evicted == [keys[2]]


def test_a_name_offered_twice_names_both_plugins(registry):
    class Clash:
        @hookimpl
        def kvhal_eviction_policies(self):
            return {"lru": LRUPolicy}

    registry.register(Clash(), "clash", "kvhal-clash 0.1")
    with pytest.raises(PluginError, match=r"'clash'.*offers policy 'lru', as 'kvhal-policies' does"):
        available_policies(registry)


@pytest.mark.parametrize("result", [["lru"], {"x": 3}])
def test_malformed_hook_result_names_the_plugin(registry, result):
    class Broken:
        @hookimpl
        def kvhal_eviction_policies(self):
            return result

    registry.register(Broken(), "broken", "kvhal-broken 0.1")
    with pytest.raises(MalformedResultError, match="plugin 'broken'"):
        OffloadingManager(4, "lru", registry=registry)


def test_factory_returning_a_non_policy_names_the_plugin(registry):
    class Odd:
        @hookimpl
        def kvhal_eviction_policies(self):
            return {"odd": lambda n: object()}

    registry.register(Odd(), "odd-plugin", "kvhal-odd 0.1")
    with pytest.raises(MalformedResultError, match=r"plugin 'odd-plugin'.*expected .* EvictionPolicy"):
        OffloadingManager(4, "odd", registry=registry)


def test_a_raising_hook_or_factory_names_the_plugin(registry):
    def refuse(num_slots):
        raise ValueError(f"{num_slots} slots is too few")

    class Raises:
        @hookimpl
        def kvhal_eviction_policies(self):
            return {"picky": refuse}

    registry.register(Raises(), "raises", "kvhal-raises 0.1")
    with pytest.raises(PluginError, match=r"plugin 'raises'.*factory of 'picky' raised ValueError: 4 slots"):
        OffloadingManager(4, "picky", registry=registry)

    class Crashes:
        @hookimpl
        def kvhal_eviction_policies(self):
            raise RuntimeError("config missing")

    registry.register(Crashes(), "crashes", "kvhal-crashes 0.1")
    with pytest.raises(PluginError, match=r"plugin 'crashes'.*raised RuntimeError: config missing"):
        OffloadingManager(4, "lru", registry=registry)


def test_lru_order():
    policy = LRUPolicy(5)
    policy.insert([0, 1, 2, 3], [b""] * 4)
    policy.touch([1, 0])  # 0 then 1 become most recent; 1 last
    unpinned = [0] * 5
    assert policy.evict(2, unpinned) == [2, 3]
    policy.remove([1])
    assert policy.evict(1, unpinned) == [0]
    with pytest.raises(PolicyError):
        policy.evict(1, unpinned)


def test_lru_skips_pinned():
    policy = LRUPolicy(3)
    policy.insert([0, 1, 2], [b""] * 3)
    assert policy.evict(1, [1, 0, 0]) == [1]
    assert policy.evict(1, [1, 0, 0]) == [2]


def test_s3fifo_filters_one_hit_wonders():
    """A block reused by another request (two touches) survives a scan of one-time blocks."""
    policy = S3FIFOPolicy(10)  # small queue: 1 slot
    unpinned = [0] * 10
    policy.insert([0], [b"popular"])
    policy.touch([0])
    policy.touch([0])
    scan = list(range(1, 10))
    policy.insert(scan, [bytes([i]) for i in scan])
    victims = policy.evict(9, unpinned)
    assert 0 not in victims  # moved to main instead
    # A one-hit wonder's key is a ghost: re-inserted, it goes to main.
    policy.insert([victims[0]], [bytes([victims[0]])])
    assert policy._queue[victims[0]] == 2


def test_s3fifo_skips_pinned_and_removes():
    policy = S3FIFOPolicy(4)
    policy.insert([0, 1, 2, 3], [b"a", b"b", b"c", b"d"])
    pinned = [1, 0, 0, 0]
    assert 0 not in policy.evict(3, pinned)
    policy.remove([0])
    with pytest.raises(PolicyError):
        policy.evict(1, [0] * 4)
