"""``kvhal bench shared``'s stores: the servers it starts, and each store's raw client (the limit)
beside kvhal's framing of it."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np

from kvhal import env
from kvhal.tiers.remote.format import HEADER_BYTES

STORES = ("mooncake", "redis", "s3")


SECRET_VARIABLE = "KVHAL_REMOTE_SECRET"


@contextlib.contextmanager
def store_server(kind: str, url: str | None, segment_bytes: int) -> Iterator[tuple[str, str]]:
    """``(url, where)`` of the store ``kind``: ``url`` as given, else a server started on loopback."""
    if url:
        yield url, "given"
        return
    if kind == "mooncake":
        from kvhal.testing.mooncake_servers import MooncakeCluster

        segment = f"{max(256, -(-segment_bytes // (1 << 20)))}MB"
        with MooncakeCluster(segment=segment) as cluster:
            yield cluster.url, f"started on loopback: a master and a store node of {segment}"
    elif kind == "s3":
        from kvhal.testing.seaweedfs_servers import SeaweedS3

        with SeaweedS3() as s3:
            # the credentials in the AWS variables, where kvhal's store (and an engine) reads them
            saved = {name: os.environ.get(name) for name in s3.credentials}
            os.environ.update(s3.credentials)
            try:
                yield s3.url(prefix="bench"), "started on loopback: one SeaweedFS (weed server -s3)"
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
    else:
        from kvhal.testing.redis_servers import RedisServer

        with RedisServer() as server:
            yield server.url, "started on loopback: one redis-server, persistence off"


class MooncakeLimit:
    """A raw Mooncake client (no kvhal): ``batch_put_from`` / ``batch_get_into`` of registered rows."""

    name = "MooncakeDistributedStore batch_put_from / batch_get_into"

    def __init__(self, url: str) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        from kvhal.tiers.stores.mooncake_url import parse_url, route_address

        options = parse_url(url)
        local = options.local_host or route_address(options.host, options.port)
        self.client = MooncakeDistributedStore()
        rc = self.client.setup(
            local, options.metadata, 0, options.buffer, options.protocol, options.device, options.master
        )
        if rc != 0:
            raise RuntimeError(f"{options.where}: a raw Mooncake client's setup returned {rc}")
        self.config = ReplicateConfig()
        self.config.replica_num = options.replicas
        self._registered: list[int] = []

    def register(self, rows: np.ndarray) -> None:
        address = int(rows.ctypes.data)
        rc = int(self.client.register_buffer(address, rows.nbytes))
        if rc != 0:
            raise RuntimeError(f"registering {rows.nbytes} bytes with Mooncake failed (rc {rc})")
        self._registered.append(address)

    def unregister(self) -> None:
        for address in self._registered:
            self.client.unregister_buffer(address)
        self._registered.clear()

    def put(self, names: list[str], rows: np.ndarray) -> int:
        """Put each row under its name; the number that failed."""
        base, size = int(rows.ctypes.data), rows.shape[1]
        ptrs = [base + i * size for i in range(len(names))]
        codes = self.client.batch_put_from(names, ptrs, [size] * len(names), self.config)
        return sum(1 for code in codes if code != 0)

    def get(self, names: list[str], rows: np.ndarray) -> int:
        """Get each name into its row; the number that failed."""
        base, size = int(rows.ctypes.data), rows.shape[1]
        ptrs = [base + i * size for i in range(len(names))]
        codes = self.client.batch_get_into(names, ptrs, [size] * len(names))
        return sum(1 for code in codes if code != size)

    def remove(self, names: list[str]) -> None:
        for first in range(0, len(names), 1024):
            self.client.batch_remove(names[first : first + 1024], True)

    def close(self) -> None:
        self.unregister()
        self.client.close()


class RedisLimit:
    """A plain redis-py client (no kvhal): one pipeline of SET or GET per batch."""

    name = "redis-py pipeline SET / GET"
    #: bytes before the block in a value (RedisFramed's header)
    offset = 0

    def __init__(self, url: str) -> None:
        import redis
        from redis.cluster import RedisCluster

        parts = urlsplit(url)
        query = dict(kv.split("=", 1) for kv in parts.query.split("&") if "=" in kv)
        options: dict[str, Any] = {
            "host": parts.hostname,
            "port": parts.port or 6379,
            "username": unquote(parts.username) if parts.username else env.read("KVHAL_REDIS_USERNAME"),
            "password": unquote(parts.password) if parts.password else env.read("KVHAL_REDIS_PASSWORD"),
            "socket_timeout": 60.0,
        }
        if parts.scheme.startswith("rediss"):
            options["ssl"] = True
            if "ssl_ca_certs" in query:
                options["ssl_ca_certs"] = unquote(query["ssl_ca_certs"])
        if parts.scheme.endswith("+cluster"):
            self.client: Any = RedisCluster(**options)
        else:
            path = parts.path.strip("/")
            self.client = redis.Redis(db=int(path) if path else 0, **options)
        self.client.ping()

    def register(self, rows: np.ndarray) -> None:
        pass

    def unregister(self) -> None:
        pass

    def put(self, names: list[str], rows: np.ndarray) -> int:
        pipe = self.client.pipeline(transaction=False)
        for name, row in zip(names, rows, strict=True):
            pipe.set(name, memoryview(row))
        return sum(1 for reply in pipe.execute(raise_on_error=False) if reply is not True)

    def get(self, names: list[str], rows: np.ndarray) -> int:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        failed = 0
        for reply, row in zip(pipe.execute(raise_on_error=False), rows, strict=True):
            if isinstance(reply, bytes) and len(reply) == self.offset + row.nbytes:
                row[:] = np.frombuffer(reply, np.uint8, offset=self.offset)
            else:
                failed += 1
        return failed

    def remove(self, names: list[str]) -> None:
        for first in range(0, len(names), 1024):
            pipe = self.client.pipeline(transaction=False)
            for name in names[first : first + 1024]:
                pipe.unlink(name)
            pipe.execute(raise_on_error=False)

    def close(self) -> None:
        self.client.close()


class MooncakeFramed(MooncakeLimit):
    """The raw client moving values shaped as kvhal's: a 96-byte header row (registered, zeros)
    and the block, two slices per value (``batch_put_from_multi_buffers``); no crc, no checks."""

    name = "MooncakeDistributedStore, 96-byte header + block as 2 slices (kvhal's shape)"

    def register(self, rows: np.ndarray) -> None:
        super().register(rows)
        self._headers = np.zeros((rows.shape[0], HEADER_BYTES), np.uint8)
        super().register(self._headers)
        self._base, self._block = int(rows.ctypes.data), rows.shape[1]

    def _slices(self, rows: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
        base = int(rows.ctypes.data)
        first = (base - self._base) // self._block
        headers = int(self._headers.ctypes.data) + first * HEADER_BYTES
        ptrs = [[headers + i * HEADER_BYTES, base + i * self._block] for i in range(rows.shape[0])]
        return ptrs, [[HEADER_BYTES, self._block]] * rows.shape[0]

    def put(self, names: list[str], rows: np.ndarray) -> int:
        ptrs, sizes = self._slices(rows)
        codes = self.client.batch_put_from_multi_buffers(names, ptrs, sizes, self.config)
        return sum(1 for code in codes if code != 0)

    def get(self, names: list[str], rows: np.ndarray) -> int:
        ptrs, sizes = self._slices(rows)
        codes = self.client.batch_get_into_multi_buffers(names, ptrs, sizes)
        return sum(1 for code in codes if code != HEADER_BYTES + self._block)


class RedisFramed(RedisLimit):
    """redis-py moving values shaped as kvhal's: a 96-byte header and the block joined into one
    value (a copy, as kvhal's RedisStore joins its two parts), ``SET NX``; no crc, no checks."""

    name = "redis-py, 96-byte header + block joined (kvhal's shape), SET NX / GET"
    offset = HEADER_BYTES
    header = bytes(HEADER_BYTES)

    def put(self, names: list[str], rows: np.ndarray) -> int:
        pipe = self.client.pipeline(transaction=False)
        for name, row in zip(names, rows, strict=True):
            pipe.set(name, b"".join((self.header, memoryview(row))), nx=True)
        return sum(1 for reply in pipe.execute(raise_on_error=False) if reply is not True)


class S3Limit:
    """obstore's own client (no kvhal), built as kvhal's store builds it: one ``put_async`` /
    ``get_range_async`` per row, a batch gathered on an event loop."""

    name = "obstore put / get_range, a batch gathered"
    #: bytes before the block in a value (S3Framed's header)
    offset = 0

    def __init__(self, url: str) -> None:
        import obstore

        from kvhal.tiers.stores.s3 import S3Store

        self.obstore = obstore
        self.store = S3Store.from_url(url)  # (its connect check; the raw client below it is used)
        self.client = self.store.object_store

    def register(self, rows: np.ndarray) -> None:
        pass

    def unregister(self) -> None:
        pass

    def _values(self, rows: np.ndarray) -> list[Any]:
        return [memoryview(row) for row in rows]

    def put(self, names: list[str], rows: np.ndarray) -> int:
        async def batch() -> list[object]:
            puts = (
                self.obstore.put_async(self.client, n, v)
                for n, v in zip(names, self._values(rows), strict=True)
            )
            return await asyncio.gather(*puts, return_exceptions=True)

        return sum(1 for r in asyncio.run(batch()) if isinstance(r, BaseException))

    def get(self, names: list[str], rows: np.ndarray) -> int:
        size = self.offset + rows.shape[1]

        async def batch() -> list[object]:
            gets = (self.obstore.get_range_async(self.client, n, start=0, length=size) for n in names)
            return await asyncio.gather(*gets, return_exceptions=True)

        failed = 0
        for data, row in zip(asyncio.run(batch()), rows, strict=True):
            if isinstance(data, BaseException) or len(data) != size:
                failed += 1
            else:
                row[:] = np.frombuffer(data, np.uint8, offset=self.offset)
        return failed

    def remove(self, names: list[str]) -> None:
        for first in range(0, len(names), 1000):
            self.obstore.delete(self.client, names[first : first + 1000])

    def close(self) -> None:
        self.store.close()


class S3Framed(S3Limit):
    """obstore moving values shaped as kvhal's: a 96-byte header and the block joined into one
    object (a copy, as kvhal's S3Store joins its two parts), ``If-None-Match: *``; no crc, no checks."""

    name = "obstore, 96-byte header + block joined (kvhal's shape), create / get_range"
    offset = HEADER_BYTES
    header = bytes(HEADER_BYTES)

    def put(self, names: list[str], rows: np.ndarray) -> int:
        async def batch() -> list[object]:
            puts = (
                self.obstore.put_async(
                    self.client, n, b"".join((self.header, memoryview(row))), mode="create"
                )
                for n, row in zip(names, rows, strict=True)
            )
            return await asyncio.gather(*puts, return_exceptions=True)

        return sum(1 for r in asyncio.run(batch()) if isinstance(r, BaseException))


#: per store: its own client moving plain blocks (the limit), and moving kvhal-shaped values
LIMITS = {"mooncake": MooncakeLimit, "redis": RedisLimit, "s3": S3Limit}


FRAMED = {"mooncake": MooncakeFramed, "redis": RedisFramed, "s3": S3Framed}
