"""kvhal.testing.stall_proxy: bytes through, both ways; nothing while stalled, the connection kept
open; what was held delivered on resume; an upstream that is down closes the client's connection.
A loopback echo server of the test's own (no store needed): well under a second."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from kvhal.testing.ports import HOST
from kvhal.testing.stall_proxy import StallProxy


@pytest.fixture
def echo() -> Iterator[int]:
    """An echo server's port: each connection gets back what it sends."""
    listener = socket.create_server((HOST, 0))
    threads = []

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=serve, args=(conn,), daemon=True)
            thread.start()
            threads.append(thread)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    yield listener.getsockname()[1]
    with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)
    listener.close()
    acceptor.join(5)


def receive(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def test_bytes_pass_both_ways_and_a_stall_holds_them_until_resumed(echo):
    payload = bytes(range(256)) * 4096  # 1 MiB: more than one splice
    with StallProxy(echo) as proxy, socket.create_connection((HOST, proxy.port), timeout=5) as sock:
        sock.sendall(payload)
        assert receive(sock, len(payload)) == payload
        proxy.stall()
        sock.sendall(b"held")
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(4)  # nothing moves while stalled ...
        assert proxy.is_stalled
        proxy.resume()
        sock.settimeout(5)
        assert receive(sock, 4) == b"held"  # ... and what was held arrives, on the same connection
        assert proxy.accepted == 1


def test_a_stalled_context_resumes_on_leaving_it(echo):
    with StallProxy(echo) as proxy:
        with proxy.stalled():
            assert proxy.is_stalled
        assert not proxy.is_stalled
        with socket.create_connection((HOST, proxy.port), timeout=5) as sock:
            sock.sendall(b"ping")
            assert receive(sock, 4) == b"ping"


def test_an_upstream_that_is_down_closes_the_clients_connection():
    with socket.create_server((HOST, 0)) as placeholder:
        port = placeholder.getsockname()[1]  # closed below: nothing listens there
    with StallProxy(port, connect_timeout=1.0) as proxy, socket.create_connection((HOST, proxy.port)) as sock:
        sock.settimeout(5)
        assert sock.recv(1) == b""  # closed, not left hanging


def test_close_ends_every_connection(echo):
    proxy = StallProxy(echo)
    sock = socket.create_connection((HOST, proxy.port), timeout=5)
    sock.sendall(b"x")
    assert receive(sock, 1) == b"x"
    proxy.stall()  # a stalled proxy closes too
    proxy.close()
    assert sock.recv(1) == b""
    sock.close()
    with pytest.raises(OSError):
        socket.create_connection((HOST, proxy.port), timeout=1)
