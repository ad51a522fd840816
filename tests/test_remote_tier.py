"""The remote tier over a real Redis server: names, framing, verification, health; the round
trip and another model's or rank's blindness also over a three-master Redis cluster (the
engine-level tests run on one Redis server: tests/e2e/test_vllm_remote_tier.py).

The store is a real ``redis-server`` on loopback; the host tier is the CPU
plugin's. Each test corrupts, poisons or stops what it must to see kvhal
refuse it, beside a control that is served.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvhal.errors import TierError
from kvhal.offload.host_tier import HostTier
from kvhal.testing.redis_servers import RedisCluster, RedisServer
from kvhal.tiers.backend import CORRUPT, FOREIGN, IO_ERROR, MISSING, OK, TierSpec
from kvhal.tiers.remote.format import HEADER_BYTES, UNAUTHENTICATED
from kvhal.tiers.remote.store import StoreUnavailable
from kvhal.tiers.remote.tier import RemoteTier, redact

SLOT = 4096
SLOTS = 16
KV = {"model": "m", "layout": "LBHNC"}


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as running:
        yield running


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster() as running:
        yield running


@pytest.fixture(params=["redis", "redis-cluster"])
def store(request) -> RedisServer | RedisCluster:
    """A Redis server, then a Redis cluster (names hash to every master)."""
    return request.getfixturevalue("server" if request.param == "redis" else "cluster")


@pytest.fixture
def host(cpu) -> Iterator[HostTier]:
    tier = HostTier(cpu, SLOT * SLOTS, SLOT)
    rows = np.frombuffer(tier.memory(), dtype=np.uint8)[: SLOT * SLOTS].reshape(SLOTS, SLOT)
    rows[:] = np.random.default_rng(0).integers(0, 256, rows.shape, dtype=np.uint8)
    yield tier
    tier.close()


def slot_bytes(host: HostTier, slot: int) -> bytes:
    return bytes(host.slot_memory(slot))


def open_tier(
    url: str, host: HostTier | None = None, *, fingerprint=KV, rank=0, world=1, **more
) -> RemoteTier:
    role = "io" if host is not None else "index"
    spec = TierSpec({}, SLOT, fingerprint=fingerprint, role=role, rank=rank, world_size=world)
    return RemoteTier(url, spec, host=host, **more)


def raw_value(store: RedisServer | RedisCluster, name: str) -> bytes | None:
    """The value under ``name`` as the store holds it (on a cluster, from the master its slot
    hashes to: redis-py's cluster client finds it)."""
    if isinstance(store, RedisServer):
        return store.client().get(name)
    import redis.cluster

    client = redis.cluster.RedisCluster(host="127.0.0.1", port=store.ports[0])
    try:
        return client.get(name)
    finally:
        client.close()


def fresh_keys(n: int) -> list[bytes]:
    stamp = time.monotonic_ns().to_bytes(8, "big")
    return [stamp + i.to_bytes(4, "big") for i in range(n)]


def test_blocks_round_trip_between_host_slots_and_the_store(store, host):
    server = store
    tier = open_tier(server.url, host)
    keys = fresh_keys(4)
    assert tier.write(keys, [0, 1, 2, 3]).result(10) == [True] * 4
    expected = [slot_bytes(host, s) for s in range(4)]
    assert tier.read(keys, [8, 9, 10, 11]).result(10) == [OK] * 4
    assert [slot_bytes(host, s) for s in (8, 9, 10, 11)] == expected
    index = open_tier(server.url)
    assert index.exist([*keys, b"never stored"]).result(10) == [True] * 4 + [False]
    stored = raw_value(server, tier.names(keys[:1])[0])
    assert len(stored) == HEADER_BYTES + SLOT and stored[HEADER_BYTES:] == expected[0]
    tier.close()
    index.close()


def test_another_fingerprint_or_rank_sees_nothing(store, host):
    server = store
    keys = fresh_keys(2)
    writer = open_tier(server.url, host)
    assert writer.write(keys, [0, 1]).result(10) == [True, True]
    other_model = open_tier(server.url, host, fingerprint={**KV, "model": "other"})
    assert other_model.read(keys, [4, 5]).result(10) == [MISSING, MISSING]
    assert open_tier(server.url, fingerprint={**KV, "model": "other"}).exist(keys).result(10) == [False] * 2
    # tensor parallelism: a block is there once every rank's share is
    two_ranks = open_tier(server.url, world=2)
    rank0 = open_tier(server.url, host, world=2, rank=0)
    rank1 = open_tier(server.url, host, world=2, rank=1)
    assert rank0.write(keys, [0, 1]).result(10) == [True, True]
    assert two_ranks.exist(keys).result(10) == [False, False]
    assert rank1.write(keys[:1], [2]).result(10) == [True]
    assert two_ranks.exist(keys).result(10) == [True, False]
    assert rank1.read(keys[:1], [6]).result(10) == [OK]
    assert slot_bytes(host, 6) == slot_bytes(host, 2), "rank 1 read rank 0's share"
    for tier in (writer, other_model, two_ranks, rank0, rank1):
        tier.close()


def test_a_flipped_byte_or_a_value_under_another_name_is_refused(server, host):
    tier = open_tier(server.url, host)
    keys = fresh_keys(3)
    assert tier.write(keys, [0, 1, 2]).result(10) == [True] * 3
    client = server.client()
    a, b, c = tier.names(keys)
    value = client.get(a)
    flipped = bytearray(value)
    flipped[HEADER_BYTES + 100] ^= 0x01
    client.set(a, bytes(flipped))
    client.set(b, client.get(c))  # c's valid value, stored under b's name
    assert tier.read(keys, [8, 9, 10]).result(10) == [CORRUPT, FOREIGN, OK]
    client.set(a, value[:-1])  # truncated
    assert tier.read(keys[:1], [8]).result(10) == [CORRUPT]
    tier.close()


def test_with_a_secret_unauthenticated_values_are_refused(server, host):
    keys = fresh_keys(2)
    plain = open_tier(server.url, host)
    assert plain.write(keys[:1], [0]).result(10) == [True]
    signed = open_tier(server.url, host, secret=b"fleet")
    assert signed.write(keys[1:], [1]).result(10) == [True]
    assert signed.read(keys, [8, 9]).result(10) == [UNAUTHENTICATED, OK]
    assert slot_bytes(host, 9) == slot_bytes(host, 1)
    other_secret = open_tier(server.url, host, secret=b"another")
    assert other_secret.read(keys[1:], [10]).result(10) == [UNAUTHENTICATED]
    for tier in (plain, signed, other_secret):
        tier.close()


def test_a_store_that_goes_down_fails_fast_and_comes_back(server, host):
    changes: list[tuple[bool, str]] = []
    tier = open_tier(server.url, host, on_health=lambda up, why: changes.append((up, why)))
    index = open_tier(server.url)
    keys = fresh_keys(2)
    assert tier.write(keys, [0, 1]).result(10) == [True, True]
    assert changes == [(True, "connected")]
    server.stop()
    try:
        with pytest.raises(StoreUnavailable):
            index.exist(keys).result(10)
        assert tier.read(keys, [8, 9]).result(10) == [IO_ERROR, IO_ERROR]
        assert tier.write(fresh_keys(1), [2]).result(10) == [False]
        assert not tier.up and [up for up, _ in changes] == [True, False], changes
    finally:
        server.start()
    # the first call may meet a dead connection; a later one is served
    deadline = time.monotonic() + 10
    while tier.write(keys, [0, 1]).result(10) != [True, True]:
        assert time.monotonic() < deadline, "the tier never came back"
        time.sleep(0.2)
    assert tier.up and [up for up, _ in changes] == [True, False, True], changes
    assert tier.read(keys, [8, 9]).result(10) == [OK, OK]
    tier.close()
    index.close()


def test_unreachable_at_start_is_a_down_tier_or_with_strict_an_error(host):
    server = RedisServer(start=False)
    try:
        with pytest.raises(TierError, match="remote_strict"):
            open_tier(server.url, host, strict=True)
        changes: list[bool] = []
        tier = open_tier(server.url, host, on_health=lambda up, why: changes.append(up), retry_seconds=0.1)
        assert changes == [False] and not tier.up
        assert tier.write(fresh_keys(1), [0]).result(10) == [False]
        server.start()
        deadline = time.monotonic() + 10
        keys = fresh_keys(1)
        while tier.write(keys, [0]).result(10) != [True]:
            assert time.monotonic() < deadline, "the tier never connected"
            time.sleep(0.2)
        assert changes == [False, True]
        tier.close()
    finally:
        server.close()


def test_urls_are_redacted_in_messages():
    assert redact("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"
    assert redact("rediss://:pw@h:1") == "rediss://:***@h:1"


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("redis://u:p@ss@h:1/0", "redis://u:***@h:1/0"),  # an unencoded "@" in the password
        ("redis://u:p/ss@h:1/0", "redis://u:***@h:1/0"),  # a "/" in it
        ("redis://u:p%40ss@h:1", "redis://u:***@h:1"),
        ("redis://:a:b:c@h", "redis://:***@h"),
        ("rediss+cluster://u:pw@h:7000", "rediss+cluster://u:***@h:7000"),
        ("unix://:pw@/run/redis.sock?db=1", "unix://:***@/run/redis.sock?db=1"),
        ("redis://h:1/0?password=x&ttl=5", "redis://h:1/0?password=***&ttl=5"),
        ("redis://h/0?AUTH_TOKEN=x", "redis://h/0?AUTH_TOKEN=***"),
        (
            "mooncake://h:50051?metadata=http://a:b@m:8080/metadata&protocol=tcp",
            "mooncake://h:50051?metadata=http://a:***@m:8080/metadata&protocol=tcp",
        ),
        ("redis://h/0#pw", "redis://h/0#***"),
        ("redis://user@h:1/0", "redis://user@h:1/0"),  # a user alone is no secret
    ],
)
def test_every_url_form_is_redacted(url, redacted):
    assert redact(url) == redacted
    for secret in ("pw", "p@ss", "p/ss", "p%40ss", ":b:c", "x", "a:b"):
        if secret not in redacted:
            continue
        assert f":{secret}@" not in redacted and f"={secret}" not in redacted
