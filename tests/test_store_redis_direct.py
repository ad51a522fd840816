"""kvhal's own Redis reader (kvhal.tiers.stores.redis_direct): values received straight into
the caller's buffers, against real redis-server processes, and against a hostile server (a
socket on loopback answering what a broken or malicious store could) for the bounds."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator

import pytest

from kvhal.errors import ValidationError
from kvhal.testing.redis_servers import RedisServer, redis_server_binary
from kvhal.tiers.remote.store import ABSENT, FAILED, StoreUnavailable
from kvhal.tiers.stores import redis_direct
from kvhal.tiers.stores.redis import RedisStore
from kvhal.tiers.stores.redis_url import parse_url

pytestmark = [
    pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed"),
    pytest.mark.skipif(redis_direct._resp is None, reason="kvhal's Redis reader was not built"),
]

PASSWORD = "direct-Pw-55"


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


@pytest.fixture(autouse=True)
def _no_redis_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVHAL_REDIS_USERNAME", "KVHAL_REDIS_PASSWORD", "KVHAL_REDIS_READER"):
        monkeypatch.delenv(name, raising=False)


def names(n: int) -> list[str]:
    prefix = uuid.uuid4().hex[:12]
    return [f"direct/{prefix}/{i}" for i in range(n)]


def slots(n: int, size: int) -> list[list[memoryview]]:
    """``n`` buffers of a 96-byte header row and a slot of ``size`` bytes, as the tier reads."""
    return [[memoryview(bytearray(b"\xee" * 96)), memoryview(bytearray(b"\xee" * size))] for _ in range(n)]


def test_values_land_in_the_slots_with_no_bytes_object_between(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """60 values of 96 + 192 KiB read into header rows and slots: the bytes are the values,
    and the read allocates no Python memory of the values' size (glide's, the negative
    control, allocates each value as a bytes object)."""
    keys = names(60)
    values = [os.urandom(96 + (192 << 10)) for _ in keys]
    with server.client() as raw:
        raw.mset(dict(zip(keys, values, strict=True)))
    peaks = {}
    for reader in ("direct", "glide"):
        monkeypatch.setenv("KVHAL_REDIS_READER", reader)
        store = RedisStore.from_url(server.url)
        buffers = slots(60, 192 << 10)
        store.get(keys[:1], buffers[:1])  # a connection made before measuring
        tracemalloc.start()
        try:
            got = store.get(keys, buffers)
            peaks[reader] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            store.close()
        assert got == [len(v) for v in values]
        assert all(bytes(h) + bytes(s) == v for (h, s), v in zip(buffers, values, strict=True))
    assert peaks["direct"] < 1 << 20, f"the direct reader allocated {peaks['direct'] >> 10} KiB"
    assert peaks["glide"] > 10 << 20, "the control sees no values allocated at all"


def test_absent_refused_and_oversized_names_fail_alone(server: RedisServer) -> None:
    """In one batch: a missing name is absent, a name holding a list is refused, a value
    longer than its buffers fails (drained, never delivered); the others read, and the
    connection stays usable (the next call reads on it)."""
    present, missing, listed, big, after = names(5)
    size = 100 << 10  # the oversized reply (SIZE + 1 bytes) is drained through a 64 KiB buffer
    with server.client() as raw:
        raw.set(present, b"p" * size)
        raw.rpush(listed, b"x")
        raw.set(big, b"b" * (3 * size))
        raw.set(after, b"a" * 10)
    store = RedisStore.from_url(server.url)
    assert store._direct is not None
    buffers = [[memoryview(bytearray(size))] for _ in range(5)]
    assert store.get([present, missing, listed, big, after], buffers) == [size, ABSENT, FAILED, FAILED, 10]
    assert bytes(buffers[0][0]) == b"p" * size and bytes(buffers[4][0][:10]) == b"a" * 10
    assert bytes(buffers[3][0]) == bytes(size), "a value longer than its buffers was delivered"
    idle = store._direct._idle.qsize()
    assert store.get([present], [[memoryview(bytearray(size))]]) == [size]
    assert store._direct._idle.qsize() == idle == 1, "the connection was not reused"
    store.close()


def test_more_names_than_one_round_trip_each_get_their_own_value(server: RedisServer) -> None:
    keys = names(300)  # more than BATCH_COMMANDS (128)
    with server.client() as raw:
        raw.mset({k: f"value {i}".encode() for i, k in enumerate(keys)})
    store = RedisStore.from_url(server.url)
    assert store._direct is not None
    buffers = [[memoryview(bytearray(16))] for _ in keys]
    got = store.get(keys, buffers)
    assert [bytes(b[0][:n]) for b, n in zip(buffers, got, strict=True)] == [
        f"value {i}".encode() for i in range(300)
    ]
    store.close()


def test_credentials_and_database(monkeypatch: pytest.MonkeyPatch) -> None:
    """AUTH and SELECT on the reader's own connections: a value of database 3 is read there,
    and is absent from database 0."""
    with RedisServer(password=PASSWORD) as s:
        (name,) = names(1)
        with s.client(db=3) as raw:
            raw.set(name, b"in db 3")
        url = f"redis://:{PASSWORD}@127.0.0.1:{s.port}"
        for db, expected in ((3, 7), (0, ABSENT)):
            store = RedisStore.from_url(f"{url}/{db}")
            assert store._direct is not None
            assert store.get([name], [[memoryview(bytearray(16))]]) == [expected]
            store.close()


def test_a_stopped_server_is_unavailable_within_the_timeout_then_read_again(server: RedisServer) -> None:
    (name,) = names(1)
    with server.client() as raw:
        raw.set(name, b"still here")
    store = RedisStore.from_url(server.url + "?timeout=0.5")
    assert store._direct is not None
    store.get([name], [[memoryview(bytearray(16))]])  # a pooled connection, now stalled too
    (pid,) = server.pids
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match="timed out"):
            store.get([name], [[memoryview(bytearray(16))]])
        assert time.monotonic() - start < 2.0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert store.get([name], [[memoryview(bytearray(16))]]) == [10]
    store.close()


def test_one_connection_serves_call_after_call(server: RedisServer) -> None:
    """A pooled connection is checked without waiting (a check that waited for the socket's
    timeout once made every other call time out) and reused."""
    (name,) = names(1)
    with server.client() as raw:
        raw.set(name, b"value")
    store = RedisStore.from_url(server.url)
    assert store._direct is not None
    start = time.monotonic()
    for _ in range(20):
        assert store.get([name], [[memoryview(bytearray(8))]]) == [5]
        assert store._direct._idle.qsize() == 1
    assert time.monotonic() - start < 1.0
    store.close()


def test_pooled_connections_the_server_closed_are_not_used(server: RedisServer) -> None:
    """A restart or an idle timeout closes the pooled connections: the next read connects
    afresh instead of failing on a dead one (which would mark the store down)."""
    (name,) = names(1)
    with server.client() as raw:
        raw.set(name, b"value")
    store = RedisStore.from_url(server.url)
    assert store._direct is not None
    barrier = threading.Barrier(3)

    def read() -> None:  # three calls at once: three pooled connections
        barrier.wait()
        assert store.get([name], [[memoryview(bytearray(8))]]) == [5]

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert store._direct._idle.qsize() >= 2
    with server.client() as raw:
        raw.client_kill_filter(_type="normal", skipme=True)
    assert store.get([name], [[memoryview(bytearray(8))]]) == [5]
    store.close()


def test_an_unknown_reader_is_refused_by_name_before_connecting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVHAL_REDIS_READER", "hiredis")
    with pytest.raises(ValidationError, match="must be one of") as raised:
        RedisStore.from_url("redis://127.0.0.1:1/0")  # nothing listens there: never reached
    assert raised.value.argument == "KVHAL_REDIS_READER"


def test_tls_and_clusters_are_not_read_directly() -> None:
    assert "cluster" in redis_direct.unsupported(parse_url("redis+cluster://127.0.0.1:7000"))
    assert "TLS" in redis_direct.unsupported(parse_url("rediss://127.0.0.1:6380/0"))
    assert redis_direct.unsupported(parse_url("redis://127.0.0.1:6379/0")) is None


# --- a hostile server: what the reader does with a reply no Redis sends ------------------------


def hostile(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A loopback server that reads one request and answers with ``answer``; its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                try:
                    answer(conn)
                except OSError:  # the reader hung up first, as it should
                    return
                time.sleep(1.0)  # keep the connection open: the reader must not wait for its end

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{port}/0?timeout=0.5"
    thread.join(timeout=5)


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        (b"$1073741824\r\n", "longer than its GETRANGE asked for"),  # 1 GiB announced: not read
        (b"hello\r\n", "unexpected reply type"),
        (b"$12\r\nshort", "timed out"),  # a payload that never completes
        (b"$4\r\nabcdXY", "malformed reply end"),
        (b"$" + b"9" * 5000 + b"\r\n", "header"),  # an endless header line
        (b":12\r\n", "unexpected reply type"),
    ],
)
def test_a_reply_no_redis_sends_drops_the_connection(reply: bytes, says: str) -> None:
    for url in hostile(lambda conn: conn.sendall(reply)):
        reader = redis_direct.DirectReader(parse_url(url), "hostile")
        buffers = [[memoryview(bytearray(16))]]
        start = time.monotonic()
        tracemalloc.start()
        try:
            with pytest.raises(StoreUnavailable, match=says):
                reader.getrange_into(["a"], buffers)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert time.monotonic() - start < 2.0
        assert peak < 1 << 20, f"the reader allocated {peak >> 10} KiB for a bad reply"
        assert reader._idle.qsize() == 0, "a connection that answered garbage was kept"
        reader.close()


def test_a_server_trickling_bytes_is_cut_off_at_the_deadline() -> None:
    """One deadline for the whole call: a reply that keeps arriving, a byte at a time, is
    cut off when it passes (not renewed by each byte)."""

    def answer(conn: socket.socket) -> None:
        conn.sendall(b"$16\r\n")
        for _ in range(16):
            time.sleep(0.1)
            conn.sendall(b"x")

    for url in hostile(answer):
        reader = redis_direct.DirectReader(parse_url(url), "hostile")
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match="timed out"):
            reader.getrange_into(["a"], [[memoryview(bytearray(16))]])
        assert time.monotonic() - start < 1.0
        reader.close()


def test_a_server_that_cannot_serve_now_is_unavailable_not_a_refused_name() -> None:
    for url in hostile(lambda conn: conn.sendall(b"-LOADING Redis is loading the dataset in memory\r\n")):
        reader = redis_direct.DirectReader(parse_url(url), "hostile")
        with pytest.raises(StoreUnavailable, match="cannot serve now"):
            reader.getrange_into(["a"], [[memoryview(bytearray(16))]])
        reader.close()


def test_a_server_that_hangs_up_mid_value() -> None:
    def answer(conn: socket.socket) -> None:
        conn.sendall(b"$100\r\n" + b"x" * 50)
        conn.shutdown(socket.SHUT_WR)

    for url in hostile(answer):
        reader = redis_direct.DirectReader(parse_url(url), "hostile")
        with pytest.raises(StoreUnavailable, match="closed the connection"):
            reader.getrange_into(["a"], [[memoryview(bytearray(200))]])
        reader.close()


@pytest.mark.parametrize("value", ["1e10", "86400.5", "inf", "nan", "0", "-1", "soon"])
def test_a_timeout_no_socket_can_honour_is_refused_naming_the_option(value: str) -> None:
    """Before: timeout=1e10 was taken, and the first read leaked socket.settimeout's
    OverflowError (the native reader's conversion of it was undefined)."""
    with pytest.raises(
        ValidationError, match=r"timeout must be a positive number of seconds, at most 86400"
    ) as info:
        parse_url(f"redis://127.0.0.1:6379/0?timeout={value}")
    assert info.value.argument == "remote_url"
    assert parse_url("redis://127.0.0.1:6379/0?timeout=86400").timeout == 86400
    with socket.socket() as sock:  # the longest taken is one a socket honours
        sock.settimeout(parse_url("redis://127.0.0.1:6379/0?timeout=86400").timeout)
