"""Loopback ports for the servers and engines the tests start.

A port is drawn below the kernel's ephemeral range (where outgoing connections take their
local ports) and checked free. A port the kernel handed out (``bind(0)``) and released is in
that range, and any outgoing connection may take it before the server binds it: CI runs failed
so twice (a Redis cluster bus; vLLM's ``torch.distributed`` store, ``EADDRINUSE``)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["HOST", "free_port", "port_is_free"]

HOST = "127.0.0.1"
_LOWEST = 10000


def port_is_free(port: int) -> bool:
    """Whether ``port`` can be bound on loopback now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _ephemeral_start() -> int:
    """The first port the kernel hands out to outgoing connections (32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(*, also_free_at: int | None = None) -> int:
    """A loopback TCP port below the ephemeral range that nobody listens on now (and, with
    ``also_free_at``, whose ``port + also_free_at`` is free and below that range too)."""
    high = _ephemeral_start() - (also_free_at or 0)
    for _ in range(500):
        port = random.randrange(_LOWEST, max(_LOWEST + 1, high))
        if port_is_free(port) and (also_free_at is None or port_is_free(port + also_free_at)):
            return port
    raise RuntimeError(f"no free loopback port found below {high}")
