"""Redis reads and writes through valkey-glide's sync client: socket I/O and reply parsing in
its Rust core, with the GIL released.

redis-py (even with hiredis) reads a reply in many small ``recv`` calls, each taking the GIL
back. In an engine's process the engine's loop holds the GIL between its steps, so each take
waits up to the interpreter's switch interval. 60 values of 192 KiB (a returning user's
blocks): redis-py 0.02 s alone and 0.92 s beside a busy Python thread, glide 0.02 s and
0.04 s; 60 such writes (``SET NX``), redis-py 0.014 s and 0.37 s, glide 0.013 s and 0.023 s
(BENCHMARKS.md, "Redis reads and writes beside a busy thread"). Reads and writes go
through glide where it is installed, for one server and for a cluster (TLS included, with a
CA file and a client certificate as options); lookups (``EXISTS``, small replies) and TLS
options glide cannot express stay on redis-py. A cluster's batch is glide's non-atomic
``ClusterBatch``: glide sends each command to the master of its slot and answers in order.

A value is read with ``GETRANGE name 0 SIZE``: at most one byte more than the value can be,
so an oversized value planted under a block's name is never read whole.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvhal.tiers.remote.store import StoreUnavailable

try:  # the optional client (kvhal[redis] installs it)
    import glide_sync
except ImportError:  # pragma: no cover - redis-py reads instead
    glide_sync = None

#: commands per batch, and the value bytes one write batch holds at most (as redis-py's pipelines)
BATCH_COMMANDS = 128
BATCH_BYTES = 64 << 20
#: ``rediss://`` options glide's TLS takes (the others it cannot express: redis-py reads)
GLIDE_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
#: options that only tune redis-py's connection pool: no bearing on what glide reads
POOL_OPTIONS = ("max_connections", "health_check_interval", "socket_keepalive")


def unsupported(target: Any) -> str | None:
    """Why reads of ``target`` (a parsed ``redis://`` URL) cannot go through glide, or None."""
    if glide_sync is None:
        return "valkey-glide-sync is not installed"
    for name, value in target.options.items():
        if name in GLIDE_TLS_OPTIONS or name in POOL_OPTIONS:
            continue
        if (name, value) in (("ssl_cert_reqs", "required"), ("ssl_check_hostname", True)):
            continue  # what glide's TLS does anyway
        return f"the option {name}={value!r} (redis-py's TLS reads it)"
    return None


class GlideStoreClient:
    """One glide client for a Redis server's or cluster's reads and writes. Thread-safe (glide
    multiplexes)."""

    def __init__(self, target: Any, what: str) -> None:
        assert glide_sync is not None and unsupported(target) is None
        self._what = what
        timeout_ms = max(1, int(target.timeout * 1000))
        credentials = None
        if target.password is not None or target.username is not None:
            credentials = glide_sync.ServerCredentials(password=target.password, username=target.username)
        tls = None
        if target.tls:  # the server's certificate checked against the CA file, else the system's
            ca = target.options.get("ssl_ca_certs")
            tls = glide_sync.TlsAdvancedConfiguration(
                root_pem_cacerts=Path(ca).read_bytes() if ca else None,
                client_cert_path=target.options.get("ssl_certfile"),
                client_key_path=target.options.get("ssl_keyfile"),
            )
        common: dict[str, Any] = {
            "use_tls": target.tls,
            "credentials": credentials,
            "request_timeout": timeout_ms,
            # reconnect at least every 0.8 s while the server is away (glide's default backoff
            # grows past a request's timeout: the first write after a restart timed out)
            "reconnect_strategy": glide_sync.BackoffStrategy(num_of_retries=4, factor=50, exponent_base=2),
        }
        seed = [glide_sync.NodeAddress(target.host, target.port)]
        self._cluster = target.cluster
        if target.cluster:  # the seed node; glide learns the others and their slots from it
            self._config: Any = glide_sync.GlideClusterClientConfiguration(
                seed,
                **common,
                advanced_config=glide_sync.AdvancedGlideClusterClientConfiguration(
                    connection_timeout=timeout_ms, tls_config=tls
                ),
            )
        else:
            self._config = glide_sync.GlideClientConfiguration(
                seed,
                **common,
                database_id=target.db,
                advanced_config=glide_sync.AdvancedGlideClientConfiguration(
                    connection_timeout=timeout_ms, tls_config=tls
                ),
            )
        self._lock = threading.Lock()
        self._client: Any = None
        self._closed = False

    def connect(self) -> None:
        """Connect now (else the first read does).

        :raises StoreUnavailable: the server did not answer.
        """
        self._current()

    def _current(self) -> Any:
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"{self._what}: the store is closed")
            if self._client is None:
                kind = glide_sync.GlideClusterClient if self._cluster else glide_sync.GlideClient
                try:
                    self._client = kind.create(self._config)
                except glide_sync.GlideError as exc:
                    raise StoreUnavailable(f"{self._what}: {type(exc).__name__}: {exc}") from exc
            return self._client

    def getrange(self, names: Sequence[str], sizes: Sequence[int]) -> list[object]:
        """``GETRANGE name 0 size`` for each name: bytes (empty for a missing name), or the
        exception a refused command answered.

        :raises StoreUnavailable: the server did not answer.
        """
        client = self._current()
        replies: list[object] = []
        try:
            for first in range(0, len(names), BATCH_COMMANDS):
                batch = self._batch()
                for name, size in zip(names[first : first + BATCH_COMMANDS], sizes[first:], strict=False):
                    batch.getrange(name, 0, size)
                replies.extend(client.exec(batch, raise_on_error=False) or [])
        except glide_sync.GlideError as exc:
            raise StoreUnavailable(f"{self._what}: {type(exc).__name__}: {exc}") from exc
        return self._one_each(replies, len(names))

    def _batch(self) -> Any:
        """A new pipeline (non-atomic: a cluster's commands go to their slots' masters)."""
        kind = glide_sync.ClusterBatch if self._cluster else glide_sync.Batch
        return kind(is_atomic=False)

    def _one_each(self, replies: list[object], commands: int) -> list[object]:
        """``replies``, one per command sent; else the store's answer cannot be matched to them."""
        if len(replies) != commands:
            raise StoreUnavailable(f"{self._what}: {len(replies)} replies to {commands} commands")
        return replies

    def set_new(
        self, names: Sequence[str], values: Iterable[bytes | memoryview], ttl: int | None
    ) -> list[object]:
        """``SET name value NX [EX ttl]`` for each name and value (taken from ``values`` one at a
        time, as batches are filled): ``"OK"``, None where the name exists already, or the
        exception a refused command answered (a full server's OOM).

        :raises StoreUnavailable: the server did not answer.
        """
        client = self._current()
        expiry = glide_sync.ExpirySet(glide_sync.ExpiryType.SEC, ttl) if ttl else None
        only_new = glide_sync.ConditionalChange.ONLY_IF_DOES_NOT_EXIST
        replies: list[object] = []
        batch, queued, size = self._batch(), 0, 0
        try:
            for name, value in zip(names, values, strict=True):
                batch.set(name, value, conditional_set=only_new, expiry=expiry)
                queued, size = queued + 1, size + len(value)
                if queued == BATCH_COMMANDS or size >= BATCH_BYTES:
                    replies.extend(client.exec(batch, raise_on_error=False) or [])
                    batch, queued, size = self._batch(), 0, 0
            if queued:
                replies.extend(client.exec(batch, raise_on_error=False) or [])
        except glide_sync.GlideError as exc:
            raise StoreUnavailable(f"{self._what}: {type(exc).__name__}: {exc}") from exc
        return self._one_each(replies, len(names))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
