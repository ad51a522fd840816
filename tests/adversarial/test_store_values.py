"""Store values replayed, spliced or planted where they do not belong: never served.

A fleet's genuine, signed values are copied by someone who can write to the store but has no
secret: under another block's name, another rank's, another model's; values left from before
the fleet changed its secret; one value's header on another's payload. Each read runs beside
its control in the same call: a genuine value under its own name, served. The store is a real
``redis-server`` on loopback, the host tier the CPU plugin's.
"""

from __future__ import annotations

from collections.abc import Callable

import crc32c
import pytest

from kvhal.offload.host_tier import HostTier
from kvhal.testing.redis_servers import RedisServer
from kvhal.tiers.backend import CORRUPT, FOREIGN, OK
from kvhal.tiers.remote.format import HEADER_BYTES, UNAUTHENTICATED
from kvhal.tiers.remote.tier import RemoteTier
from tests.test_remote_tier import KV, fresh_keys, open_tier, slot_bytes

SECRET = b"the fleet's secret"
#: the attacked block A is written from slot 0, its control C from slot 1; both read into 8, 9
A_SLOT, C_SLOT, A_READ, C_READ = 0, 1, 8, 9


def fleet_tier(url: str, host: HostTier, **more) -> RemoteTier:
    """A fleet member: rank 0 of 2, model ``KV``, the fleet's secret (``more`` changes that)."""
    return open_tier(url, host, **({"world": 2, "rank": 0, "secret": SECRET} | more))


def written_by(server: RedisServer, host: HostTier, key: bytes, **who) -> bytes:
    """The value ``key`` has when a writer configured as ``who`` stores it from slot 2."""
    tier = fleet_tier(server.url, host, **who)
    try:
        name = tier.names([key])[0]
        server.client().delete(name)  # writes never replace a value: this one's is wanted
        assert tier.write([key], [2]).result(10) == [True]
        return server.client().get(name)
    finally:
        tier.close()


#: case -> (what is planted under A's name, given the server, host, A's and another key, and
#: the victim; the outcome A must read)
Plant = Callable[[RedisServer, HostTier, bytes, bytes, RemoteTier], bytes]
CASES: dict[str, tuple[Plant, str]] = {
    # a genuine value of block B, under A's name
    "another block's value": (lambda s, h, a, b, v: s.client().get(v.names([b])[0]), FOREIGN),
    # rank 1's genuine share of A, under rank 0's name for A
    "another rank's value": (lambda s, h, a, b, v: written_by(s, h, a, rank=1), FOREIGN),
    # another model of the same geometry, its genuine A
    "another model's value": (
        lambda s, h, a, b, v: written_by(s, h, a, fingerprint={**KV, "model": "other"}),
        FOREIGN,
    ),
    # the fleet's own A, written before the secret was changed
    "a value signed with an old secret": (
        lambda s, h, a, b, v: written_by(s, h, a, secret=b"last year's secret"),
        UNAUTHENTICATED,
    ),
    # A written by a member without the secret (a forger, or a misconfigured engine)
    "an unsigned value": (lambda s, h, a, b, v: written_by(s, h, a, secret=None), UNAUTHENTICATED),
    # A's genuine header before B's genuine payload
    "a header spliced onto another payload": (
        lambda s, h, a, b, v: spliced(s, v, a, b, fix_crc=False),
        CORRUPT,
    ),
    # the same, its crc32c made to match (anyone can): only the MAC tells
    "a spliced value with its checksum fixed": (
        lambda s, h, a, b, v: spliced(s, v, a, b, fix_crc=True),
        UNAUTHENTICATED,
    ),
}


def spliced(server: RedisServer, victim: RemoteTier, a: bytes, b: bytes, *, fix_crc: bool) -> bytes:
    """A's genuine header before B's genuine payload, the header's crc32c of B's payload if
    ``fix_crc`` (the header: magic, version, flags, length, then the crc32c at byte 24)."""
    header = bytearray(server.client().get(victim.names([a])[0])[:HEADER_BYTES])
    payload = server.client().get(victim.names([b])[0])[HEADER_BYTES:]
    if fix_crc:
        header[24:28] = crc32c.crc32c(payload).to_bytes(4, "little")
    return bytes(header) + payload


@pytest.mark.parametrize("case", CASES)
def test_a_replayed_or_spliced_value_is_never_served(server, host, case):
    plant, outcome = CASES[case]
    victim = fleet_tier(server.url, host)
    try:
        a, b, c = fresh_keys(3)
        assert victim.write([a, b, c], [A_SLOT, 3, C_SLOT]).result(10) == [True] * 3
        assert victim.read([a], [A_READ]).result(10) == [OK], "before the attack, A is served"
        name = victim.names([a])[0]
        genuine = server.client().get(name)
        planted = plant(server, host, a, b, victim)
        assert planted != genuine, "the attack changes what A's name holds"
        server.client().set(name, planted)
        assert victim.read([a, c], [A_READ, C_READ]).result(10) == [outcome, OK]
        assert slot_bytes(host, C_READ) == slot_bytes(host, C_SLOT), "the control C is served"
    finally:
        victim.close()


def test_a_genuine_value_replayed_under_its_own_name_is_the_same_block(server, host):
    """What a replay cannot change: a name is the block's model, rank and tokens, so the value
    it held before is the same KV. Replaying it is served, and serves that KV."""
    victim = fleet_tier(server.url, host)
    try:
        (a,) = fresh_keys(1)
        assert victim.write([a], [A_SLOT]).result(10) == [True]
        name = victim.names([a])[0]
        recorded = server.client().get(name)
        server.client().delete(name)
        server.client().set(name, recorded)
        assert victim.read([a], [A_READ]).result(10) == [OK]
        assert slot_bytes(host, A_READ) == slot_bytes(host, A_SLOT)
    finally:
        victim.close()
