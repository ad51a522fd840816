"""Tier backends offered by name through ``kvhal_tier_backends``: the built-in ``disk``, third
parties, and the errors that name the plugin at fault."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from kvhal.errors import MalformedResultError, PluginError, ValidationError
from kvhal.hookspecs import hookimpl
from kvhal.offload.host_tier import HostTier
from kvhal.offload.manager import OffloadingManager
from kvhal.registry import PluginRegistry, select_device
from kvhal.tiers.backend import MISSING, OK, TierBackend, TierSpec
from kvhal.tiers.chain import ChainTier, TierChain
from kvhal.tiers.disk import DiskTier
from kvhal.tiers.index import TierIndex
from kvhal.tiers.io import TierIO
from kvhal.tiers.media import available_tiers, open_tier

SLOT = 8192


class MemoryTier(TierBackend):
    """A third party's backend: slots in a dict (a real medium would be a store's client)."""

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.num_slots = spec.options["slots"]
        self.held: dict[int, tuple[bytes, bytes]] = {}

    def recover(self, progress=None):
        return list(self.held), [key for key, _ in self.held.values()]

    def write(self, slots, keys, buffers):
        for slot, key, buffer in zip(slots, keys, buffers, strict=True):
            self.held[slot] = (key, bytes(buffer))
        done: Future[list[bool]] = Future()
        done.set_result([True] * len(slots))
        return done

    def read(self, slots, keys, buffers):
        outcomes = []
        for slot, key, buffer in zip(slots, keys, buffers, strict=True):
            held = self.held.get(slot)
            if held is None or held[0] != key:
                outcomes.append(MISSING)
            else:
                buffer.cast("B")[:] = held[1]
                outcomes.append(OK)
        done: Future[list[str | None]] = Future()
        done.set_result(outcomes)
        return done

    def close(self) -> None:
        self.held.clear()


class Offers:
    def __init__(self, offers: dict) -> None:
        self.offers = offers

    @hookimpl
    def kvhal_tier_backends(self):
        return self.offers


def registry_with(*plugins: tuple[str, object]) -> PluginRegistry:
    registry = PluginRegistry(autoload=False)
    for name, plugin in plugins:
        registry.register(plugin, name, "tests")
    return registry


def test_disk_is_built_in(tmp_path):
    registry = PluginRegistry(autoload=False)
    assert "disk" in available_tiers(registry)
    tier = open_tier("disk", TierSpec({"path": str(tmp_path), "bytes_to_use": 1 << 20}, SLOT), registry)
    assert isinstance(tier, DiskTier)
    tier.close()


def test_a_third_party_backend_serves_the_chain_end_to_end():
    registry = registry_with(("memtier", Offers({"memory": MemoryTier})))
    backend = open_tier("memory", TierSpec({"slots": 8}, SLOT), registry)
    with HostTier(select_device("cpu"), 4 * SLOT, SLOT) as host:
        chain = TierChain(OffloadingManager(host.pool), [ChainTier("memory", TierIndex(8))])
        io = TierIO(host, backend)
        data = np.random.default_rng(0).integers(0, 256, (6, SLOT), dtype=np.uint8)
        keys = [b"k%d" % i for i in range(6)]
        for key, row in zip(keys, data, strict=True):  # one block at a time: the host holds 4
            plan, (write,) = chain.prepare_store([key], ["memory"])
            host.scatter_slots(plan.slots, row[None])  # what the device copy would write
            chain.complete_store(plan.keys, writes=[write])
            chain.complete_write(
                write, success=all(io.write(write.keys, write.host_slots, write.slots, False).result())
            )
        # the host tier holds k2..k5 in its 4 slots: promoting k0, k1 leaves room for 2 hits
        assert chain.lookup(keys) == (4, 2), "the two oldest blocks come from the third party's tier"
        load = chain.prepare_load(keys[:4])
        (read,) = load.reads
        assert read.tier == "memory" and read.keys == keys[:2]
        outcomes = io.read(read.keys, read.slots, read.host_slots).result()
        assert outcomes == [OK, OK]
        rows = np.empty((4, SLOT), dtype=np.uint8)
        host.gather_slots(load.host_slots, rows)
        chain.complete_load(load)
        np.testing.assert_array_equal(rows, data[:4])


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValidationError, match="unknown tier backend 's3'; known: disk") as raised:
        open_tier("s3", TierSpec({}, SLOT), PluginRegistry(autoload=False))
    assert raised.value.argument == "tier"


def test_malformed_offers_and_results_name_the_plugin():
    registry = registry_with(("badoffer", Offers({"x": "not callable"})))
    with pytest.raises(MalformedResultError, match="badoffer"):
        available_tiers(registry)
    registry = registry_with(("badfactory", Offers({"x": lambda spec: object()})))
    with pytest.raises(MalformedResultError, match=r"badfactory.*returned object; expected .* TierBackend"):
        open_tier("x", TierSpec({}, SLOT), registry)


def test_a_raising_factory_names_the_plugin_but_a_refused_option_names_the_option():
    def broken(spec):
        raise RuntimeError("no route to store")

    def picky(spec):
        raise ValidationError("bucket", "must be set")

    registry = registry_with(("flaky", Offers({"broken": broken, "picky": picky})))
    with pytest.raises(PluginError, match=r"flaky.*no route to store"):
        open_tier("broken", TierSpec({}, SLOT), registry)
    with pytest.raises(ValidationError, match="bucket: must be set"):
        open_tier("picky", TierSpec({}, SLOT), registry)


def test_two_plugins_offering_one_name_are_refused_naming_both():
    registry = registry_with(("one", Offers({"memory": MemoryTier})), ("two", Offers({"memory": MemoryTier})))
    with pytest.raises(PluginError, match=r"one.*two|two.*one"):
        available_tiers(registry)


def test_offers_go_through_the_hook_caller():
    seen = []

    class Tracer:
        @hookimpl(wrapper=True)
        def kvhal_tier_backends(self):
            result = yield
            seen.append(sorted(name for offer in result for name in offer))
            return result

    registry = registry_with(("tracer", Tracer()))
    available_tiers(registry)
    assert ["disk"] in seen
