"""Remote stores offered by URL scheme through ``kvhal_remote_stores``: the built-in ones,
a third party's, and the errors that name the plugin or the URL at fault."""

from __future__ import annotations

import numpy as np
import pytest

from kvhal.errors import MalformedResultError, PluginError, ValidationError
from kvhal.hookspecs import hookimpl
from kvhal.offload.host_tier import HostTier
from kvhal.registry import PluginRegistry
from kvhal.tiers.backend import CORRUPT, OK, TierSpec
from kvhal.tiers.media import available_stores, open_store, url_scheme
from kvhal.tiers.remote.format import UNAUTHENTICATED
from kvhal.tiers.remote.store import ABSENT, FAILED, RemoteStore
from kvhal.tiers.remote.tier import RemoteTier

SLOT = 4096


class DictStore(RemoteStore):
    """A third party's store: values in a dict (a real one would be a client of a server)."""

    def __init__(self, url: str, values: dict[str, bytes]) -> None:
        self.url = url
        self.values = values  # shared by every client of the plugin: one "server"

    def exist(self, names):
        return [name in self.values for name in names]

    def put(self, names, values):
        for name, parts in zip(names, values, strict=True):
            self.values.setdefault(name, b"".join(bytes(p) for p in parts))
        return [True] * len(names)

    def get(self, names, buffers):
        sizes = []
        for name, parts in zip(names, buffers, strict=True):
            value = self.values.get(name)
            if value is None:
                sizes.append(ABSENT)
                continue
            if len(value) > sum(p.nbytes for p in parts):
                sizes.append(FAILED)
                continue
            at = 0
            for part in parts:
                chunk = value[at : at + part.nbytes]
                part.cast("B")[: len(chunk)] = chunk
                at += len(chunk)
            sizes.append(len(value))
        return sizes


class DictStorePlugin:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    @hookimpl
    def kvhal_remote_stores(self):
        def open_dict(url: str) -> DictStore:
            if "bad" in url:
                raise ValidationError("remote_url", "the dict store refuses 'bad'")
            return DictStore(url, self.values)

        return {"dict": open_dict}


@pytest.fixture
def registry() -> PluginRegistry:
    registry = PluginRegistry(autoload=False)
    registry.pm.register(DictStorePlugin(), name="dict-store")
    return registry


def test_the_built_in_schemes_are_offered():
    assert {"mooncake", "redis", "rediss", "redis+cluster", "rediss+cluster", "s3"} <= set(
        available_stores(PluginRegistry(autoload=False))
    )


def test_a_third_party_store_serves_the_remote_tier(registry, cpu):
    host = HostTier(cpu, SLOT * 4, SLOT)
    rows = np.frombuffer(host.memory(), np.uint8)[: SLOT * 4].reshape(4, SLOT)
    rows[:] = np.random.default_rng(3).integers(0, 256, rows.shape, dtype=np.uint8)
    spec = TierSpec({}, SLOT, fingerprint={"model": "m"}, role="io")
    tier = RemoteTier("dict://anything", spec, host=host, registry=registry, secret=b"s")
    keys = [b"k0", b"k1"]
    assert tier.write(keys, [0, 1]).result(5) == [True, True]
    assert tier.read(keys, [2, 3]).result(5) == [OK, OK]
    assert bytes(host.slot_memory(2)) == bytes(host.slot_memory(0))
    values = registry.pm.get_plugin("dict-store").values
    name = tier.names(keys[:1])[0]
    values[name] = values[name][:-1] + bytes([values[name][-1] ^ 1])
    assert tier.read(keys, [2, 3]).result(5) == [CORRUPT, OK], "the third party's bytes are verified too"
    unsigned = RemoteTier("dict://anything", spec, host=host, registry=registry)
    assert unsigned.write([b"k2"], [0]).result(5) == [True]
    assert tier.read([b"k2"], [2]).result(5) == [UNAUTHENTICATED], "written without the secret"
    for t in (tier, unsigned):
        t.close()
    host.close()


def test_unknown_schemes_and_bad_urls_are_named(registry):
    with pytest.raises(ValidationError, match=r"unknown remote store URL scheme 'memcached'.*dict") as raised:
        open_store("memcached://h:1", registry)
    assert raised.value.argument == "remote_url"
    with pytest.raises(ValidationError, match="must be a URL"):
        url_scheme("h:6379")
    with pytest.raises(ValidationError, match="refuses 'bad'"):
        open_store("dict://bad", registry)


def test_a_scheme_offered_twice_or_a_factory_of_the_wrong_type_names_the_plugin(registry):
    class Twice:
        @hookimpl
        def kvhal_remote_stores(self):
            return {"dict": lambda url: None}

    registry.pm.register(Twice(), name="twice")
    with pytest.raises(PluginError, match="offers remote store 'dict'"):
        available_stores(registry)
    registry.pm.unregister(name="dict-store")
    with pytest.raises(MalformedResultError, match=r"twice.*returned NoneType"):
        open_store("dict://x", registry)
