"""The built-in Mooncake store (kvhal.tiers.stores.mooncake) against a real master and store node."""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvhal.errors import ValidationError
from kvhal.registry import PluginRegistry
from kvhal.testing.mooncake_servers import MooncakeCluster, free_port
from kvhal.tiers.media import open_store
from kvhal.tiers.remote.store import ABSENT, FAILED, StoreUnavailable
from kvhal.tiers.stores import mooncake as mooncake_store
from kvhal.tiers.stores import mooncake_staging
from kvhal.tiers.stores.mooncake import MooncakeStore
from kvhal.tiers.stores.mooncake_url import parse_url

pytest.importorskip("mooncake.store", reason="Mooncake's client is not installed")
if not MooncakeCluster.available():
    pytest.skip(str(MooncakeCluster.missing()), allow_module_level=True)

HEADER = 96
PAYLOAD = 64 << 10
VALUE = HEADER + PAYLOAD
COUNT = 6
_names = itertools.count()


def fresh(prefix: str, n: int = COUNT) -> list[str]:
    """Names no earlier test used (the store is shared by the module)."""
    run = f"{os.getpid()}-{next(_names)}"
    return [f"kvhal-test/{prefix}/{run}/{i}" for i in range(n)]


def noise(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def values_of(rows: np.ndarray) -> list[list[memoryview]]:
    """Each row as a value of two parts: a 96-byte header and a 64 KiB payload."""
    return [[memoryview(row[:HEADER]), memoryview(row[HEADER:])] for row in rows]


@pytest.fixture(scope="module")
def cluster():
    with MooncakeCluster() as running:
        yield running


@pytest.fixture(scope="module")
def store(cluster):
    client = open_store(cluster.url, PluginRegistry())
    yield client
    client.close()


@pytest.fixture(scope="module")
def registered(store):
    """Two mmap'd areas registered with the store: a source and a destination of COUNT values each."""
    maps = [mmap.mmap(-1, COUNT * VALUE) for _ in range(2)]
    src, dst = (np.frombuffer(m, dtype=np.uint8).reshape(COUNT, VALUE) for m in maps)
    for area in (src, dst):
        store.register(memoryview(area.reshape(-1)))
    yield src, dst
    # the maps go with their last views; the store, closed right after, makes no call in between


# -- round trips ------------------------------------------------------------------------


class SliceSpy:
    """The store's Mooncake client, recording the slice sizes of every put and get."""

    def __init__(self, client) -> None:
        self.client, self.sizes = client, []

    def __getattr__(self, name):
        return getattr(self.client, name)

    def batch_put_from_multi_buffers(self, names, ptrs, sizes, config):
        self.sizes.append(sizes)
        return self.client.batch_put_from_multi_buffers(names, ptrs, sizes, config)

    def batch_get_into_multi_buffers(self, names, ptrs, sizes):
        self.sizes.append(sizes)
        return self.client.batch_get_into_multi_buffers(names, ptrs, sizes)


@pytest.mark.parametrize("coalesce", [VALUE, VALUE - 1])
def test_a_small_value_of_two_parts_moves_as_one_slice(store, registered, monkeypatch, coalesce):
    """Up to COALESCE_BYTES, header and block are staged into one slice (a slice costs Mooncake's
    TCP transport about as much as a small block); above it, each part moves from where it lies."""
    monkeypatch.setattr(mooncake_staging, "COALESCE_BYTES", coalesce)
    spy = SliceSpy(store._client)
    monkeypatch.setattr(store, "_client", spy)
    src, dst = registered
    src[:] = noise(src.size, 11).reshape(src.shape)
    dst[:] = 0
    names = fresh("coalesced")
    assert store.put(names, values_of(src)) == [True] * COUNT
    assert store.get(names, values_of(dst)) == [VALUE] * COUNT
    assert np.array_equal(dst, src)
    slices = [[VALUE]] if coalesce >= VALUE else [[HEADER, PAYLOAD]]
    assert spy.sizes == [slices * COUNT] * 2


def test_round_trip_from_and_into_registered_memory(store, registered, monkeypatch):
    monkeypatch.setattr(mooncake_staging, "COALESCE_BYTES", 0)  # every part where it lies
    staged = []
    monkeypatch.setattr(store, "_take_staging", lambda size: staged.append(size))
    src, dst = registered
    src[:] = noise(src.size, 1).reshape(src.shape)
    dst[:] = 0
    names = fresh("registered")
    assert store.put(names, values_of(src)) == [True] * COUNT
    assert store.get(names, values_of(dst)) == [VALUE] * COUNT
    assert np.array_equal(dst, src)
    # zero-copy: nothing went through a staging area
    assert staged == []


def test_round_trip_from_and_into_unregistered_memory(store):
    rows = noise(COUNT * VALUE, 2).reshape(COUNT, VALUE)
    values = [[memoryview(row[:HEADER].tobytes()), memoryview(row[HEADER:].tobytes())] for row in rows]
    out = [bytearray(VALUE) for _ in range(COUNT)]
    buffers = [[memoryview(b)[:HEADER], memoryview(b)[HEADER:]] for b in out]
    names = fresh("unregistered")
    assert store.put(names, values) == [True] * COUNT  # read-only bytes objects
    assert store.get(names, buffers) == [VALUE] * COUNT
    assert [bytes(b) for b in out] == [row.tobytes() for row in rows]


def test_parts_mixing_registered_and_unregistered_memory(store, registered):
    src, dst = registered
    src[:] = noise(src.size, 3).reshape(src.shape)
    payloads = [noise(PAYLOAD, 30 + i) for i in range(COUNT)]
    names = fresh("mixed")
    values = [[memoryview(src[i, :HEADER]), memoryview(payloads[i])] for i in range(COUNT)]
    assert store.put(names, values) == [True] * COUNT
    dst[:] = 0
    landing = [np.zeros(HEADER, dtype=np.uint8) for _ in range(COUNT)]
    buffers = [[memoryview(landing[i]), memoryview(dst[i, HEADER:])] for i in range(COUNT)]
    assert store.get(names, buffers) == [VALUE] * COUNT
    for i in range(COUNT):
        assert np.array_equal(landing[i], src[i, :HEADER])
        assert np.array_equal(dst[i, HEADER:], payloads[i])


def test_one_changed_byte_reads_back_changed_there_only(store, registered):
    """Negative control: the round trip would notice a difference of one byte."""
    src, dst = registered
    src[:] = noise(src.size, 4).reshape(src.shape)
    first, second = fresh("control", 1), fresh("control", 1)
    assert store.put(first, values_of(src[:1])) == [True]
    src[0, HEADER + 12345] ^= 0x5A
    assert store.put(second, values_of(src[:1])) == [True]
    dst[:2] = 0
    assert store.get(first + second, values_of(dst[:2])) == [VALUE, VALUE]
    differ = np.flatnonzero(dst[0] != dst[1])
    assert differ.tolist() == [HEADER + 12345]
    assert np.array_equal(dst[1], src[0])


# -- names ------------------------------------------------------------------------------


def test_exist_and_absent(store):
    held, unknown = fresh("exist", 2), fresh("never-put", 2)
    assert store.put(held, [[memoryview(b"v" * 100)]] * 2) == [True, True]
    assert store.exist([held[0], unknown[0], held[1], unknown[1]]) == [True, False, True, False]
    assert store.exist([]) == []
    out = [bytearray(100) for _ in range(3)]
    sizes = store.get([unknown[0], held[1], unknown[1]], [[memoryview(b)] for b in out])
    assert sizes == [ABSENT, 100, ABSENT]
    assert bytes(out[1]) == b"v" * 100


def test_an_existing_name_is_never_replaced(store):
    (name,) = fresh("first-wins", 1)
    assert store.put([name], [[memoryview(b"old" * 100)]]) == [True]
    assert store.put([name], [[memoryview(b"new" * 100)]]) == [True]
    assert store.put([name], [[memoryview(b"much longer" * 100)]]) == [True]
    out = bytearray(300)
    assert store.get([name], [[memoryview(out)]]) == [300]
    assert bytes(out) == b"old" * 100


@pytest.mark.parametrize("where", ["registered", "unregistered"])
def test_a_value_larger_than_its_buffers_fails_and_writes_nothing(store, registered, where):
    src, dst = registered
    src[0] = noise(VALUE, 5)
    (name,) = fresh("too-large", 1)
    assert store.put([name], values_of(src[:1])) == [True]
    guard = 4096
    area = dst[0] if where == "registered" else np.zeros(VALUE, dtype=np.uint8)
    area[:] = 0xEE
    short = VALUE - guard  # the buffers stop `guard` bytes before the value's end
    buffers = [[memoryview(area[:HEADER]), memoryview(area[HEADER:short])]]
    assert store.get([name], buffers) == [FAILED]
    assert (area[short:] == 0xEE).all(), "a byte after the buffers was written"


@pytest.mark.parametrize("where", ["registered", "unregistered"])
def test_a_value_shorter_than_its_buffers_fills_their_first_bytes(store, registered, where):
    (name,) = fresh("shorter", 1)
    value = noise(HEADER + 1000, 6)
    assert store.put([name], [[memoryview(value)]]) == [True]
    area = registered[1][0] if where == "registered" else np.zeros(VALUE, dtype=np.uint8)
    area[:] = 0xEE
    buffers = [[memoryview(area[:HEADER]), memoryview(area[HEADER:])]]
    assert store.get([name], buffers) == [HEADER + 1000]
    assert np.array_equal(area[: HEADER + 1000], value)
    assert (area[HEADER + 1000 :] == 0xEE).all()


def test_threads_share_one_client(store, registered):
    assert store.concurrency > 1
    src, _ = registered
    src[:] = noise(src.size, 7).reshape(src.shape)
    errors: list[str] = []

    def work(thread: int) -> None:
        for round_ in range(8):
            names = fresh(f"thread{thread}-{round_}", COUNT)
            unregistered = thread % 2 == 1
            values = values_of(src.copy() if unregistered else src)
            if store.put(names, values) != [True] * COUNT:
                errors.append(f"put {thread}/{round_}")
            if store.exist(names) != [True] * COUNT:
                errors.append(f"exist {thread}/{round_}")
            out = np.zeros_like(src)
            if store.get(names, values_of(out)) != [VALUE] * COUNT or not np.array_equal(out, src):
                errors.append(f"get {thread}/{round_}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(store.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []


def test_registering_again_or_overlapping_memory_is_harmless(cluster, caplog):
    # its own client: registered memory must outlive the client, and this area is the test's
    store = MooncakeStore.from_url(cluster.url)
    try:
        area = np.zeros(3 * 4096, dtype=np.uint8)
        store.register(memoryview(area[:8192]))
        store.register(memoryview(area[:8192]))  # already registered: nothing to do
        store.register(memoryview(area[4096:8192]))  # inside a registered range
        with caplog.at_level("WARNING", logger="kvhal.tiers.stores.mooncake"):
            store.register(memoryview(area[4096:]))  # overlaps: Mooncake refuses it, parts get staged
        assert "copied through a staging area" in caplog.text
        area[:] = noise(area.size, 8)
        (name,) = fresh("overlap", 1)
        assert store.put([name], [[memoryview(area[2048:10240])]]) == [True]
        out = np.zeros(8192, dtype=np.uint8)
        assert store.get([name], [[memoryview(out)]]) == [8192]
        assert np.array_equal(out, area[2048:10240])
    finally:
        store.close()


def test_a_client_contributing_memory(cluster):
    """segment=: this client's memory holds values too (they may land there: a local copy)."""
    client = MooncakeStore.from_url(cluster.url.replace("segment=0", "segment=32MB"))
    try:
        assert client.options.segment == 32 << 20
        rows = noise(COUNT * VALUE, 9).reshape(COUNT, VALUE)
        names = fresh("contributing")
        assert client.put(names, values_of(rows)) == [True] * COUNT
        out = np.zeros_like(rows)
        assert client.get(names, values_of(out)) == [VALUE] * COUNT
        assert np.array_equal(out, rows)
    finally:
        client.close()


# -- URLs and connecting ----------------------------------------------------------------

META = "metadata=http://127.0.0.1:8080/metadata"


@pytest.mark.parametrize(
    ("url", "names"),
    [
        ("mooncake://127.0.0.1:50051", "metadata"),
        ("mooncake://127.0.0.1:50051?metadata=", "metadata"),
        ("mooncake://127.0.0.1:50051?metadata=ftp://h:1/metadata", "metadata"),
        ("mooncake://127.0.0.1:50051?metadata=http://h:99999/metadata", "metadata"),
        (f"mooncake://127.0.0.1:port?{META}", "port"),
        (f"mooncake://127.0.0.1:0?{META}", "port"),
        (f"mooncake://127.0.0.1:70000?{META}", "port"),
        (f"mooncake://?{META}", "host"),
        (f"mooncake://127.0.0.1:50051?{META}&protocol=udp", "protocol"),
        (f"mooncake://127.0.0.1:50051?{META}&segment=lots", "segment"),
        (f"mooncake://127.0.0.1:50051?{META}&segment=-1GB", "segment"),
        (f"mooncake://127.0.0.1:50051?{META}&buffer=16XB", "buffer"),
        (f"mooncake://127.0.0.1:50051?{META}&replicas=0", "replicas"),
        (f"mooncake://127.0.0.1:50051?{META}&replicas=two", "replicas"),
        (f"mooncake://127.0.0.1:50051?{META}&device=mlx5_0", "device"),
        (f"mooncake://127.0.0.1:50051?{META}&colour=blue", "colour"),
        (f"mooncake://127.0.0.1:50051?{META}&{META}", "twice"),
        (f"mooncake://127.0.0.1:50051/db?{META}", "path"),
        (f"mooncake://user:pw@127.0.0.1:50051?{META}", "user"),
    ],
)
def test_malformed_urls_are_refused_naming_the_bad_part(url, names, monkeypatch):
    def connects(*args: object) -> None:
        raise AssertionError("a malformed URL reached a connection")

    # refused before connecting: neither Mooncake's client nor a probe of the master is reached
    monkeypatch.setattr(mooncake_store, "_load_client", connects)
    monkeypatch.setattr(mooncake_store, "_probe", connects)
    with pytest.raises(ValidationError) as refused:
        open_store(url, PluginRegistry())
    assert refused.value.argument == "remote_url"
    assert names in str(refused.value)


def test_url_options():
    options = parse_url(
        "mooncake://10.0.0.5:6000?metadata=http://10.0.0.5:8080/metadata&protocol=rdma&device=mlx5_0,mlx5_1"
        "&segment=4GB&buffer=512MiB&replicas=2&local_host=10.0.0.9"
    )
    assert (options.host, options.port, options.master) == ("10.0.0.5", 6000, "10.0.0.5:6000")
    assert (options.protocol, options.device, options.replicas) == ("rdma", "mlx5_0,mlx5_1", 2)
    assert (options.segment, options.buffer, options.local_host) == (4 << 30, 512 << 20, "10.0.0.9")
    defaults = parse_url("mooncake://h?metadata=http://h:1/metadata")
    assert (defaults.port, defaults.protocol, defaults.segment, defaults.buffer) == (
        50051,
        "tcp",
        0,
        16 << 20,
    )
    assert (defaults.replicas, defaults.device, defaults.local_host) == (1, "", None)
    assert parse_url("mooncake://h:1?metadata=http://h:1/m&segment=1.5k").segment == 1536


def test_no_master_is_unavailable_quickly():
    dead = free_port()  # nothing listens there
    url = f"mooncake://127.0.0.1:{dead}?metadata=http://127.0.0.1:{dead}/metadata"
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{dead}"):
        open_store(url, PluginRegistry())
    assert time.monotonic() - started < 30


def test_no_metadata_server_is_unavailable(cluster):
    dead = free_port()
    url = f"mooncake://{cluster.master_address}?metadata=http://127.0.0.1:{dead}/metadata"
    with pytest.raises(StoreUnavailable, match="metadata server"):
        MooncakeStore.from_url(url)


def test_local_host_defaults_to_the_address_routing_to_the_master(cluster):
    from kvhal.tiers.stores.mooncake_url import route_address

    assert route_address("127.0.0.1", cluster.rpc_port) == "127.0.0.1"
    assert route_address("localhost", cluster.rpc_port) in ("127.0.0.1", "::1")


def test_without_mooncakes_client_the_url_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # the import fails as when not installed
    with pytest.raises(ValidationError, match="pip install mooncake-transfer-engine") as refused:
        MooncakeStore.from_url("mooncake://127.0.0.1:1?metadata=http://127.0.0.1:1/metadata")
    assert refused.value.argument == "remote_url"


def test_importing_the_stores_does_not_load_mooncake():
    code = (
        "import sys, kvhal.tiers.media, kvhal.tiers.stores.mooncake\n"
        "assert 'mooncake.store' not in sys.modules and 'mooncake' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_close_is_idempotent_and_later_calls_are_unavailable(cluster):
    client = MooncakeStore.from_url(cluster.url)
    # kept alive until close: freed registered memory can come back as the staging area,
    # which Mooncake then refuses as an overlapping region
    registered = bytearray(4096)
    client.register(memoryview(registered))
    (name,) = fresh("closing", 1)
    assert client.put([name], [[memoryview(b"x" * 10)]]) == [True]
    client.close()
    client.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        client.exist([name])


# -- an outage ----------------------------------------------------------------------------


def test_master_outage_and_reconnect():
    """The master goes away (its state with it) and comes back on the same ports: the same
    client object answers again by itself."""
    with MooncakeCluster(segment="64MB") as outage:
        client = open_store(outage.url, PluginRegistry())
        try:
            old = fresh("before-outage", 2)
            assert client.put(old, [[memoryview(b"old" * 10)]] * 2) == [True, True]
            outage.stop_master()
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="-900"):
                client.exist(old)
            with pytest.raises(StoreUnavailable):
                client.get(old, [[memoryview(bytearray(30))]] * 2)
            with pytest.raises(StoreUnavailable):
                client.put(fresh("during-outage", 1), [[memoryview(b"x")]])
            assert time.monotonic() - started < 30  # about 4.3 s each for the get and the put

            outage.start_master()  # returns once a put works again
            assert client.exist(old) == [False, False]  # the master lost its state
            new = fresh("after-outage", 3)
            values = [[memoryview(noise(1000, 40 + i))] for i in range(3)]
            assert client.put(new, values) == [True] * 3
            out = [bytearray(1000) for _ in range(3)]
            assert client.get(new, [[memoryview(b)] for b in out]) == [1000] * 3
            assert [bytes(b) for b in out] == [bytes(v[0]) for v in values]
        finally:
            client.close()


def test_cluster_helper_fails_with_the_log_tails():
    # Mooncake's store node runs on with a size it cannot parse, contributing nothing: no put works
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no working put") as failed:
        MooncakeCluster(segment="not-a-size", timeout=4)
    assert "--- node-" in str(failed.value) and "--- master-" in str(failed.value)
    assert time.monotonic() - started < 20


def test_free_port_is_free_and_below_the_ephemeral_range():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert port < first_ephemeral, "an outgoing connection may take this port before a server binds it"


@pytest.mark.parametrize("node", [False, True])
def test_a_client_of_a_store_with_no_memory_warns_at_start(cluster, caplog, node):
    """segment=0 and no store node: every write would fail with nothing said (0 hits). A test
    value at connect tells, once; the control: the module's cluster has a node, no warning."""
    with caplog.at_level(logging.WARNING, logger="kvhal.tiers.stores.mooncake"):
        if node:
            MooncakeStore.from_url(cluster.url).close()
        else:
            with MooncakeCluster(node=False) as bare:
                MooncakeStore.from_url(bare.url).close()
    warned = [r for r in caplog.records if "could not be stored" in r.getMessage()]
    assert len(warned) == (0 if node else 1)


# -- the remote tier, zero-copy end to end ------------------------------------------------


def test_the_tier_moves_blocks_straight_between_registered_host_slots_and_a_flipped_byte_is_caught(
    cluster, store, cpu, monkeypatch
):
    """A RemoteTier over Mooncake registers its host tier with the store and moves blocks between
    host slots and the store without a staging copy (large blocks: nothing is staged); what it
    reads back is what it wrote. The negative control: a value whose payload byte was flipped in
    the store lands in a registered host slot by the same path, and is refused there as CORRUPT
    (crc32c checked in place), never served."""
    from kvhal.offload.host_tier import HostTier
    from kvhal.tiers.backend import CORRUPT, OK, TierSpec
    from kvhal.tiers.remote import format as remote_format
    from kvhal.tiers.remote.tier import RemoteTier

    slot = 2 << 20  # above mooncake_staging.COALESCE_BYTES: header and slot go as two slices
    host = HostTier(cpu, slot * 6, slot)
    rows = np.frombuffer(host.memory(), dtype=np.uint8)[: slot * 6].reshape(6, slot)
    rows[:] = noise(rows.size, 7).reshape(rows.shape)
    spec = TierSpec({}, slot, fingerprint={"model": "zero-copy", "layout": "LBHNC"}, role="io")
    tier = RemoteTier(cluster.url, spec, host=host)
    staged: list[int] = []
    tier_store = tier._client()
    monkeypatch.setattr(tier_store, "_take_staging", lambda size: staged.append(size))
    keys = [f"zero-copy-{os.getpid()}-{next(_names)}-{i}".encode() for i in range(2)]
    assert tier.write(keys, [0, 1]).result(30) == [True, True]
    assert tier.read(keys, [2, 3]).result(30) == [OK, OK]
    assert bytes(host.slot_memory(2)) == bytes(host.slot_memory(0))
    assert bytes(host.slot_memory(3)) == bytes(host.slot_memory(1))
    assert staged == [], "a block went through a staging area"

    # values framed as the tier frames slot 0's block (kvhal's header, crc32c), put under the
    # names of keys the tier never wrote: one intact, one with a payload byte flipped after
    def framed(key: bytes) -> tuple[str, np.ndarray]:
        name = tier.names([key])[0]
        value = np.zeros(HEADER + slot, dtype=np.uint8)
        value[HEADER:] = rows[0]
        remote_format.write_header(
            memoryview(value[:HEADER]), memoryview(value[HEADER:]), tier._namespace, name, None
        )
        return name, value

    intact, flipped = (f"zero-copy-{os.getpid()}-{next(_names)}-{k}".encode() for k in ("intact", "flip"))
    name, value = framed(intact)
    assert store.put([name], [[memoryview(value)]]) == [True]
    name, value = framed(flipped)
    value[HEADER + slot // 2] ^= 0x01
    assert store.put([name], [[memoryview(value)]]) == [True]
    # the same framing without the flip is served: the flip, not the framing, is refused
    assert tier.read([intact], [4]).result(30) == [OK]
    assert bytes(host.slot_memory(4)) == bytes(host.slot_memory(0))
    rows[4] = 0
    assert tier.read([flipped], [4]).result(30) == [CORRUPT], "a block with a flipped byte was served"
    assert tier.read(keys[1:], [5]).result(30) == [OK]  # the control, read the same way
    assert bytes(host.slot_memory(5)) == bytes(host.slot_memory(1))
    tier.close()
