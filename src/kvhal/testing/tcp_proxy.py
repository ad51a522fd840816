"""A loopback TCP proxy in front of a real server, for fault tests: what a network or an
overloaded server does to a client, without a mock of the server.

::

    from kvhal.testing.tcp_proxy import TcpProxy

    with TcpProxy(server_port) as proxy:        # listens on proxy.port, passes every byte
        proxy.set_mode("stall")                 # new connections: read, never answered
        proxy.set_mode("slowdown")              # each HTTP request answered 503 SlowDown (S3's)
        proxy.set_mode("hold", after=1000)      # a response's first 1000 bytes pass, the rest waits
        proxy.drop()                            # every connection closed now (the server died)
        proxy.set_mode("pass")

Changing the mode closes the connections open (a client's pooled ones too), so that every
later request meets the new mode. ``requests`` counts the HTTP requests answered in
``slowdown`` mode; ``holding`` is set once a ``hold`` connection holds bytes back;
``to_client`` counts the bytes the server sent that reached a client.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Literal

from kvhal.testing.ports import HOST

__all__ = ["SLOWDOWN_RESPONSE", "TcpProxy"]

Mode = Literal["pass", "stall", "slowdown", "hold"]

_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
#: S3's answer to a client it throttles
SLOWDOWN_RESPONSE = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
    b"Content-Length: " + str(len(_BODY)).encode() + b"\r\nConnection: keep-alive\r\n\r\n" + _BODY
)


def _close(*sockets: socket.socket) -> None:
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()


class TcpProxy:
    """Listens on a free loopback port (:attr:`port`) and forwards to ``target_port``."""

    def __init__(self, target_port: int, *, target_host: str = HOST) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server((HOST, 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._mode: Mode = "pass"
        self._after = 0
        self.requests = 0
        self.to_client = 0
        self.holding = threading.Event()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="kvhal-proxy", daemon=True)
        self._acceptor.start()

    def set_mode(self, mode: Mode, *, after: int = 0) -> None:
        """From now on ``mode`` (``after``: the bytes of a response ``hold`` lets through)."""
        with self._lock:
            self._mode, self._after = mode, after
            self.requests = 0
            self.holding.clear()
        self.drop()

    def drop(self) -> None:
        """Close every connection open now, both sides."""
        with self._lock:
            sockets, self._open = list(self._open), set()
        _close(*sockets)

    def close(self) -> None:
        self._closed = True
        _close(self._listener)
        self.drop()
        self._acceptor.join(5)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the connections ----------------------------------------------------------------------

    def _track(self, *sockets: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._open.update(sockets)
            return True

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                mode, after = self._mode, self._after
            handler = {"stall": self._stall, "slowdown": self._slowdown}.get(mode, self._forward)
            threading.Thread(target=handler, args=(client, after), daemon=True).start()

    def _stall(self, client: socket.socket, after: int) -> None:
        if not self._track(client):
            return _close(client)
        with contextlib.suppress(OSError):
            while client.recv(65536):  # read what it sends, answer nothing
                pass
        _close(client)

    def _slowdown(self, client: socket.socket, after: int) -> None:
        if not self._track(client):
            return _close(client)
        pending = b""
        try:
            while True:
                while b"\r\n\r\n" not in pending:
                    chunk = client.recv(65536)
                    if not chunk:
                        return
                    pending += chunk
                head, _, pending = pending.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                while len(pending) < length:  # the request's body, read and dropped
                    chunk = client.recv(65536)
                    if not chunk:
                        return
                    pending += chunk
                pending = pending[length:]
                with self._lock:
                    self.requests += 1
                client.sendall(SLOWDOWN_RESPONSE)
        except OSError:
            return
        finally:
            _close(client)

    def _forward(self, client: socket.socket, after: int) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:  # the server is down: the client sees its connection closed
            return _close(client)
        upstream.settimeout(None)
        if not self._track(client, upstream):
            return _close(client, upstream)
        threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
        self._pump(upstream, client, after if self._mode == "hold" else None, to_client=True)

    def _pump(
        self, source: socket.socket, sink: socket.socket, hold_after: int | None, to_client: bool = False
    ) -> None:
        passed = 0
        try:
            while True:
                chunk = source.recv(65536)
                if not chunk:
                    break
                if hold_after is not None:
                    room = max(0, hold_after - passed)
                    if len(chunk) > room:
                        if room:
                            sink.sendall(chunk[:room])
                            self._count(room, to_client)
                        passed += room
                        self.holding.set()
                        continue  # the rest is held back (dropped with the connection)
                sink.sendall(chunk)
                self._count(len(chunk), to_client)
                passed += len(chunk)
        except OSError:
            pass
        _close(source, sink)

    def _count(self, sent: int, to_client: bool) -> None:
        if to_client:
            with self._lock:
                self.to_client += sent
