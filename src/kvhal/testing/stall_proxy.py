"""A loopback TCP proxy that can stall: a network path that stops delivering, for the tests
and ``kvhal bench store-load``.

Every connection to the proxy's port is forwarded to ``upstream`` (one upstream connection
per client connection; one that cannot be made closes the client's). While the proxy is
stalled, no byte moves in either direction, yet every connection stays open, as when a switch
or a congested link stops delivering: the client's calls wait for their own deadlines. Once
resumed, what was held is delivered, in order::

    from kvhal.testing.stall_proxy import StallProxy

    with StallProxy(server.port) as proxy:     # listening on 127.0.0.1:proxy.port
        url = f"redis://127.0.0.1:{proxy.port}/0"
        with proxy.stalled():                  # nothing moves in here
            ...

Bytes move with ``os.splice`` through a pipe (Linux; elsewhere ``recv``/``sendall``), on two
threads per connection that release the GIL while they wait, so the proxy costs its process
little CPU. A stall holds at most one chunk per direction that was already read (it is
delivered on resume). Every thread and socket ends when the proxy is closed.

The pumps need the GIL between two splices: a client in the proxy's own process that holds
the GIL while it waits on the network through the proxy (Mooncake's client does, in its
``setup``) waits for itself until its own timeout. Run such clients in another process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
from collections.abc import Iterator

from kvhal.testing.ports import HOST, free_port

__all__ = ["StallProxy"]

#: bytes moved per splice (the pipe is sized to hold them)
CHUNK = 1 << 20
#: ``fcntl`` command that sizes a pipe (Linux's F_SETPIPE_SZ, not in Python's fcntl before 3.10)
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
#: seconds a pump waits on the stall before it looks again whether the proxy is closing
_POLL = 0.2


class StallProxy:
    """A TCP proxy on ``127.0.0.1`` to ``(upstream_host, upstream_port)``; see the module.

    :param upstream_port: where connections are forwarded.
    :param upstream_host: its host (loopback by default).
    :param port: the proxy's port (default: a free one).
    :param connect_timeout: seconds an upstream connection may take before the client's is closed.
    """

    def __init__(
        self,
        upstream_port: int,
        upstream_host: str = HOST,
        *,
        port: int | None = None,
        connect_timeout: float = 2.0,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.connect_timeout = connect_timeout
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self.accepted = 0  # connections accepted so far
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((HOST, port if port is not None else free_port()))
        self._listener.listen(256)
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name=f"stall-proxy-{self.port}", daemon=True)
        self._acceptor.start()

    # -- the stall ------------------------------------------------------------------

    @property
    def is_stalled(self) -> bool:
        return not self._flowing.is_set()

    def stall(self) -> None:
        """Stop moving bytes, both ways, on every connection (new ones are accepted and held)."""
        self._flowing.clear()

    def resume(self) -> None:
        """Move bytes again: what was held is delivered."""
        self._flowing.set()

    @contextlib.contextmanager
    def stalled(self) -> Iterator[StallProxy]:
        """Stalled inside the block, resumed after it (also on an exception)."""
        self.stall()
        try:
            yield self
        finally:
            self.resume()

    # -- forwarding -----------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            self.accepted += 1
            threading.Thread(target=self._open, args=(client,), daemon=True).start()

    def _open(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=self.connect_timeout)
        except OSError:
            client.close()  # the server is down: the client sees its connection closed
            return
        upstream.settimeout(None)
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if self._closed.is_set():
                client.close()
                upstream.close()
                return
            self._sockets |= {client, upstream}
            ends = [2]  # pumps of this connection still running: the last one closes it
            pumps = [
                threading.Thread(target=self._pump, args=(a, b, ends), daemon=True)
                for a, b in ((client, upstream), (upstream, client))
            ]
            self._threads = [t for t in self._threads if t.is_alive()] + pumps
        for pump in pumps:
            pump.start()

    def _wait_flowing(self) -> bool:
        """Wait out a stall; False once the proxy is closing."""
        while not self._flowing.wait(_POLL):
            if self._closed.is_set():
                return False
        return not self._closed.is_set()

    def _pump(self, source: socket.socket, sink: socket.socket, ends: list[int]) -> None:
        """Move bytes from ``source`` to ``sink`` until either end closes; then hang up both."""
        try:
            if hasattr(os, "splice"):
                self._splice(source, sink)
            else:  # pragma: no cover - not Linux
                self._copy(source, sink)
        except OSError:
            pass
        finally:
            self._hang_up(source, sink)
            with self._lock:
                ends[0] -= 1
                last = ends[0] == 0
                if last:
                    self._sockets -= {source, sink}
            if last:
                source.close()
                sink.close()

    def _splice(self, source: socket.socket, sink: socket.socket) -> None:
        read_end, write_end = os.pipe()
        try:
            with contextlib.suppress(OSError):
                fcntl.fcntl(write_end, _F_SETPIPE_SZ, CHUNK)
            src, dst = source.fileno(), sink.fileno()
            while True:
                if not self._wait_flowing():
                    return
                n = os.splice(src, write_end, CHUNK)
                if n == 0:
                    return  # end of stream
                if not self._wait_flowing():  # read just before a stall: held until resumed
                    return
                while n:
                    n -= os.splice(read_end, dst, n)
        finally:
            os.close(read_end)
            os.close(write_end)

    def _copy(self, source: socket.socket, sink: socket.socket) -> None:
        while self._wait_flowing():
            data = source.recv(CHUNK)
            if not data or not self._wait_flowing():
                return
            sink.sendall(data)

    def _hang_up(self, *sockets: socket.socket) -> None:
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def drop(self) -> None:
        """Close every connection open now (as a reset path); new ones are accepted."""
        with self._lock:
            sockets = list(self._sockets)
        self._hang_up(*sockets)

    # -- life -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting, close every connection, and end every thread (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._flowing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._acceptor.join(timeout=5)
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        self._hang_up(*sockets)
        for thread in threads:
            thread.join(timeout=5)
        for s in sockets:
            s.close()

    def __enter__(self) -> StallProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "stalled" if self.is_stalled else "flowing"
        return f"StallProxy({HOST}:{self.port} -> {self.upstream[0]}:{self.upstream[1]}, {state})"
