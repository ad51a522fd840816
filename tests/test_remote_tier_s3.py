"""The remote tier over a real SeaweedFS S3 gateway: names, framing, verification, refused
objects replaced by the genuine values, and an object store's faults, each ending in a miss
(the engine recomputes) and never in wrong bytes, a hang or a crash.

The server is the session's SeaweedFS (``seaweedfs`` in tests/conftest.py); stalls, 503
``SlowDown`` and a server dying mid-response go through loopback TCP proxies in front of it
(:mod:`kvhal.testing.tcp_proxy`). Each test writes under a prefix of its own. About 25 s here,
most of it the one restart of the server (4 s) and the deadlines the faults wait out.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvhal.errors import TierError
from kvhal.offload.host_tier import HostTier
from kvhal.testing.seaweedfs_servers import SeaweedS3
from kvhal.testing.tcp_proxy import TcpProxy
from kvhal.tiers.backend import CORRUPT, FOREIGN, IO_ERROR, MISSING, OK, TierSpec
from kvhal.tiers.remote.format import HEADER_BYTES, UNAUTHENTICATED
from kvhal.tiers.remote.store import StoreUnavailable
from kvhal.tiers.remote.tier import RemoteTier
from tests.test_store_s3 import use_credentials

obstore = pytest.importorskip("obstore")

SLOT = 4096
SLOTS = 16
KV = {"model": "m", "layout": "LBHNC"}
SECRET = b"fleet secret"
#: a stalled or throttled request gives up after 0.5 s, tried twice: the tests' deadlines
FAST = {"timeout": 0.5, "retries": 1}


@pytest.fixture(autouse=True)
def _credentials(monkeypatch: pytest.MonkeyPatch, seaweedfs: SeaweedS3) -> None:
    use_credentials(monkeypatch, seaweedfs.credentials)


@pytest.fixture
def host(cpu) -> Iterator[HostTier]:
    tier = HostTier(cpu, SLOT * SLOTS, SLOT)
    rows = np.frombuffer(tier.memory(), dtype=np.uint8)[: SLOT * SLOTS].reshape(SLOTS, SLOT)
    rows[:] = np.random.default_rng(0).integers(0, 256, rows.shape, dtype=np.uint8)
    yield tier
    tier.close()


@pytest.fixture
def url(seaweedfs: SeaweedS3) -> str:
    """A prefix of this test's own."""
    return seaweedfs.url(prefix=f"tier-{uuid.uuid4().hex[:8]}")


def open_tier(
    url: str, host: HostTier | None = None, *, fingerprint=KV, rank=0, world=1, **more
) -> RemoteTier:
    role = "io" if host is not None else "index"
    spec = TierSpec({}, SLOT, fingerprint=fingerprint, role=role, rank=rank, world_size=world)
    return RemoteTier(url, spec, host=host, **more)


def fresh_keys(n: int) -> list[bytes]:
    stamp = time.monotonic_ns().to_bytes(8, "big")
    return [stamp + i.to_bytes(4, "big") for i in range(n)]


def slot_bytes(host: HostTier, slot: int) -> bytes:
    return bytes(host.slot_memory(slot))


def key_of(tier: RemoteTier, key: bytes) -> str:
    """The object key of ``key``'s value in the bucket (the URL's prefix, then its name)."""
    return f"{tier.url.split('?')[0].split('/', 3)[3]}/{tier.names([key])[0]}"


def until(what: str, done: Callable[[], bool], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_blocks_round_trip_between_host_slots_and_objects(seaweedfs, url, host):
    tier = open_tier(url, host, secret=SECRET)
    keys = fresh_keys(4)
    assert tier.write(keys, [0, 1, 2, 3]).result(10) == [True] * 4
    expected = [slot_bytes(host, s) for s in range(4)]
    assert tier.read(keys, [8, 9, 10, 11]).result(10) == [OK] * 4
    assert [slot_bytes(host, s) for s in (8, 9, 10, 11)] == expected
    index = open_tier(url)
    assert index.exist([*keys, b"never stored"]).result(10) == [True] * 4 + [False]
    stored = bytes(obstore.get(seaweedfs.objects(), key_of(tier, keys[0])).bytes())
    assert len(stored) == HEADER_BYTES + SLOT and stored[HEADER_BYTES:] == expected[0]
    for t in (tier, index):
        t.close()


def test_another_fingerprint_rank_or_secret_gets_nothing(url, host):
    keys = fresh_keys(2)
    writer = open_tier(url, host, secret=SECRET)
    assert writer.write(keys, [0, 1]).result(10) == [True, True]
    other_model = open_tier(url, host, fingerprint={**KV, "model": "other"}, secret=SECRET)
    assert other_model.read(keys, [4, 5]).result(10) == [MISSING, MISSING]
    assert open_tier(url, fingerprint={**KV, "model": "other"}).exist(keys).result(10) == [False] * 2
    rank1 = open_tier(url, host, world=2, rank=1, secret=SECRET)
    assert rank1.read(keys, [6, 7]).result(10) == [MISSING, MISSING], "another rank's namespace"
    other_secret = open_tier(url, host, secret=b"another secret")
    assert other_secret.read(keys, [8, 9]).result(10) == [UNAUTHENTICATED] * 2
    for t in (writer, other_model, rank1, other_secret):
        t.close()


def test_forged_truncated_replayed_and_foreign_objects_are_refused_then_replaced(seaweedfs, url, host):
    """Objects planted under a fleet's names (a flipped byte, a truncation, another name's
    value, a value signed with another secret) are refused by kind; the engine's recomputed
    blocks are written over them (If-Match on what was refused), and read back verified."""
    tier = open_tier(url, host, secret=SECRET)
    keys = fresh_keys(5)
    forged, truncated, replayed, foreign, untouched = keys
    assert tier.write(keys, [0, 1, 2, 3, 4]).result(10) == [True] * 5
    objects = seaweedfs.objects()

    def value(key: bytes) -> bytes:
        return bytes(obstore.get(objects, key_of(tier, key)).bytes())

    flipped = bytearray(value(forged))
    flipped[HEADER_BYTES + 100] ^= 0x01
    obstore.put(objects, key_of(tier, forged), bytes(flipped))
    obstore.put(objects, key_of(tier, truncated), value(truncated)[:-1])
    obstore.put(objects, key_of(tier, replayed), value(untouched))
    obstore.delete(objects, key_of(tier, foreign))
    stranger = open_tier(url, host, secret=b"a stranger's secret")
    assert stranger.write([foreign], [3]).result(10) == [True]
    slots = [8, 9, 10, 11, 12]
    assert tier.read(keys, slots).result(10) == [CORRUPT, CORRUPT, FOREIGN, UNAUTHENTICATED, OK]

    # negative control: an engine that did not see the refusals only creates, so the plants stay
    bystander = open_tier(url, host, secret=SECRET)
    assert bystander.write(keys[:4], [0, 1, 2, 3]).result(10) == [True] * 4
    assert bystander.read(keys[:4], slots[:4]).result(10) == [CORRUPT, CORRUPT, FOREIGN, UNAUTHENTICATED]

    assert tier.write(keys[:4], [0, 1, 2, 3]).result(10) == [True] * 4, "the recomputed blocks"
    assert tier.read(keys, slots).result(10) == [OK] * 5
    assert [slot_bytes(host, s) for s in slots] == [slot_bytes(host, s) for s in range(5)]
    for t in (tier, stranger, bystander):
        t.close()


def test_a_lookup_asks_a_few_names_of_its_run_and_answers_the_held_prefix(url, host):
    """An object store's HEAD is a request per name: a lookup's run of 20 blocks, the first 14
    stored, is answered from a few HEADs as its held prefix (kvhal.tiers.remote.run_search)."""
    keys = fresh_keys(20)
    writer = open_tier(url, host)
    assert writer.write(keys[:14], list(range(14))).result(10) == [True] * 14
    index = open_tier(url)
    assert index._store is not None and index._store.sparse_exist
    asked: list[int] = []
    exist = index._store.exist
    index._store.exist = lambda names: asked.append(len(names)) or exist(names)  # type: ignore[method-assign]
    assert index.expected_lookup_s is None
    assert index.exist_run(keys).result(10) == [True] * 14 + [False] * 6
    assert sum(asked) < 20 and len(asked) <= 2, asked
    assert index.expected_lookup_s is not None and index.expected_lookup_s < 10
    assert index.exist(keys).result(10) == [True] * 14 + [False] * 6, "exist still asks each name"
    for t in (writer, index):
        t.close()


def test_an_object_deleted_after_exist_said_yes_is_a_miss(seaweedfs, url, host):
    """What a lifecycle rule's expiry does between a lookup and its read."""
    tier, index = open_tier(url, host, secret=SECRET), open_tier(url)
    keys = fresh_keys(2)
    assert tier.write(keys, [0, 1]).result(10) == [True, True]
    assert index.exist(keys).result(10) == [True, True]
    obstore.delete(seaweedfs.objects(), key_of(tier, keys[0]))
    assert tier.read(keys, [8, 9]).result(10) == [MISSING, OK]
    assert tier.up and index.exist(keys).result(10) == [False, True]
    for t in (tier, index):
        t.close()


def through(seaweedfs: SeaweedS3, proxy: TcpProxy, prefix: str) -> str:
    return seaweedfs.url(prefix=prefix, endpoint=f"http://127.0.0.1:{proxy.port}", **FAST)


@pytest.mark.parametrize("fault", ["stall", "slowdown"])
def test_a_stalled_or_throttled_server_costs_a_miss_within_the_deadline_then_comes_back(
    seaweedfs, host, fault
):
    changes: list[bool] = []
    with TcpProxy(seaweedfs.port) as proxy:
        url = through(seaweedfs, proxy, f"fault-{uuid.uuid4().hex[:8]}")
        tier = open_tier(url, host, secret=SECRET, on_health=lambda up, why: changes.append(up))
        index = open_tier(url)
        keys = fresh_keys(2)
        assert tier.write(keys, [0, 1]).result(10) == [True, True]
        proxy.set_mode(fault)
        started = time.monotonic()
        assert tier.read(keys, [8, 9]).result(30) == [IO_ERROR, IO_ERROR]
        read_requests = proxy.requests
        with pytest.raises(StoreUnavailable):
            index.exist(keys).result(30)
        exist_requests = proxy.requests - read_requests
        assert tier.write(fresh_keys(1), [2]).result(30) == [False]
        write_requests = proxy.requests - read_requests - exist_requests
        # each call: two tries of 0.5 s and a backoff, twice where the tier was up (it tries a
        # call once more: a stale connection's failure); the store's bound, x (retries + 2) + 1 s
        # and 2 s, is the most any may take
        assert time.monotonic() - started < 3 * 2 * (0.5 * 3 + 1.0 + 2.0)
        assert not tier.up and changes == [True, False]
        if fault == "slowdown":  # every request answered 503 at once, and tried retries + 1 times
            assert (read_requests, exist_requests, write_requests) == (2 * 2 * 2, 2 * 2 * 2, 1 * 2)
        proxy.set_mode("pass")
        until("the tier never came back", lambda: tier.write(keys, [0, 1]).result(10) == [True, True])
        assert tier.read(keys, [8, 9]).result(10) == [OK, OK] and changes == [True, False, True]
        for t in (tier, index):
            t.close()


def test_the_server_stopped_mid_read_and_mid_write_then_restarted(seaweedfs, host):
    """A read whose response is half delivered and a write whose answer is not yet back when
    the server dies: both fail (a miss, a dropped write), the tier is down, and it is up
    again once the server is back; what the interrupted write left is absent or whole."""
    prefix = f"restart-{uuid.uuid4().hex[:8]}"
    with TcpProxy(seaweedfs.port) as reads, TcpProxy(seaweedfs.port) as writes:
        reader = open_tier(through(seaweedfs, reads, prefix), host, secret=SECRET)
        writer = open_tier(through(seaweedfs, writes, prefix), host, secret=SECRET)
        old, new = fresh_keys(2), fresh_keys(1)
        assert writer.write(old, [0, 1]).result(10) == [True, True]
        reads.set_mode("hold", after=1000)  # the headers and some of the value pass
        writes.set_mode("hold", after=0)  # the request reaches the server, no answer comes back
        reading = reader.read(old, [8, 9])
        writing = writer.write(new, [2])
        until(
            "the calls never reached the server", lambda: reads.holding.is_set() and writes.holding.is_set()
        )
        seaweedfs.stop()
        try:
            assert reading.result(30) == [IO_ERROR, IO_ERROR]
            assert writing.result(30) == [False]
            assert not reader.up and not writer.up
        finally:
            seaweedfs.start()
        reads.set_mode("pass")
        writes.set_mode("pass")
        until("the writer never came back", lambda: writer.write(old, [0, 1]).result(10) == [True, True])
        until("the reader never came back", lambda: reader.read(old, [8, 9]).result(10) == [OK, OK])
        assert [slot_bytes(host, s) for s in (8, 9)] == [slot_bytes(host, s) for s in (0, 1)]
        assert reader.read(new, [10]).result(10) in ([OK], [MISSING])
        for t in (reader, writer):
            t.close()


def test_wrong_credentials_start_a_tier_down_or_with_strict_refuse_it(seaweedfs, url, host, monkeypatch):
    right = seaweedfs.credentials
    use_credentials(monkeypatch, {**right, "AWS_SECRET_ACCESS_KEY": "not the secret"})
    with pytest.raises(TierError, match=r"SignatureDoesNotMatch.*remote_strict"):
        open_tier(url, host, strict=True)
    changes: list[tuple[bool, str]] = []
    tier = open_tier(url, host, secret=SECRET, retry_seconds=0.1, on_health=lambda *c: changes.append(c))
    assert [up for up, _ in changes] == [False] and "SignatureDoesNotMatch" in changes[0][1]
    assert "not the secret" not in changes[0][1]
    keys = fresh_keys(1)
    assert tier.write(keys, [0]).result(10) == [False]
    assert tier.read(keys, [8]).result(10) == [IO_ERROR]
    use_credentials(monkeypatch, right)  # (a rotated key, say): read again at the next connect
    until("the tier never connected", lambda: tier.write(keys, [0]).result(10) == [True])
    assert tier.read(keys, [8]).result(10) == [OK] and [up for up, _ in changes] == [False, True]
    tier.close()


def test_a_bucket_that_does_not_exist_starts_the_tier_down_until_it_is_created(seaweedfs, host):
    bucket = f"kvhal-later-{uuid.uuid4().hex[:6]}"
    url = seaweedfs.url(bucket=bucket)
    with pytest.raises(TierError, match="the bucket does not exist"):
        open_tier(url, host, strict=True)
    changes: list[tuple[bool, str]] = []
    tier = open_tier(url, host, secret=SECRET, retry_seconds=0.1, on_health=lambda *c: changes.append(c))
    assert [up for up, _ in changes] == [False] and "bucket does not exist" in changes[0][1]
    keys = fresh_keys(1)
    assert tier.write(keys, [0]).result(10) == [False]
    seaweedfs.create_bucket(bucket)
    try:
        until("the tier never connected", lambda: tier.write(keys, [0]).result(10) == [True])
        assert tier.read(keys, [8]).result(10) == [OK]
    finally:
        tier.close()
        seaweedfs.delete_bucket(bucket)
