"""Secret rotation and refused values over a real Redis server (issue 38, items 1 and 2).

A reader given previous secrets serves their values (and counts them) while it signs
with the current one; a value signed with neither is refused. A refused value no longer
keeps its name: the tier writes the recomputed block over it, with a Lua script that
replaces only the value that was refused, never a genuine one stored meanwhile.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvhal.offload.host_tier import HostTier
from kvhal.testing.redis_servers import RedisServer
from kvhal.tiers.backend import CORRUPT, IO_ERROR, OK, TierSpec
from kvhal.tiers.remote import format as remote_format
from kvhal.tiers.remote.format import HEADER_BYTES, UNAUTHENTICATED
from kvhal.tiers.remote.tier import RemoteTier

SLOT = 4096
SLOTS = 16
KV = {"model": "m", "layout": "LBHNC"}


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as running:
        yield running


@pytest.fixture
def host(cpu) -> Iterator[HostTier]:
    tier = HostTier(cpu, SLOT * SLOTS, SLOT)
    rows = np.frombuffer(tier.memory(), dtype=np.uint8)[: SLOT * SLOTS].reshape(SLOTS, SLOT)
    rows[:] = np.random.default_rng(0).integers(0, 256, rows.shape, dtype=np.uint8)
    yield tier
    tier.close()


def open_tier(url: str, host: HostTier, **more) -> RemoteTier:
    spec = TierSpec({}, SLOT, fingerprint=KV, role="io", rank=0, world_size=1)
    return RemoteTier(url, spec, host=host, **more)


def fresh_keys(n: int) -> list[bytes]:
    stamp = time.monotonic_ns().to_bytes(8, "big")
    return [stamp + i.to_bytes(4, "big") for i in range(n)]


def test_previous_secrets_are_served_and_counted_new_values_carry_the_current(server, host):
    keys = fresh_keys(3)
    old = open_tier(server.url, host, secret=b"S1")
    assert old.write(keys[:2], [0, 1]).result(10) == [True, True]
    stranger = open_tier(server.url, host, secret=b"S3")
    assert stranger.write(keys[2:], [2]).result(10) == [True]
    counted: list[int] = []
    rotated = open_tier(
        server.url, host, secret=b"S2", previous_secrets=[b"S1"], on_previous_secret=counted.append
    )
    assert rotated.read(keys, [8, 9, 10]).result(10) == [OK, OK, UNAUTHENTICATED]
    assert counted == [2]
    assert bytes(host.slot_memory(8)) == bytes(host.slot_memory(0))
    # without the previous secret, the same values are refused (the cold fleet of before)
    assert (
        open_tier(server.url, host, secret=b"S2").read(keys[:2], [11, 12]).result(10) == [UNAUTHENTICATED] * 2
    )
    new = fresh_keys(1)
    assert rotated.write(new, [3]).result(10) == [True]
    assert open_tier(server.url, host, secret=b"S2").read(new, [13]).result(10) == [OK]  # signed S2
    assert old.read(new, [14]).result(10) == [UNAUTHENTICATED]


def plant(server: RedisServer, tier: RemoteTier, keys: list[bytes]) -> list[bytes]:
    """A writer without the secret stores a well-formed value under each name, first."""
    attacker = server.client()
    planted = []
    for name in tier.names(keys):
        header = memoryview(bytearray(HEADER_BYTES))
        payload = memoryview(bytes(SLOT))
        remote_format.write_header(header, payload, tier.spec.digest(), name, b"not the fleet's")
        value = bytes(header) + bytes(payload)
        assert attacker.set(name, value, nx=True)
        planted.append(value)
    return planted


def test_a_planted_prefix_is_served_again_after_one_recompute(server, host):
    victim_keys = fresh_keys(4)
    engine = open_tier(server.url, host, secret=b"fleet")
    plant(server, engine, victim_keys)
    assert engine.read(victim_keys, [8, 9, 10, 11]).result(10) == [UNAUTHENTICATED] * 4
    assert engine.write(victim_keys, [0, 1, 2, 3]).result(10) == [True] * 4  # the recomputed blocks
    other = open_tier(server.url, host, secret=b"fleet")  # the rest of the fleet
    assert other.read(victim_keys, [12, 13, 14, 15]).result(10) == [OK] * 4
    assert [bytes(host.slot_memory(s)) for s in (12, 13)] == [bytes(host.slot_memory(s)) for s in (0, 1)]


def test_negative_control_an_engine_that_did_not_see_the_refusal_keeps_the_name_blocked(server, host):
    # today's behaviour: a write is SET NX, so the plant stays and every read refuses it
    keys = fresh_keys(2)
    engine = open_tier(server.url, host, secret=b"fleet")
    plant(server, engine, keys)
    assert engine.write(keys, [0, 1]).result(10) == [True, True]
    assert engine.read(keys, [8, 9]).result(10) == [UNAUTHENTICATED] * 2


def test_a_genuine_value_stored_meanwhile_is_never_replaced(server, host):
    keys = fresh_keys(1)
    a = open_tier(server.url, host, secret=b"fleet")
    b = open_tier(server.url, host, secret=b"fleet")
    plant(server, a, keys)
    assert a.read(keys, [8]).result(10) == [UNAUTHENTICATED]
    assert b.read(keys, [9]).result(10) == [UNAUTHENTICATED]
    assert b.write(keys, [1]).result(10) == [True]  # b recomputed first: its value replaces the plant
    b_value = server.client().get(a.names(keys)[0])
    assert a.write(keys, [2]).result(10) == [True]  # slot 2 holds other bytes than slot 1
    assert server.client().get(a.names(keys)[0]) == b_value
    assert a.read(keys, [10]).result(10) == [OK]
    assert bytes(host.slot_memory(10)) == bytes(host.slot_memory(1))


@pytest.mark.parametrize("length", [HEADER_BYTES + SLOT + 1000, HEADER_BYTES + 10])
def test_an_oversized_or_short_value_is_replaced(server, host, length):
    keys = fresh_keys(1)
    engine = open_tier(server.url, host, secret=b"fleet")
    name = engine.names(keys)[0]
    server.client().set(name, b"x" * length)
    assert engine.read(keys, [8]).result(10) == [IO_ERROR if length > HEADER_BYTES + SLOT else CORRUPT]
    assert engine.write(keys, [0]).result(10) == [True]
    assert engine.read(keys, [9]).result(10) == [OK]


def test_the_script_leaves_a_value_of_a_blocks_length_unless_it_is_the_one_refused(server, host):
    engine = open_tier(server.url, host, secret=b"fleet")
    store = engine._client()
    name = engine.names(fresh_keys(1))[0]
    held = b"g" * 64
    server.client().set(name, held)
    assert store.replace([name], [[memoryview(b"n" * 64)]], [hashlib.sha1(b"other").hexdigest()]) == [True]
    assert server.client().get(name) == held
    assert store.replace([name], [[memoryview(b"n" * 64)]], [hashlib.sha1(held).hexdigest()]) == [True]
    assert server.client().get(name) == b"n" * 64


def test_on_a_cluster_a_planted_block_is_replaced_too(host):
    from kvhal.testing.redis_servers import RedisCluster

    with RedisCluster() as cluster:
        keys = fresh_keys(3)  # names over the cluster's slots
        engine = open_tier(cluster.url, host, secret=b"fleet")
        import redis.cluster

        attacker = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
        for name in engine.names(keys):
            attacker.set(name, b"x" * (HEADER_BYTES + SLOT))
        assert engine.read(keys, [8, 9, 10]).result(10) == [CORRUPT] * 3
        assert engine.write(keys, [0, 1, 2]).result(10) == [True] * 3
        assert engine.read(keys, [11, 12, 13]).result(10) == [OK] * 3
        engine.close()
        attacker.close()
