"""Redis reads received straight into host slots: kvhal's own pipelined ``GETRANGE`` reader.

A value read through a client library is parsed on the library's thread, turned into a
Python ``bytes`` object and copied again into its slot: 148 us of the calling thread and
137 us of glide's per 192 KiB block here (BENCHMARKS.md). This reader sends a batch's
``GETRANGE name 0 SIZE`` commands on a socket of its own and receives each reply's payload by
``recv`` into the slot's memory, the GIL released (:mod:`kvhal.tiers.stores._resp`, C).

It serves one plain-TCP server (``redis://``); TLS and clusters go through valkey-glide, as do
all writes. A call that times out, meets a closed connection or a malformed reply drops its
connection and raises :class:`StoreUnavailable`; the next call connects again.
"""

from __future__ import annotations

import queue
import select
import socket
import time
from collections.abc import Sequence
from typing import Any

from kvhal.tiers.remote.store import ABSENT, FAILED, StoreUnavailable

try:
    from kvhal.tiers.stores import _resp
except ImportError:  # built without a C compiler: glide or redis-py reads
    _resp = None

#: commands per round trip (as the other clients' pipelines): a batch's replies wait in the
#: server's memory until read, so a round trip holds at most this many values
BATCH_COMMANDS = 128
#: idle connections kept (the remote tier runs at most this many calls at once)
POOL_SIZE = 4
#: the longest simple reply (AUTH, SELECT) read while connecting
_MAX_LINE = 4096


def unsupported(target: Any) -> str | None:
    """Why ``target`` (a parsed ``redis://`` URL) cannot be read here, or None."""
    if _resp is None:
        return "kvhal's Redis reader was not built (no C compiler at install)"
    if target.cluster:
        return "a cluster (its slots are glide's to route)"
    if target.tls:
        return "TLS (glide's)"
    return None


def _command(*words: bytes) -> bytes:
    return b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)


class DirectReader:
    """``GETRANGE`` reads of one Redis server into caller buffers. Thread-safe: each call
    takes a connection of its own from a small pool."""

    def __init__(self, target: Any, what: str) -> None:
        assert unsupported(target) is None
        self._target = target
        self._what = what
        self._idle: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()
        self._closed = False

    def _connect(self, deadline: float) -> socket.socket:
        t = self._target
        try:
            sock = socket.create_connection((t.host, t.port), timeout=max(0.001, deadline - time.monotonic()))
        except OSError as exc:
            raise StoreUnavailable(f"{self._what}: {type(exc).__name__}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if t.password is not None:
                user = [t.username.encode()] if t.username else []
                self._simple(sock, _command(b"AUTH", *user, t.password.encode()), "AUTH", deadline)
            if t.db:
                self._simple(sock, _command(b"SELECT", str(t.db).encode()), "SELECT", deadline)
        except BaseException:
            sock.close()
            raise
        return sock

    def _simple(self, sock: socket.socket, command: bytes, what: str, deadline: float) -> None:
        """Send ``command`` and expect ``+OK`` by ``deadline`` (the server's words are not
        quoted: a message is no place to find out whether they echo a credential)."""
        try:
            _remaining(sock, deadline)
            sock.sendall(command)
            reply = b""
            while not reply.endswith(b"\r\n"):
                _remaining(sock, deadline)
                chunk = sock.recv(_MAX_LINE)
                if not chunk or len(reply) + len(chunk) > _MAX_LINE:
                    raise OSError("the server closed the connection or answered too long a line")
                reply += chunk
        except OSError as exc:
            raise StoreUnavailable(f"{self._what}: {what}: {type(exc).__name__}: {exc}") from exc
        if not reply.startswith(b"+OK"):
            raise StoreUnavailable(f"{self._what}: {what} was refused")

    def _take(self, deadline: float) -> socket.socket:
        """An idle connection the server has not closed meanwhile (a restart, an idle
        timeout: it reads as the end of the stream), else a new one."""
        while True:
            try:
                sock = self._idle.get_nowait()
            except queue.Empty:
                return self._connect(deadline)
            # an idle connection has nothing to read; a closed one reads as readable (its end)
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            try:
                readable = bool(poller.poll(0))
            except OSError:
                readable = True
            if not readable:
                return sock
            sock.close()

    def getrange_into(self, names: Sequence[str], buffers: Sequence[Sequence[memoryview]]) -> list[int]:
        """Read ``names[i]``'s value into ``buffers[i]`` (writable byte views, in order): per
        name, its length, :data:`ABSENT` or :data:`FAILED` (refused, or longer than its buffers).
        The whole call, connecting included, has the URL's timeout.

        :raises StoreUnavailable: the server did not answer in time, or answered garbage.
        """
        if self._closed:
            raise StoreUnavailable(f"{self._what}: the store is closed")
        if not names:
            return []
        deadline = time.monotonic() + self._target.timeout
        sock = self._take(deadline)
        results: list[int] = []
        try:
            for first in range(0, len(names), BATCH_COMMANDS):
                batch = range(first, min(first + BATCH_COMMANDS, len(names)))
                sizes = [sum(part.nbytes for part in buffers[i]) for i in batch]
                _remaining(sock, deadline)
                sock.sendall(
                    b"".join(
                        _command(b"GETRANGE", names[i].encode(), b"0", str(size).encode())
                        for i, size in zip(batch, sizes, strict=True)
                    )
                )
                left = max(0.0, deadline - time.monotonic())
                replies = _resp.read_getrange(sock.fileno(), [buffers[i] for i in batch], left)
                results.extend(ABSENT if r == 0 else FAILED if r < 0 else r for r in replies)
        except OSError as exc:  # ConnectionError from the reader, or the send's
            sock.close()
            self._drop_idle()  # a restart closed them too: the next call connects afresh
            raise StoreUnavailable(f"{self._what}: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        if self._idle.qsize() >= POOL_SIZE:
            sock.close()
        else:
            self._idle.put(sock)
            if self._closed:  # closed meanwhile: this one was not there to close
                self._drop_idle()
        return results

    def _drop_idle(self) -> None:
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return

    def close(self) -> None:
        self._closed = True
        self._drop_idle()


def _remaining(sock: socket.socket, deadline: float) -> None:
    """Give ``sock``'s next operation what is left until ``deadline``; raise once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    sock.settimeout(left)
