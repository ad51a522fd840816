"""The ``mooncake://`` URL of the Mooncake store (:mod:`kvhal.tiers.stores.mooncake`), parsed
and checked without connecting.

URL form (``remote_url``)::

    mooncake://HOST[:RPC_PORT]?metadata=http://MHOST:MPORT/metadata[&protocol=tcp][&OPTION=...]

``HOST:RPC_PORT`` is the Mooncake master's RPC address (port 50051 when left out, Mooncake's
default); ``metadata`` (required) is the transfer-engine metadata server, an ``http://`` or
``https://`` URL (the master serves one with ``--enable_http_metadata_server=true``). Options:

* ``protocol``: ``tcp`` (default) or ``rdma``. RDMA is what clusters use; only TCP was run
  here (on loopback), the RDMA path is Mooncake's and was not exercised by kvhal's tests.
* ``device``: the RDMA device names for ``protocol=rdma`` (e.g. ``mlx5_0,mlx5_1``; default:
  Mooncake discovers them).
* ``segment``: bytes this client contributes to the store (default 0: it only reads and
  writes). Suffixes ``K``/``KB``/``KiB``, ``M``/``MB``/``MiB``, ``G``/``GB``/``GiB``,
  ``T``/``TB``/``TiB`` are powers of 1024, as in Mooncake.
* ``buffer``: the size of Mooncake's own local staging buffer (default 16MB); kvhal's zero-copy
  calls do not use it.
* ``replicas``: copies of each value (default 1).
* ``local_host``: this host's address as the other nodes reach it; default: the local address
  of the interface that routes to HOST (``127.0.0.1`` for a master on loopback).
"""

from __future__ import annotations

import math
import re
import socket
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from kvhal.errors import ValidationError
from kvhal.tiers.remote.store import StoreUnavailable
from kvhal.tiers.remote.urls import redact

__all__ = ["MooncakeOptions", "parse_url", "route_address"]

ARGUMENT = "remote_url"
DEFAULT_RPC_PORT = 50051
DEFAULT_BUFFER = 16 << 20
OPTIONS = ("metadata", "protocol", "segment", "buffer", "replicas", "device", "local_host")
PROTOCOLS = ("tcp", "rdma")
UNITS = {"": 0, "B": 0, "K": 1, "M": 2, "G": 3, "T": 4}
SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*", re.IGNORECASE)


def _size(option: str, text: str) -> int:
    match = SIZE.fullmatch(text)
    if match is None or (match.group(3) and match.group(3).upper() == "IB" and not match.group(2)):
        raise ValidationError(ARGUMENT, f"{option}={text!r} is not a size (bytes, or e.g. 512MB, 4GB)")
    value = float(match.group(1)) * 1024 ** UNITS[match.group(2).upper()]
    if not math.isfinite(value) or value >= 1 << 63:
        raise ValidationError(ARGUMENT, f"{option}={text!r} is too large")
    return int(value)


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def route_address(host: str, port: int) -> str:
    """The local address of the interface that routes to ``host`` (a UDP connect sends nothing)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError as exc:
        where = f"mooncake master at {host_port(host, port)}"
        raise StoreUnavailable(f"{where}: no route from this host to it ({exc})") from exc


@dataclass(frozen=True)
class MooncakeOptions:
    """A parsed ``mooncake://`` URL (see the module's docstring)."""

    host: str
    port: int
    metadata: str
    protocol: str = "tcp"
    segment: int = 0
    buffer: int = DEFAULT_BUFFER
    replicas: int = 1
    device: str = ""
    local_host: str | None = None

    @property
    def master(self) -> str:
        """The master's RPC address, ``HOST:PORT``."""
        return host_port(self.host, self.port)

    @property
    def where(self) -> str:
        """The store, for messages."""
        return f"mooncake master at {self.master} (metadata {redact(self.metadata)})"


def parse_url(url: str) -> MooncakeOptions:
    """Parse a ``mooncake://`` URL without connecting.

    :raises ValidationError: (``remote_url``) a malformed URL or option, naming the bad part.
    """
    if not isinstance(url, str):
        raise ValidationError(ARGUMENT, f"must be a mooncake:// URL, got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme.lower() != "mooncake":
        raise ValidationError(ARGUMENT, f"scheme {parts.scheme!r} is not mooncake")
    if parts.username is not None or parts.password is not None:
        raise ValidationError(ARGUMENT, "a mooncake:// URL takes no user or password")
    if not parts.hostname:
        raise ValidationError(ARGUMENT, "no master host (mooncake://HOST:RPC_PORT?metadata=...)")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is None and parts.netloc.endswith(":"):
        port = -1
    if port == -1 or port == 0:
        bad = parts.netloc.rpartition(":")[2]
        raise ValidationError(ARGUMENT, f"master port {bad!r} is not a port number (1-65535)")
    if parts.path not in ("", "/"):
        raise ValidationError(ARGUMENT, f"unexpected path {parts.path!r} (options go in the query)")
    if parts.fragment:
        raise ValidationError(ARGUMENT, f"unexpected fragment {parts.fragment!r}")
    options: dict[str, str] = {}
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise ValidationError(ARGUMENT, f"malformed query {parts.query!r}: {exc}") from exc
    for key, value in pairs:
        if key not in OPTIONS:
            raise ValidationError(ARGUMENT, f"unknown option {key!r} (known: {', '.join(OPTIONS)})")
        if key in options:
            raise ValidationError(ARGUMENT, f"option {key!r} given twice")
        options[key] = value
    metadata = options.get("metadata", "")
    if not metadata:
        raise ValidationError(ARGUMENT, "missing metadata=http://HOST:PORT/metadata (the metadata server)")
    meta = urlsplit(metadata)
    try:
        meta_port = meta.port
    except ValueError:
        meta_port = -1
    if meta.scheme not in ("http", "https") or not meta.hostname or meta_port in (-1, 0):
        raise ValidationError(
            ARGUMENT, f"metadata={metadata!r} is not an http:// URL such as http://HOST:PORT/metadata"
        )
    protocol = options.get("protocol", "tcp")
    if protocol not in PROTOCOLS:
        raise ValidationError(ARGUMENT, f"protocol={protocol!r} is not one of {', '.join(PROTOCOLS)}")
    replicas_text = options.get("replicas", "1")
    if not replicas_text.isdigit() or not 1 <= int(replicas_text) <= 64:
        raise ValidationError(ARGUMENT, f"replicas={replicas_text!r} is not a count of copies (1-64)")
    buffer = _size("buffer", options["buffer"]) if "buffer" in options else DEFAULT_BUFFER
    device = options.get("device", "")
    if device and protocol != "rdma":
        raise ValidationError(ARGUMENT, f"device={device!r} needs protocol=rdma")
    local_host = options.get("local_host")
    if local_host is not None and (not local_host or any(c in local_host for c in "/?#@ ")):
        raise ValidationError(ARGUMENT, f"local_host={local_host!r} is not a host name or address")
    return MooncakeOptions(
        host=parts.hostname,
        port=DEFAULT_RPC_PORT if port is None else port,
        metadata=metadata,
        protocol=protocol,
        segment=_size("segment", options["segment"]) if "segment" in options else 0,
        buffer=buffer,
        replicas=int(replicas_text),
        device=device,
        local_host=local_host,
    )
