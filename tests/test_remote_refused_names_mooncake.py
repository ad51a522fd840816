"""A refused value does not keep its name on Mooncake either (issue 38, item 2): a plant under
a block's name is replaced by the engine's recomputed block, and a value of a block's length
that is not the one refused is left as it is. A real Mooncake master and store node."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from kvhal.offload.host_tier import HostTier
from kvhal.registry import PluginRegistry
from kvhal.testing.mooncake_servers import MooncakeCluster
from kvhal.tiers.backend import OK
from kvhal.tiers.media import open_store
from kvhal.tiers.remote.format import UNAUTHENTICATED
from tests.test_remote_refused_names import SLOT, fresh_keys, open_tier, plant
from tests.test_remote_refused_names import host as host  # a fixture

if not MooncakeCluster.available():
    pytest.skip(str(MooncakeCluster.missing()), allow_module_level=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[MooncakeCluster]:
    with MooncakeCluster() as running:
        yield running


class Planter:
    """A writer without the secret: a plain client of the store (``plant`` calls ``set``)."""

    def __init__(self, url: str) -> None:
        self.store = open_store(url, PluginRegistry())

    def set(self, name: str, value: bytes, nx: bool = True) -> bool:
        return self.store.put([name], [[memoryview(value)]]) == [True]

    def client(self) -> Planter:
        return self


def test_a_planted_block_is_replaced_after_one_recompute(cluster, host: HostTier):
    keys = fresh_keys(2)
    engine = open_tier(cluster.url, host, secret=b"fleet")
    planter = Planter(cluster.url)
    plant(planter, engine, keys)  # type: ignore[arg-type]
    assert engine.read(keys, [8, 9]).result(30) == [UNAUTHENTICATED] * 2
    assert engine.write(keys, [0, 1]).result(30) == [True, True]
    other = open_tier(cluster.url, host, secret=b"fleet")
    assert other.read(keys, [10, 11]).result(30) == [OK, OK]
    assert bytes(host.slot_memory(10)) == bytes(host.slot_memory(0))
    # the negative control: a name nobody refused keeps what it holds (a put if absent)
    more = fresh_keys(1)
    plant(planter, engine, more)  # type: ignore[arg-type]
    assert other.write(more, [2]).result(30) == [True]
    assert other.read(more, [12]).result(30) == [UNAUTHENTICATED]
    for tier in (engine, other):
        tier.close()
    planter.store.close()


def test_replace_leaves_a_value_of_a_blocks_length_unless_it_is_the_one_refused(cluster):
    store = open_store(cluster.url, PluginRegistry())
    name = f"kvhal-test/replace/{fresh_keys(1)[0].hex()}"
    held, new = b"g" * SLOT, b"n" * SLOT
    assert store.put([name], [[memoryview(held)]]) == [True]
    assert store.replace([name], [[memoryview(new)]], [hashlib.sha1(b"other").hexdigest()]) == [True]
    out = bytearray(SLOT)
    assert store.get([name], [[memoryview(out)]]) == [SLOT] and bytes(out) == held
    assert store.replace([name], [[memoryview(new)]], [hashlib.sha1(held).hexdigest()]) == [True]
    assert store.get([name], [[memoryview(out)]]) == [SLOT] and bytes(out) == new
    store.close()
