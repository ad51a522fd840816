"""The built-in Redis remote store (kvhal.tiers.stores.redis) against real redis-server processes.

No mocks: every test talks to a server (or a 3-master cluster) that src/kvhal/testing/redis_servers.py
starts on a free loopback port.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import shutil
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvhal.errors import ValidationError
from kvhal.registry import PluginRegistry
from kvhal.testing.redis_servers import (
    RedisCluster,
    RedisServer,
    free_port,
    make_tls_certs,
    redis_server_binary,
)
from kvhal.tiers.media import open_store
from kvhal.tiers.remote.store import ABSENT, FAILED, RemoteStore, StoreUnavailable
from kvhal.tiers.stores.redis import RedisStore

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")

PASSWORD = "s3cr3t-Pw-for-tests"
ACL_USER, ACL_PASSWORD = "kvhal-user", "acl-Pw-7734"


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """One server shared by the module's tests; they use names of their own (see ``names``)."""
    with RedisServer() as s:
        yield s


@pytest.fixture(scope="module")
def auth_server() -> Iterator[RedisServer]:
    with RedisServer(password=PASSWORD, users={ACL_USER: ACL_PASSWORD}) as s:
        yield s


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(3) as c:
        yield c


@pytest.fixture
def store(server: RedisServer) -> Iterator[RemoteStore]:
    s = open_store(server.url, PluginRegistry())
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _no_redis_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    # the credentials settings of the machine running the tests must not leak in
    monkeypatch.delenv("KVHAL_REDIS_USERNAME", raising=False)
    monkeypatch.delenv("KVHAL_REDIS_PASSWORD", raising=False)


def names(n: int) -> list[str]:
    """``n`` names no other test uses."""
    prefix = uuid.uuid4().hex[:12]
    return [f"test/{prefix}/{i}" for i in range(n)]


def parts_of(data: bytes, cuts: Sequence[int]) -> list[memoryview]:
    """``data`` cut at ``cuts`` into memoryview parts (an empty part where two cuts meet)."""
    bounds = [0, *cuts, len(data)]
    view = memoryview(data)
    return [view[a:b] for a, b in itertools.pairwise(bounds)]


def buffers_for(sizes: Sequence[int]) -> list[memoryview]:
    return [memoryview(bytearray(b"\xee" * n)) for n in sizes]


def joined(buffers: Sequence[memoryview], length: int) -> bytes:
    return b"".join(bytes(b) for b in buffers)[:length]


# --- round trips ------------------------------------------------------------------------------


def test_round_trip_of_multi_part_binary_values(store: RemoteStore) -> None:
    rng = random.Random(7)
    keys = names(5)
    payloads = [rng.randbytes(n) for n in (1, 1000, 4096, 65536 + 17, 0)]
    cuts = [[], [10, 10, 500], [4095], [1, 30000, 60000], []]  # an empty part in the second
    values = [parts_of(p, c) for p, c in zip(payloads, cuts, strict=True)]
    assert store.put(keys, values) == [True] * 5
    assert store.exist([*keys, names(1)[0]]) == [True] * 5 + [False]

    # buffers cut differently from the values, and some longer than the value
    sizes = [[1], [300, 300, 500], [10, 10_000], [65536, 100], [8]]
    buffers = [buffers_for(s) for s in sizes]
    got = store.get(keys, buffers)
    # an empty value reads as absent (GETRANGE answers "" for both; kvhal never stores one)
    assert got == [len(p) for p in payloads[:4]] + [ABSENT]
    for payload, buf, n in zip(payloads[:4], buffers, got, strict=False):
        assert joined(buf, n) == payload
    # bytes past the value stay untouched
    assert bytes(buffers[1][2][400:]) == b"\xee" * 100


def test_absent_name_and_value_longer_than_its_buffers(store: RemoteStore) -> None:
    present, absent = names(2)
    assert store.put([present], [[memoryview(b"0123456789")]]) == [True]
    small, exact = buffers_for([4, 5]), buffers_for([10])
    assert store.get([absent, present, present], [buffers_for([16]), small, exact]) == [ABSENT, FAILED, 10]
    assert joined(exact, 10) == b"0123456789"


@pytest.mark.parametrize("writer", ["glide", "redis-py"])
def test_writes_through_either_client_join_parts_and_never_replace_a_value(
    server: RedisServer, writer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes of one server go through glide where it is installed (redis-py beside a busy
    thread took 0.36 s for 60 values of 192 KiB, glide 0.03 s), redis-py otherwise; both store
    a value of several parts joined, and neither replaces a name that exists (SET NX)."""
    store = RedisStore.from_url(server.url + "?ttl=60")
    calls: list[int] = []
    if writer == "redis-py":
        store._glide = store._direct = None
    else:
        assert store._glide is not None, "writes of a plain server go through glide where it is installed"
        set_new = store._glide.set_new
        monkeypatch.setattr(store._glide, "set_new", lambda *a: calls.append(len(a[0])) or set_new(*a))
    first, second = names(2)
    data = bytes(range(256)) * 300
    assert store.put([first, second], [parts_of(data, [96, 4096]), [memoryview(b"x")]]) == [True, True]
    assert store.put([first], [[memoryview(b"another value")]]) == [True]  # exists: stored by another
    many = names(300)  # more than one batch of commands (128), each reply matched to its name
    assert store.put(many, [[memoryview(f"value {i}".encode())] for i in range(300)]) == [True] * 300
    assert calls == ([2, 1, 300] if writer == "glide" else [])
    with server.client() as raw:
        assert raw.get(first) == data and raw.get(second) == b"x"
        assert 0 < raw.ttl(first) <= 60
        assert raw.mget(many) == [f"value {i}".encode() for i in range(300)]
    store.close()


@pytest.mark.parametrize("reader", ["direct", "glide", "redis-py"])
def test_an_oversized_value_is_never_read_whole(
    server: RedisServer, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value planted under a block's name, far larger than a block: the read fails without
    bringing it into memory (GETRANGE asks for one byte more than the buffers hold)."""
    import tracemalloc

    monkeypatch.setenv("KVHAL_REDIS_READER", reader)
    store = RedisStore.from_url(server.url)
    assert (store._direct is not None, store._glide is not None) == {
        "direct": (True, True),  # reads direct, writes through glide
        "glide": (False, True),
        "redis-py": (False, False),
    }[reader], "each reader serves a plain server where it is installed"
    (name,) = names(1)
    planted = 32 << 20
    server.client().set(name, b"\0" * planted)
    tracemalloc.start()
    try:
        assert store.get([name], [buffers_for([4096])]) == [FAILED]
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        server.client().get(name)  # negative control: a plain GET brings the whole value in
        _, control = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"reading a {planted >> 20} MiB value took {peak >> 10} KiB"
    assert control >= planted, "the measurement sees no large read at all"
    store.close()


def test_an_existing_name_is_never_replaced(store: RemoteStore, server: RedisServer) -> None:
    (name,) = names(1)
    assert store.put([name], [[memoryview(b"first")]]) == [True]
    assert store.put([name], [[memoryview(b"second!")]]) == [True]  # stored already: success
    buf = buffers_for([16])
    assert store.get([name], [buf]) == [5]
    assert joined(buf, 5) == b"first"
    with server.client() as raw:
        assert raw.get(name) == b"first"


def test_bytes_read_back_are_the_bytes_written(store: RemoteStore) -> None:
    # negative control: a one-byte change in the source shows in what is read back
    a, b = names(2)
    source = bytearray(random.Random(3).randbytes(3000))
    assert store.put([a], [[memoryview(source)[:1000], memoryview(source)[1000:]]]) == [True]
    source[1234] ^= 0x01
    assert store.put([b], [[memoryview(source)[:1000], memoryview(source)[1000:]]]) == [True]
    bufs_a, bufs_b = buffers_for([3000]), buffers_for([3000])
    assert store.get([a, b], [bufs_a, bufs_b]) == [3000, 3000]
    got_a, got_b = joined(bufs_a, 3000), joined(bufs_b, 3000)
    assert got_b == bytes(source)
    assert got_a != got_b
    assert [i for i in range(3000) if got_a[i] != got_b[i]] == [1234]


def test_non_byte_memoryviews_move_their_bytes(store: RemoteStore) -> None:
    # parts may be typed views (e.g. of an int32 array); their bytes are what moves
    import array

    (name,) = names(1)
    ints = array.array("i", range(100))
    assert store.put([name], [[memoryview(ints)]]) == [True]
    out = array.array("i", [0] * 100)
    assert store.get([name], [[memoryview(out)]]) == [400]
    assert out == ints


def test_a_full_server_refuses_puts_and_still_serves_gets() -> None:
    # noeviction under maxmemory: SET fails with OOM for that name only
    with RedisServer(extra_args=["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]) as s:
        store = RedisStore.from_url(s.url)
        try:
            small, *big = names(40)
            assert store.put([small], [[memoryview(b"tiny")]]) == [True]
            chunk = memoryview(bytes(256 * 1024))
            results = store.put(big, [[chunk]] * len(big))
            assert results[0] is True and results[-1] is False  # filled up along the way
            assert store.get([small], [buffers_for([4])]) == [4]
        finally:
            store.close()


# --- cluster ----------------------------------------------------------------------------------


@pytest.mark.parametrize("client", ["glide", "redis-py"])
def test_cluster_round_trip_across_slots(cluster: RedisCluster, client: str) -> None:
    """Through glide where it is installed; through redis-py's cluster client where a TLS option
    glide cannot express keeps it there."""
    store = open_store(cluster.url, PluginRegistry())
    assert isinstance(store, RedisStore) and store._glide is not None, "a cluster's values go through glide"
    assert store._direct is None, "kvhal's own reader serves one plain-TCP server only"
    if client == "redis-py":
        store._glide.close()
        store._glide = None
    try:
        keys = names(200)
        payloads = [f"value of {k}".encode() * (1 + i % 7) for i, k in enumerate(keys)]
        assert store.put(keys, [parts_of(p, [3]) for p in payloads]) == [True] * 200
        assert store.exist([*keys, *names(3)]) == [True] * 200 + [False] * 3
        buffers = [buffers_for([8, 400]) for _ in keys]
        got = store.get(keys, buffers)
        assert got == [len(p) for p in payloads]
        assert all(joined(b, n) == p for b, n, p in zip(buffers, got, payloads, strict=True))
        # the names really are spread over every master
        for node in cluster.nodes:
            with node.client() as raw:
                assert raw.dbsize() > 20
    finally:
        store.close()


def test_cluster_outage_then_recovery(cluster: RedisCluster) -> None:
    store = RedisStore.from_url(cluster.url)
    keys = names(20)
    values = [[memoryview(k.encode())] for k in keys]
    try:
        assert all(store.put(keys, values))
        cluster.stop()
        buffers = [buffers_for([64]) for _ in keys]
        for call in (
            lambda: store.exist(keys),
            lambda: store.put(keys, values),
            lambda: store.get(keys, buffers),
        ):
            with pytest.raises(StoreUnavailable, match=r"redis cluster at 127\.0\.0\.1"):
                call()
        cluster.start()
        # the first call may still meet a dead connection; the next one must work
        with contextlib.suppress(StoreUnavailable):
            store.exist(keys)
        assert store.exist(keys) == [False] * 20  # persistence is off: the data is gone
        assert all(store.put(keys, values))
        assert store.exist(keys) == [True] * 20
    finally:
        store.close()
        cluster.start()  # for the tests after this one, whatever happened


def test_cluster_with_one_master_down(cluster: RedisCluster) -> None:
    # a lookup that needs the missing master fails as a whole (redis-py); reads and writes
    # (glide) fail the missing master's names only; the others' values survive it
    store = RedisStore.from_url(cluster.url)
    keys = names(60)
    try:
        assert all(store.put(keys, [[memoryview(b"v")]] * 60))
        cluster.nodes[1].stop()
        with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{cluster.nodes[1].port}"):
            store.exist(keys)
        got = store.get(keys, [buffers_for([8]) for _ in keys])
        assert set(got) == {1, FAILED} and 0 < got.count(FAILED) < 60, got
        stored = store.put(names(60), [[memoryview(b"w")]] * 60)
        assert 0 < stored.count(False) < 60, stored
        cluster.start()
        with contextlib.suppress(StoreUnavailable):
            store.exist(keys)
        held = store.exist(keys)
        with cluster.nodes[0].client() as raw:
            on_node_0 = [k for k in keys if raw.execute_command("CLUSTER", "KEYSLOT", k) in _slots(raw)]
        assert 0 < sum(held) < 60  # the restarted master lost its share
        assert all(held[keys.index(k)] for k in on_node_0)
    finally:
        store.close()
        cluster.start()


def _slots(raw) -> set[int]:
    """The slots the node ``raw`` talks to serves."""
    myid = raw.execute_command("CLUSTER", "MYID")
    myid = myid.decode() if isinstance(myid, bytes) else myid
    served: set[int] = set()
    for start, end, master, *_ in raw.execute_command("CLUSTER", "SLOTS"):
        node_id = master[2].decode() if isinstance(master[2], bytes) else master[2]
        if node_id == myid:
            served.update(range(start, end + 1))
    return served


# --- outages ----------------------------------------------------------------------------------


def test_no_server_is_unavailable_quickly() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"redis at 127.0.0.1:{port}") as caught:
        open_store(f"redis://user:{PASSWORD}@127.0.0.1:{port}/0", PluginRegistry())
    assert PASSWORD not in str(caught.value)
    with pytest.raises(StoreUnavailable, match=f"redis cluster at 127.0.0.1:{port}"):
        open_store(f"redis+cluster://127.0.0.1:{port}", PluginRegistry())
    assert time.monotonic() - start < 5


def test_server_stopped_then_restarted_on_the_same_port() -> None:
    with RedisServer() as s:
        store = RedisStore.from_url(s.url)
        keys = names(3)
        values = [[memoryview(b"v")]] * 3
        try:
            assert store.put(keys, values) == [True] * 3
            s.stop()
            start = time.monotonic()
            with pytest.raises(StoreUnavailable, match=f"redis at 127.0.0.1:{s.port}"):
                store.exist(keys)
            with pytest.raises(StoreUnavailable):
                store.put(keys, values)
            with pytest.raises(StoreUnavailable):
                store.get(keys, [buffers_for([1])] * 3)
            assert time.monotonic() - start < 5
            s.start()
            with contextlib.suppress(StoreUnavailable):
                store.exist(keys)  # may meet the connection the old server closed
            assert store.exist(keys) == [False] * 3
            assert store.put(keys, values) == [True] * 3
            assert store.get(keys, [buffers_for([1])] * 3) == [1] * 3
        finally:
            store.close()


def test_close_is_idempotent_and_final(server: RedisServer) -> None:
    store = RedisStore.from_url(server.url)
    store.close()
    store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        store.exist(["x"])


# --- credentials ------------------------------------------------------------------------------


def _round_trip(store: RemoteStore) -> None:
    (name,) = names(1)
    assert store.put([name], [[memoryview(b"abc")]]) == [True]
    buf = buffers_for([3])
    assert store.get([name], [buf]) == [3]
    assert joined(buf, 3) == b"abc"


def test_password_in_the_url(auth_server: RedisServer) -> None:
    store = open_store(f"redis://:{PASSWORD}@127.0.0.1:{auth_server.port}/0", PluginRegistry())
    try:
        _round_trip(store)
        assert PASSWORD not in repr(store)
    finally:
        store.close()


def test_password_from_the_setting(auth_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVHAL_REDIS_PASSWORD", PASSWORD)
    store = open_store(auth_server.url, PluginRegistry())
    try:
        _round_trip(store)
    finally:
        store.close()


def test_acl_user_in_the_url_and_from_the_settings(
    auth_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RedisStore.from_url(f"redis://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{auth_server.port}/0")
    try:
        _round_trip(store)
        with auth_server.client() as raw:
            users = [c["user"] for c in raw.client_list()]
        assert ACL_USER.encode() in users or ACL_USER in users
    finally:
        store.close()
    monkeypatch.setenv("KVHAL_REDIS_USERNAME", ACL_USER)
    monkeypatch.setenv("KVHAL_REDIS_PASSWORD", ACL_PASSWORD)
    store = RedisStore.from_url(auth_server.url)
    try:
        _round_trip(store)
    finally:
        store.close()


@pytest.mark.parametrize("where", ["url", "setting", "acl-user"])
def test_wrong_password_names_remote_url_and_hides_the_password(
    auth_server: RedisServer, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    wrong = "WRONG-pw-91527"
    url = auth_server.url
    if where == "url":
        url = f"redis://:{wrong}@127.0.0.1:{auth_server.port}/0"
    elif where == "setting":
        monkeypatch.setenv("KVHAL_REDIS_PASSWORD", wrong)
    else:
        url = f"redis://{ACL_USER}:{wrong}@127.0.0.1:{auth_server.port}/0"
    with pytest.raises(ValidationError) as caught:
        open_store(url, PluginRegistry())
    error = caught.value
    assert error.argument == "remote_url"
    assert "refused the credentials" in str(error)
    assert f"127.0.0.1:{auth_server.port}" in str(error)
    source = "from KVHAL_REDIS_PASSWORD" if where == "setting" else "from the URL"
    assert f"password {source}" in str(error)
    assert wrong not in str(error) and wrong not in repr(error)
    assert error.__cause__ is None or wrong not in str(error.__cause__)


def test_no_password_for_a_server_that_needs_one(auth_server: RedisServer) -> None:
    with pytest.raises(ValidationError, match=r"remote_url: .*refused the credentials .*password none"):
        RedisStore.from_url(auth_server.url)


# --- malformed URLs ---------------------------------------------------------------------------

# port 1 has no server: a URL that got as far as connecting would raise StoreUnavailable instead
MALFORMED = {
    "bad port": ("redis://127.0.0.1:port/0", "port"),
    "port out of range": ("redis://127.0.0.1:70000/0", "port"),
    "port zero": ("redis://127.0.0.1:0/0", "port"),
    "no host": ("redis://:1/0", "host"),
    "ttl not a number": ("redis://127.0.0.1:1/0?ttl=abc", "ttl"),
    "ttl zero": ("redis://127.0.0.1:1/0?ttl=0", "ttl"),
    "timeout not a number": ("redis://127.0.0.1:1/0?timeout=soon", "timeout"),
    "negative timeout": ("redis://127.0.0.1:1/0?timeout=-1", "timeout"),
    "db on a cluster": ("redis+cluster://127.0.0.1:1/3", "database 0"),
    "db not a number": ("redis://127.0.0.1:1/zero", "database"),
    "unknown option": ("redis://127.0.0.1:1/0?colour=blue", "unknown option"),
    "option twice": ("redis://127.0.0.1:1/0?ttl=5&ttl=6", "twice"),
    "ssl option without TLS": ("redis://127.0.0.1:1/0?ssl_ca_certs=/etc/hostname", "needs TLS"),
    "missing CA file": ("rediss://127.0.0.1:1/0?ssl_ca_certs=/nonexistent/ca.pem", "no file"),
    "bad cert_reqs": ("rediss://127.0.0.1:1/0?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
}


@pytest.mark.parametrize("url, says", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_urls_name_remote_url(url: str, says: str) -> None:
    with pytest.raises(ValidationError, match=says) as caught:
        open_store(url, PluginRegistry())
    assert caught.value.argument == "remote_url"


def test_a_database_the_server_lacks(server: RedisServer) -> None:
    with pytest.raises(ValidationError, match="out of range") as caught:
        RedisStore.from_url(f"redis://127.0.0.1:{server.port}/999")
    assert caught.value.argument == "remote_url"


def test_malformed_url_does_not_echo_its_password() -> None:
    with pytest.raises(ValidationError) as caught:
        RedisStore.from_url(f"redis://user:{PASSWORD}@127.0.0.1:notaport/0")
    assert PASSWORD not in str(caught.value)


def test_unknown_scheme_is_refused_by_the_store() -> None:
    with pytest.raises(ValidationError, match="unknown Redis scheme") as caught:
        RedisStore.from_url("memcached://127.0.0.1:1")
    assert caught.value.argument == "remote_url"


# --- options ----------------------------------------------------------------------------------


def test_ttl_expires_values(server: RedisServer) -> None:
    store = RedisStore.from_url(server.url + "?ttl=1&timeout=1.5")
    try:
        keys = names(2)
        assert store.put(keys, [[memoryview(b"x")]] * 2) == [True, True]
        assert store.exist(keys) == [True, True]
        with server.client() as raw:
            assert 0 < raw.pttl(keys[0]) <= 1000
        deadline = time.monotonic() + 3
        while any(store.exist(keys)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.exist(keys) == [False, False]
    finally:
        store.close()


def test_without_ttl_values_do_not_expire(store: RemoteStore, server: RedisServer) -> None:
    (name,) = names(1)
    assert store.put([name], [[memoryview(b"x")]]) == [True]
    with server.client() as raw:
        assert raw.ttl(name) == -1


def test_tls_round_trip(tmp_path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not on PATH (needed to make a test certificate)")
    certs = make_tls_certs(tmp_path / "tls")
    try:
        s = RedisServer(tls=certs)
    except RuntimeError as exc:
        # a redis-server built without TLS refuses the tls-* directives at startup
        if "Bad directive" in str(exc) or "TLS" in str(exc):
            pytest.skip(f"this redis-server cannot serve TLS: {str(exc).splitlines()[-1]}")
        raise
    with s:
        assert s.url.startswith("rediss://")
        store = open_store(s.url, PluginRegistry())
        assert isinstance(store, RedisStore) and store._glide is not None, "TLS reads go through glide"
        assert store._direct is None, "kvhal's own reader does not speak TLS"
        try:
            _round_trip(store)
        finally:
            store.close()
        # the certificate really is checked: without the CA the handshake fails
        with pytest.raises(StoreUnavailable):
            RedisStore.from_url(f"rediss://127.0.0.1:{s.port}/0?timeout=1")


# --- threads ----------------------------------------------------------------------------------


def test_four_threads_share_one_store(store: RemoteStore) -> None:
    assert store.concurrency == 4
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work(seed: int) -> None:
        try:
            rng = random.Random(seed)
            barrier.wait()
            for _ in range(25):
                keys = names(8)
                payloads = [rng.randbytes(rng.randrange(1, 20_000)) for _ in keys]
                assert store.put(keys, [parts_of(p, [len(p) // 2]) for p in payloads]) == [True] * 8
                buffers = [buffers_for([20_000]) for _ in keys]
                got = store.get(keys, buffers)
                assert got == [len(p) for p in payloads]
                for b, n, p in zip(buffers, got, payloads, strict=True):
                    assert joined(b, n) == p
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_a_cluster_node_s_ports_are_drawn_below_the_ephemeral_range() -> None:
    """A bus port (port + 10000) in the kernel's ephemeral range could be taken by an outgoing
    connection between the check and the node's bind; below it, only a listener can take it."""
    start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = free_port(with_bus=True)
        assert port + 10000 < start
