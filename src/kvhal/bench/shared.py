"""The shared tier: put/get throughput beside each store's own client, TTFT of a shared hit.

Throughput: for each store (Mooncake Store and Redis, each started here on
loopback unless ``--mooncake-url`` / ``--redis-url`` names one), block size and
batch size, kvhal's :class:`~kvhal.tiers.remote.tier.RemoteTier` (``io`` role, over a
CPU :class:`~kvhal.offload.host_tier.HostTier` holding the blocks: random bytes) puts
``--gib`` of blocks, then gets them back into other host slots, with
``--inflight`` batches in flight as futures, the way the connector's workers
drive it. Every get is verified: every outcome OK (kvhal checked header and
crc32c), a stamp in each block naming it, and the last blocks compared byte
for byte with what was put. Beside each row, in the same run, the limit: the
store's own client moving the same bytes without kvhal, in the same batches
with as many in flight (on as many threads):

- Mooncake: a raw ``MooncakeDistributedStore`` (same master, same options),
  ``batch_put_from`` / ``batch_get_into`` between a registered buffer and the
  store;
- Redis: a plain redis-py client, one pipeline of ``SET`` (or ``GET``) per
  batch; the ``GET`` replies are copied into the destination buffer, as kvhal
  copies them into its host slots.

What kvhal adds: a 96-byte header per value (:mod:`kvhal.tiers.remote.format`), its
crc32c on put and the check of header and crc32c on get; with Mooncake the
header is a second slice of each value (the header rows and the host slot are
apart), with Redis header and block are joined into one value (a copy) on put.
The HMAC of ``KVHAL_REMOTE_SECRET`` is not measured: the bench runs without the
secret (unset for its run, engines included). With ``--framed`` (the default) a
third side tells the value's shape from kvhal's own work: the store's own
client moving kvhal-shaped values (a zeroed 96-byte header and the block, as
two slices or joined), without kvhal's names, crc32c or checks.

Each row is measured ``--rounds`` times; which side goes first rotates from
round to round, so a machine whose speed drifts hits every side alike. GB/s
are medians over the rounds, shares the medians of each round's ratios. Key
names are fresh for every measurement (a put never meets an existing name),
and each round's names are removed from the store once it is measured; before
the first row, the store's memory is touched once (untimed). GB/s counts the
blocks' bytes (1e9 bytes/s), not the headers.

TTFT (``--e2e``) on ``kvhal bench e2e``'s model, each engine in its own
process: recompute (an engine without kvhal), a host hit (kvhal's host tier,
after ``reset_prefix_cache``) and, for each store of ``--e2e-stores``, a shared
hit: engine A (``remote_url``, an ample host tier) serves the prompts and
exits once its writes landed; a fresh engine B on the same store, with a
host tier too small to matter, serves the same prompts from the store.
``remote_loaded_blocks`` says how many blocks engine B read from the store.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvhal import env
from kvhal.bench.common import console as make_console
from kvhal.bench.common import result_header, write_outputs
from kvhal.bench.disk import parse_size, size_name
from kvhal.offload.host_tier import HostTier
from kvhal.tiers.backend import TierSpec
from kvhal.tiers.remote.format import HEADER_BYTES
from kvhal.tiers.remote.tier import RemoteTier

#: Targets from the issue.
TARGET_SHARE = 0.8
TARGET_SHARED_VS_RECOMPUTE = 0.2
#: Host buffers of one side of one row (write ring + read ring) stay under this.
MAX_POOL_BYTES = 1 << 30
KEY_BYTES = 36  # a vLLM 0.32 OffloadKey: 32-byte hash + 4-byte group
STORES = ("mooncake", "redis")
SECRET_VARIABLE = "KVHAL_REMOTE_SECRET"
NOISE_BYTES = 4 << 20
STAMP = np.dtype("<u8")


# ---------------------------------------------------------------------- servers


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
    else:
        from kvhal.testing.redis_servers import RedisServer

        with RedisServer() as server:
            yield server.url, "started on loopback: one redis-server, persistence off"


# ---------------------------------------------------------------------- the limits: the stores' own clients


class MooncakeLimit:
    """A raw Mooncake client (no kvhal): ``batch_put_from`` / ``batch_get_into`` of registered rows."""

    name = "MooncakeDistributedStore batch_put_from / batch_get_into"

    def __init__(self, url: str) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        from kvhal.tiers.stores.mooncake import _route_address, parse_url

        options = parse_url(url)
        local = options.local_host or _route_address(options.host, options.port)
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


#: per store: its own client moving plain blocks (the limit), and moving kvhal-shaped values
LIMITS = {"mooncake": MooncakeLimit, "redis": RedisLimit}
FRAMED = {"mooncake": MooncakeFramed, "redis": RedisFramed}


# ---------------------------------------------------------------------- rows


def fill_noise(rows: np.ndarray) -> None:
    """Random bytes in every row (4 MiB of noise, tiled; the stamps make each block unique)."""
    whole = rows.reshape(-1)
    noise = np.random.default_rng(0).integers(0, 256, min(whole.size, NOISE_BYTES), dtype=np.uint8)
    for start in range(0, whole.size, noise.size):
        whole[start : start + noise.size] = noise[: whole.size - start]


def stamp(rows: np.ndarray, values: np.ndarray) -> None:
    """Write ``values`` (u64) into the first 8 bytes of ``rows``."""
    rows[:, :8] = values.astype(STAMP).view(np.uint8).reshape(-1, 8)


def stamps_differ(rows: np.ndarray, values: np.ndarray) -> int:
    """How many of ``rows`` do not start with their ``values``."""
    found = np.ascontiguousarray(rows[:, :8]).view(STAMP).reshape(-1)
    return int(np.count_nonzero(found != values))


class Measurement:
    """One side's timed put or get of ``blocks`` blocks, ``depth`` batches in flight.

    ``submit(first, n, pos)`` starts a batch (blocks ``first..first+n``, ring rows
    ``pos..pos+n``) and returns a future of its failure count.
    """

    def __init__(self, blocks: int, batch: int, depth: int) -> None:
        self.blocks, self.batch, self.depth = blocks, batch, depth

    def run(
        self,
        submit: Callable[[int, int, int], Future],
        count_failed: Callable[[Any, int, int, int], int],
        before: Callable[[int, int, int], None] | None = None,
    ) -> tuple[float, int]:
        pending: deque = deque()
        failed = 0

        def finish() -> int:
            future, first, n, pos = pending.popleft()
            return count_failed(future.result(), first, n, pos)

        start = time.perf_counter()
        for k, first in enumerate(range(0, self.blocks, self.batch)):
            if len(pending) >= self.depth:
                failed += finish()
            pos = (k % self.depth) * self.batch  # batches in flight never share a row
            n = min(self.batch, self.blocks - first)
            if before is not None:
                before(first, n, pos)
            pending.append((submit(first, n, pos), first, n, pos))
        while pending:
            failed += finish()
        return time.perf_counter() - start, failed


class Side:
    """What one side (kvhal or the limit) needs for a row: rows to put from and get into, names."""

    rows: np.ndarray  # [2 * ring, block]: the write ring, then the read ring
    ring: int

    def put_rows(self, pos: int, n: int) -> np.ndarray:
        return self.rows[pos : pos + n]

    def get_rows(self, pos: int, n: int) -> np.ndarray:
        return self.rows[self.ring + pos : self.ring + pos + n]

    def bytes_equal(self, used: int) -> bool:
        """Whether the read ring holds what the write ring put (the last blocks of each ring row)."""
        return bool(np.array_equal(self.rows[:used], self.rows[self.ring : self.ring + used]))


class KvhalSide(Side):
    """kvhal's RemoteTier (``io`` role) over a CPU host tier of ``2 * ring`` slots."""

    def __init__(self, url: str, device: Any, block_bytes: int, ring: int) -> None:
        self.ring = ring
        self.host = HostTier(device, 2 * ring * block_bytes, block_bytes)
        memory = np.frombuffer(self.host.memory(), np.uint8)
        self.rows = memory[: 2 * ring * block_bytes].reshape(2 * ring, block_bytes)
        fill_noise(self.rows)
        spec = TierSpec({}, block_bytes, fingerprint={"benchmark": "kvhal bench shared"}, role="io")
        try:
            self.tier = RemoteTier(url, spec, host=self.host, secret=None, strict=True)
        except BaseException:
            self.host.close()
            raise

    def names(self, keys: list[bytes]) -> list[str]:
        return self.tier.names(keys)

    def measure(self, m: Measurement, keys: list[bytes], base: int, *, put: bool) -> tuple[float, int]:
        tier, ring = self.tier, self.ring
        if put:

            def submit(first: int, n: int, pos: int) -> Future:
                return tier.write(keys[first : first + n], range(pos, pos + n))

            def before(first: int, n: int, pos: int) -> None:
                stamp(self.put_rows(pos, n), np.arange(base + first, base + first + n))

            def count(outcomes: list[bool], first: int, n: int, pos: int) -> int:
                return sum(1 for ok in outcomes if ok is not True)

            return m.run(submit, count, before)

        def submit_get(first: int, n: int, pos: int) -> Future:
            return tier.read(keys[first : first + n], range(ring + pos, ring + pos + n))

        def count_get(outcomes: list[str | None], first: int, n: int, pos: int) -> int:
            bad = sum(1 for outcome in outcomes if outcome is not None)
            return bad or stamps_differ(self.get_rows(pos, n), np.arange(base + first, base + first + n))

        return m.run(submit_get, count_get)

    def close(self) -> None:
        self.tier.close()
        self.host.close()


class LimitSide(Side):
    """The store's own client over its own buffer of ``2 * ring`` rows, ``depth`` threads."""

    def __init__(self, limit: MooncakeLimit | RedisLimit, block_bytes: int, ring: int, depth: int) -> None:
        import mmap

        self.limit, self.ring = limit, ring
        self._memory = mmap.mmap(-1, 2 * ring * block_bytes)
        self.rows = np.frombuffer(self._memory, np.uint8).reshape(2 * ring, block_bytes)
        fill_noise(self.rows)
        limit.register(self.rows)
        self.threads = ThreadPoolExecutor(depth, "limit")

    def names(self, keys: list[bytes]) -> list[str]:
        return ["kvhal-bench-limit/" + key.hex() for key in keys]

    def measure(self, m: Measurement, keys: list[bytes], base: int, *, put: bool) -> tuple[float, int]:
        names, limit = self.names(keys), self.limit
        if put:

            def submit(first: int, n: int, pos: int) -> Future:
                return self.threads.submit(limit.put, names[first : first + n], self.put_rows(pos, n))

            def before(first: int, n: int, pos: int) -> None:
                stamp(self.put_rows(pos, n), np.arange(base + first, base + first + n))

            return m.run(submit, lambda failed, first, n, pos: failed, before)

        def submit_get(first: int, n: int, pos: int) -> Future:
            return self.threads.submit(limit.get, names[first : first + n], self.get_rows(pos, n))

        def count_get(failed: int, first: int, n: int, pos: int) -> int:
            return failed or stamps_differ(self.get_rows(pos, n), np.arange(base + first, base + first + n))

        return m.run(submit_get, count_get)

    def close(self) -> None:
        self.threads.shutdown(wait=True)
        self.limit.unregister()
        del self.rows
        with contextlib.suppress(BufferError):
            self._memory.close()


class Keys:
    """Fresh keys: every call names blocks no earlier call named (in this process, this run)."""

    def __init__(self) -> None:
        self.run = time.time_ns().to_bytes(8, "big") + os.getpid().to_bytes(4, "big")
        self.count = 0

    def fresh(self, n: int) -> tuple[list[bytes], int]:
        """``n`` new keys and a stamp base no other call shares."""
        self.count += 1
        head = self.run + self.count.to_bytes(4, "big")
        keys = [head + i.to_bytes(KEY_BYTES - len(head), "big") for i in range(n)]
        return keys, self.count << 32


def measure_row(
    kind: str,
    url: str,
    limits: dict[str, MooncakeLimit | RedisLimit],
    device: Any,
    block_bytes: int,
    blocks: int,
    batch: int,
    inflight: int,
    rounds: int,
    row_index: int,
    keys: Keys,
    step: Callable[[str], None],
) -> dict:
    """One (block, batch) row: kvhal's put and get, each beside the limit's (and the store's own
    client moving kvhal-shaped values, ``limits["framed"]``, if given), ``rounds`` times.

    Which side goes first rotates from round to round (and row to row); each round's names
    are fresh, and removed from the store once it is measured. GB/s are medians over the
    rounds, shares the medians of each round's ratios.
    """
    batch = min(batch, blocks)
    batches = -(-blocks // batch)
    depth = max(1, min(inflight, batches, MAX_POOL_BYTES // (2 * batch * block_bytes)))
    ring = depth * batch
    m = Measurement(blocks, batch, depth)
    limit = limits["limit"]
    sides: dict[str, KvhalSide | LimitSide] = {"kvhal": KvhalSide(url, device, block_bytes, ring)}
    made: list[str] = []
    per_round: list[dict[str, float]] = []
    orders: list[list[str]] = []
    failed: dict[str, int] = {}
    try:
        for who, client in limits.items():
            sides[who] = LimitSide(client, block_bytes, ring, depth)
        # untimed warm-up of every client (connections, the transfer engine's first transfers)
        for side in sides.values():
            warm, base = keys.fresh(batch)
            made += side.names(warm)
            side.measure(Measurement(batch, batch, 1), warm, base, put=True)
            side.measure(Measurement(batch, batch, 1), warm, base, put=False)
        equal = dict.fromkeys(sides, True)
        failed = {f"{who}_{d}": 0 for who in sides for d in ("put", "get")}
        for r in range(rounds):
            round_keys = {}
            for who, side in sides.items():
                round_keys[who] = keys.fresh(blocks)
                made += side.names(round_keys[who][0])
            seconds: dict[str, float] = {}
            shift = (r + row_index) % len(sides)
            order = list(sides)[shift:] + list(sides)[:shift]
            orders.append(order)
            for direction in ("put", "get"):
                for who in order:
                    step(f"round {r + 1}/{rounds}, {who} {direction}")
                    found, base = round_keys[who]
                    took, bad = sides[who].measure(m, found, base, put=direction == "put")
                    seconds[f"{who}_{direction}"] = took
                    failed[f"{who}_{direction}"] += bad
            for who, side in sides.items():
                equal[who] = equal[who] and side.bytes_equal(min(ring, blocks))
            per_round.append(seconds)
            limit.remove(made)
            made.clear()
    finally:
        for side in sides.values():
            side.close()
        limit.remove(made)
    moved = blocks * block_bytes
    gbps = [{k: moved / v / 1e9 for k, v in seconds.items()} for seconds in per_round]
    medians = {k: statistics.median(g[k] for g in gbps) for k in gbps[0]}

    def share(a: str, b: str, direction: str) -> float:
        return statistics.median(g[f"{a}_{direction}"] / g[f"{b}_{direction}"] for g in gbps)

    shares = {d: share("kvhal", "limit", d) for d in ("put", "get")}
    row = {
        "store": kind,
        "block_bytes": block_bytes,
        "batch": batch,
        "inflight": depth,
        "bytes": moved,
        "blocks": blocks,
        "rounds": rounds,
        "put_gbps": medians["kvhal_put"],
        "get_gbps": medians["kvhal_get"],
        "limit_put_gbps": medians["limit_put"],
        "limit_get_gbps": medians["limit_get"],
        "put_share": shares["put"],
        "get_share": shares["get"],
        "gbps_per_round": gbps,
        "order_per_round": orders,
        "failed_puts": failed["kvhal_put"],
        "failed_gets": failed["kvhal_get"],
        "limit_failed_puts": failed["limit_put"] + failed.get("framed_put", 0),
        "limit_failed_gets": failed["limit_get"] + failed.get("framed_get", 0),
        "bytes_equal": equal["kvhal"],
        "limit_bytes_equal": all(equal[who] for who in limits),
        "target_met": min(shares.values()) >= TARGET_SHARE,
    }
    if "framed" in sides:
        for d in ("put", "get"):
            row[f"framed_{d}_gbps"] = medians[f"framed_{d}"]
            row[f"framed_{d}_share"] = share("framed", "limit", d)  # what the value's shape costs
            row[f"kvhal_vs_framed_{d}"] = share("kvhal", "framed", d)  # what kvhal's own work costs
    return row


def warm_store(limit: MooncakeLimit | RedisLimit, keys: Keys, nbytes: int) -> None:
    """Put ``nbytes`` through the store's own client and remove them, untimed: the store's
    memory is touched once, so no measurement pays its first page faults."""
    block = 1 << 20
    ring, depth = 16, 4
    side = LimitSide(limit, block, ring, depth)
    made: list[str] = []
    try:
        found, base = keys.fresh(max(1, nbytes // block))
        made = side.names(found)
        side.measure(Measurement(len(found), ring // depth, depth), found, base, put=True)
    finally:
        side.close()
        limit.remove(made)


def throughput(
    stores: Sequence[str],
    urls: dict[str, str | None],
    nbytes: int,
    block_sizes: Sequence[int],
    batches: Sequence[int],
    inflight: int,
    rounds: int,
    framed: bool,
    progress: Progress,
) -> tuple[list[dict], dict[str, dict]]:
    """Every (store, block, batch) row, the limit measured beside each; and what each store was."""
    from kvhal.registry import select_device

    device = select_device("cpu")
    rows: list[dict] = []
    about: dict[str, dict] = {}
    keys = Keys()
    steps = len(stores) * len(block_sizes) * len(batches) * rounds * 2 * (2 + framed)
    task = progress.add_task("throughput", total=steps)
    # a store holds one round at a time: kvhal's values (with headers) and the limits', plus warm-ups
    largest = max(max(1, nbytes // b) * b + 2 * max(batches) * b for b in block_sizes)
    segment = (3 + framed) * largest + (64 << 20)
    for kind in stores:
        progress.update(task, description=f"{kind}: starting")
        with store_server(kind, urls.get(kind), segment) as (url, where):
            limits = {"limit": LIMITS[kind](urls.get(kind) or url)}
            if framed:
                limits["framed"] = FRAMED[kind](urls.get(kind) or url)
            limit = limits["limit"]
            about[kind] = {"where": where, **{who: client.name for who, client in limits.items()}}
            try:
                progress.update(task, description=f"{kind}: touching the store's memory once (untimed)")
                warm_store(limit, keys, 2 * largest)
                for block_bytes in block_sizes:
                    blocks = max(1, nbytes // block_bytes)
                    for batch in batches:
                        label = f"{kind} {size_name(block_bytes)} x {min(batch, blocks)}"

                        def step(what: str, label: str = label) -> None:
                            progress.update(task, description=f"{label}: {what}")
                            progress.advance(task)

                        rows.append(
                            measure_row(
                                kind,
                                url,
                                limits,
                                device,
                                block_bytes,
                                blocks,
                                batch,
                                inflight,
                                rounds,
                                len(rows),
                                keys,
                                step,
                            )
                        )
            finally:
                for client in limits.values():
                    client.close()
    progress.remove_task(task)
    return rows, about


# ---------------------------------------------------------------------- TTFT


def ttft(
    stores: Sequence[str],
    urls: dict[str, str | None],
    prompt_len: int,
    repeats: int,
    models: Path,
    progress: Progress,
) -> dict:
    """Recompute, host hit and a shared hit per store, medians of ``repeats`` distinct prompts."""
    from kvhal.bench.e2e import SHARING_ENV, _prompt, engine_args
    from kvhal.testing.models import BENCH_MODEL
    from kvhal.testing.scenario import run_scenario

    task = progress.add_task("TTFT: building the model", total=2 + 2 * len(stores))
    model = str(BENCH_MODEL.build(models))
    rng = random.Random(0)
    warm, *prompts = [_prompt(rng, prompt_len, BENCH_MODEL.vocab_size) for _ in range(repeats + 1)]
    fresh = _prompt(rng, prompt_len, BENCH_MODEL.vocab_size)
    env = SHARING_ENV
    engine = {**engine_args(prompt_len), "disable_log_stats": False}  # the remote_* metrics
    m = BENCH_MODEL  # one block's KV: layers x 32 tokens x KV heads x (K, V) x head size x bf16
    block_bytes = m.num_hidden_layers * 32 * m.num_key_value_heads * 2 * m.head_dim * 2
    # Room for one prompt's promotions and the warm-up's stores, nothing more (2048 tokens: 64 blocks).
    small_host = (2 * (prompt_len // 32) + 8) * block_bytes

    def gen(prompt: list[int], name: str) -> dict:
        return {"op": "generate", "prompts": [prompt], "max_tokens": 1, "name": name}

    def scenario(label: str, kvhal: dict | None, steps: list[dict]) -> dict:
        progress.update(task, description=f"TTFT: {label}")
        result = run_scenario({"model": model, "kvhal": kvhal, "steps": steps, "engine": engine, "env": env})
        progress.advance(task)
        return result

    def rows(result: dict, name: str) -> list[dict]:
        return [s for s in result["steps"] if s["name"] == name]

    def metrics(result: dict) -> dict:
        found = [s for s in result["steps"] if s["op"] == "metrics"][-1]["metrics"]
        return {k.removeprefix("vllm:kvhal_"): v for k, v in found.items() if "kvhal_" in k}

    def category(name: str, result: dict, store: str | None = None) -> dict:
        runs = rows(result, name)
        return {
            "category": name,
            "store": store,
            "ttft_s": statistics.median(s["seconds"] for s in runs),
            "ttft_all_s": [s["seconds"] for s in runs],
            "prompt_tokens": prompt_len,
            "cached_tokens": statistics.median(s["outputs"][0]["num_cached_tokens"] for s in runs),
            "kvhal_loaded_tokens": statistics.median(
                s["outputs"][0]["kvhal_loaded_tokens"] or 0 for s in runs
            ),
            "cached_tokens_all": [s["outputs"][0]["num_cached_tokens"] for s in runs],
            "kvhal_loaded_tokens_all": [s["outputs"][0]["kvhal_loaded_tokens"] or 0 for s in runs],
            "outputs": [s["outputs"][0]["tokens"] for s in runs],
        }

    recompute = scenario(
        "recompute (no kvhal)", None, [gen(warm, "warm-up")] + [gen(p, "recompute") for p in prompts]
    )
    host_steps = [gen(warm, "warm-up"), {"op": "reset"}, gen(warm, "warm-up")]
    for p in prompts:
        host_steps += [gen(p, "cold"), {"op": "reset"}, gen(p, "host hit")]
    host = scenario("host hit", {"cpu_bytes_to_use": 2 << 30}, host_steps)
    table = [category("recompute", recompute), category("host hit", host)]
    # A write to the store starts when a later engine step sees the host store done, and one
    # left unstarted when the process exits is lost: every engine ends with steps (a short prompt
    # decoding a few tokens), a pause for the writes, and one more step.
    drain = [
        {"op": "generate", "prompts": [fresh[:64]], "max_tokens": 8, "name": "drain"},
        {"op": "sleep", "seconds": 3},
        {"op": "generate", "prompts": [fresh[64:128]], "max_tokens": 8, "name": "drain"},
        {"op": "metrics"},
    ]
    shared: dict[str, dict] = {}
    for kind in stores:
        # each store's own server (or the one given): engine B finds only what engine A wrote
        with store_server(kind, urls.get(kind), 1 << 30) as (url, where):
            writer = scenario(
                f"{kind}: engine A writes the prompts to the store",
                {"cpu_bytes_to_use": 2 << 30, "remote_url": url},
                [gen(p, "populate") for p in (warm, *prompts)] + drain,
            )
            steps = [{**gen(fresh, "warm-up"), "max_tokens": 8}, {"op": "sleep", "seconds": 3}]
            steps += [gen(warm, "warm-up"), *(gen(p, "shared hit") for p in prompts), *drain]
            reader = scenario(
                f"{kind}: a fresh engine B reads them",
                {"cpu_bytes_to_use": small_host, "remote_url": url},
                steps,
            )
        row = category("shared hit", reader, kind)
        row["category"] = f"shared hit ({kind})"
        table.append(row)
        written, read = metrics(writer), metrics(reader)
        shared[kind] = {
            "where": where,
            "writer": {k: v for k, v in written.items() if k.startswith("remote_")},
            "reader": {k: v for k, v in read.items() if k.startswith("remote_")},
            "written_blocks": written.get("remote_written_blocks", 0),
            "loaded_blocks": read.get("remote_loaded_blocks", 0),
            "hit_tokens": read.get("remote_hit_tokens", 0),
            "refused_blocks": sum(
                read.get(f"remote_{c}_blocks", 0) for c in ("corrupt", "foreign", "unauthenticated")
            ),
        }
    progress.remove_task(task)
    by = {r["category"]: r["ttft_s"] for r in table}
    reference = table[0]["outputs"]
    for r in table:
        r["outputs_equal_recompute"] = r.pop("outputs") == reference
    return {
        "model": {"recipe": BENCH_MODEL.tag, "parameters": BENCH_MODEL.parameters},
        "block_bytes": block_bytes,
        "small_host_bytes": small_host,
        "rows": table,
        "host_vs_recompute": by["host hit"] / by["recompute"],
        "shared_vs_recompute": {k: by[f"shared hit ({k})"] / by["recompute"] for k in stores},
        "shared_vs_host": {k: by[f"shared hit ({k})"] / by["host hit"] for k in stores},
        "outputs_equal": all(r["outputs_equal_recompute"] for r in table),
        "shared": shared,
        "shared_hit_prompts": repeats + 1,  # the warm-up's shared hit counts too
    }


# ---------------------------------------------------------------------- report


def check_targets(rows: list[dict], e2e: dict | None) -> list[dict]:
    checks = []
    for kind in dict.fromkeys(r["store"] for r in rows):
        mine = [r for r in rows if r["store"] == kind]
        worst = min(min(r["put_share"], r["get_share"]) for r in mine)
        checks.append(
            {
                "target": f"{kind}: kvhal >= {TARGET_SHARE:.0%} of the store's own client, put and get "
                f"({sum(r['target_met'] for r in mine)}/{len(mine)} rows met; value: the worst share)",
                "value": worst,
                "met": all(r["target_met"] for r in mine),
            }
        )
    if e2e is not None:
        for kind, ratio in e2e["shared_vs_recompute"].items():
            checks.append(
                {
                    "target": f"shared hit ({kind}) TTFT <= {TARGET_SHARED_VS_RECOMPUTE}x recompute",
                    "value": ratio,
                    "met": ratio <= TARGET_SHARED_VS_RECOMPUTE and e2e["shared"][kind]["loaded_blocks"] > 0,
                }
            )
    return checks


def print_throughput(console: Console, result: dict) -> None:
    rows = result["throughput"]
    met = {True: "[green]yes[/green]", False: "[red]no[/red]"}
    for kind, about in result["stores"].items():
        mine = [r for r in rows if r["store"] == kind]
        framed = bool(mine) and "framed_put_gbps" in mine[0]
        table = Table(
            title=f"kvhal bench shared: {kind} ({about['where']}), "
            f"{size_name(mine[0]['bytes']) if mine else '?'} per measurement, medians of "
            f"{mine[0]['rounds'] if mine else '?'} rounds, GB/s = 1e9 bytes/s; limit: {about['limit']}"
            + (f"; shaped: {about['framed']}" if framed else "")
        )
        columns = ["block", "batch", "in flight", "put GB/s", "get GB/s", "limit put", "limit get"]
        columns += ["% of limit put/get", "target met"]
        if framed:
            columns += ["shaped put/get", "shaped % of limit", "kvhal % of shaped"]
        for column in columns:
            table.add_column(column, justify="right")
        for r in mine:
            cells = [
                size_name(r["block_bytes"]),
                str(r["batch"]),
                str(r["inflight"]),
                f"{r['put_gbps']:.2f}",
                f"{r['get_gbps']:.2f}",
                f"{r['limit_put_gbps']:.2f}",
                f"{r['limit_get_gbps']:.2f}",
                f"{r['put_share']:.0%} / {r['get_share']:.0%}",
                met[r["target_met"]],
            ]
            if framed:
                cells += [
                    f"{r['framed_put_gbps']:.2f} / {r['framed_get_gbps']:.2f}",
                    f"{r['framed_put_share']:.0%} / {r['framed_get_share']:.0%}",
                    f"{r['kvhal_vs_framed_put']:.0%} / {r['kvhal_vs_framed_get']:.0%}",
                ]
            table.add_row(*cells)
        console.print(table)
    failed = sum(r["failed_puts"] + r["failed_gets"] for r in rows)
    unequal = sum(not r["bytes_equal"] for r in rows)
    limit_failed = sum(
        r["limit_failed_puts"] + r["limit_failed_gets"] + (not r["limit_bytes_equal"]) for r in rows
    )
    if failed or unequal or limit_failed:
        console.print(
            f"[red]{failed} kvhal blocks failed to put or get back verified, {unequal} rows' bytes "
            f"differed; {limit_failed} failures of the stores' own clients[/red]"
        )
    else:
        console.print(
            "every block put was got back verified (kvhal's header and crc32c check, a stamp per block, "
            "the last blocks byte for byte), by kvhal and by the stores' own clients"
        )
    secret = "it was set and is unset for this run" if result["secret_was_set"] else "it was not set"
    console.print(
        f"kvhal adds a {HEADER_BYTES}-byte header per value, its crc32c on put and the check on get "
        f"(no HMAC: {SECRET_VARIABLE} not used; {secret})"
    )


def print_ttft(console: Console, e2e: dict | None) -> None:
    if e2e is None:
        return
    recompute = e2e["rows"][0]["ttft_s"]
    table = Table(title=f"TTFT, {e2e['rows'][0]['prompt_tokens']}-token prompt (kvhal bench e2e's model)")
    for column in ("", "TTFT (s)", "vs recompute", "cached tokens", "from kvhal", "outputs = recompute"):
        table.add_column(column, justify="right")
    for r in e2e["rows"]:
        table.add_row(
            r["category"],
            f"{r['ttft_s']:.4f}",
            f"{r['ttft_s'] / recompute:.3f}x",
            f"{r['cached_tokens']:.0f}",
            f"{r['kvhal_loaded_tokens']:.0f}",
            "yes" if r["outputs_equal_recompute"] else "[red]no[/red]",
        )
    console.print(table)
    for kind, s in e2e["shared"].items():
        reader = s["reader"]
        console.print(
            f"{kind}: engine A wrote {s['written_blocks']:.0f} blocks; fresh engine B was offered "
            f"{s['hit_tokens']:.0f} tokens from the store and read {s['loaded_blocks']:.0f} blocks "
            f"({e2e['shared_hit_prompts']} prompts and a warm-up's prefix), refused "
            f"{s['refused_blocks']:.0f}; loads failed {reader.get('remote_failed_loads', 0):.0f} "
            f"(of them timed out: {reader.get('remote_load_timeouts', 0):.0f}); shared hit "
            f"{e2e['shared_vs_host'][kind]:.2f}x the host hit"
        )
    console.print(
        "greedy outputs " + ("equal in every category" if e2e["outputs_equal"] else "[red]differ[/red]")
    )


def print_targets(console: Console, checks: list[dict]) -> None:
    for check in checks:
        verdict = "met" if check["met"] else "[red]MISSED[/red]"
        console.print(f"target {check['target']}: {verdict} ({check['value']:.3f})")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, e2e = result["throughput"], result["e2e"]
    stores = list(result["stores"])
    columns = 3 if e2e else 2
    fig = plt.figure(figsize=(5 * columns, 3.8 * max(1, len(stores))))
    grid = fig.add_gridspec(max(1, len(stores)), columns)
    blocks = sorted({r["block_bytes"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    for s, kind in enumerate(stores):
        for d, direction in enumerate(("put", "get")):
            ax = fig.add_subplot(grid[s, d])
            for i, batch in enumerate(batches):
                mine = sorted(
                    (r for r in rows if r["store"] == kind and r["batch"] == batch),
                    key=lambda r: r["block_bytes"],
                )
                xs = [r["block_bytes"] >> 10 for r in mine]
                ax.plot(
                    xs,
                    [r[f"{direction}_gbps"] for r in mine],
                    "o-",
                    color=f"C{i}",
                    label=f"kvhal, batch {batch}",
                )
                ax.plot(
                    xs,
                    [r[f"limit_{direction}_gbps"] for r in mine],
                    "x:",
                    color=f"C{i}",
                    alpha=0.7,
                    label=f"own client (limit), batch {batch}",
                )
                if mine and f"framed_{direction}_gbps" in mine[0]:
                    ax.plot(
                        xs,
                        [r[f"framed_{direction}_gbps"] for r in mine],
                        "+-.",
                        color=f"C{i}",
                        alpha=0.5,
                        linewidth=0.8,
                        label=f"own client, kvhal's value shape, batch {batch}",
                    )
            ax.set_xscale("log", base=2)
            ax.set_xticks([b >> 10 for b in blocks], [size_name(b) for b in blocks])
            ax.set_ylim(bottom=0)
            ax.set_xlabel("block")
            ax.set_ylabel("GB/s")
            ax.set_title(f"{kind} {direction}: kvhal vs the store's own client", fontsize=9)
            ax.legend(fontsize=7)
    if e2e:
        ax = fig.add_subplot(grid[:, 2])
        names = [r["category"] for r in e2e["rows"]]
        values = [r["ttft_s"] for r in e2e["rows"]]
        ax.bar(range(len(names)), values, color=["C3", "C0", "C2", "C4", "C5"][: len(names)])
        ax.set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=8)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3f}s\n({v / values[0]:.3f}x)", ha="center", va="bottom", fontsize=8)
        ax.axhline(
            TARGET_SHARED_VS_RECOMPUTE * values[0],
            color="r",
            linestyle=":",
            linewidth=1,
            label="0.2x recompute",
        )
        ax.set_ylabel("time to first token (s)")
        ax.set_title(f"TTFT, {e2e['rows'][0]['prompt_tokens']}-token prompt", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"kvhal bench shared ({result['machine'].get('git', '?')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stores", nargs="+", choices=STORES, default=list(STORES), help="stores to measure (default: both)"
    )
    parser.add_argument(
        "--mooncake-url",
        help="measure this Mooncake Store (mooncake://...) instead of starting one on loopback",
    )
    parser.add_argument(
        "--redis-url", help="measure this Redis (redis://...) instead of starting one on loopback"
    )
    parser.add_argument("--gib", type=float, default=0.25, help="GiB moved per measurement (default 0.25)")
    parser.add_argument(
        "--blocks",
        nargs="+",
        type=parse_size,
        default=[64 << 10, 256 << 10, 1 << 20, 2 << 20],
        help="block sizes (64K, 1M, ...; default 64K 256K 1M 2M)",
    )
    parser.add_argument(
        "--batches", nargs="+", type=int, default=[8, 64], help="blocks per batch (default 8 64)"
    )
    parser.add_argument("--inflight", type=int, default=4, help="batches in flight (default 4)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="measurements of each row, rotating which side goes first (medians; default 5)",
    )
    parser.add_argument(
        "--framed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure each store's own client moving kvhal-shaped values (96-byte header + block: "
        "Mooncake two slices, Redis one joined value), to tell the shape's cost from kvhal's own work",
    )
    parser.add_argument(
        "--e2e", action=argparse.BooleanOptionalAction, default=True, help="TTFT of a shared hit (engines)"
    )
    parser.add_argument(
        "--e2e-stores", nargs="+", choices=STORES, default=list(STORES), help="stores of the shared-hit TTFT"
    )
    parser.add_argument("--prompt-len", type=int, default=2048, help="TTFT prompt tokens (default 2048)")
    parser.add_argument("--repeats", type=int, default=3, help="distinct prompts per TTFT category")
    parser.add_argument("--models", type=Path, default=Path.home() / ".cache" / "kvhal-bench-models")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG")


def run(args: argparse.Namespace) -> int:
    console = make_console()
    urls = {"mooncake": args.mooncake_url, "redis": args.redis_url}
    nbytes = max(1, int(args.gib * (1 << 30)))
    secret = os.environ.pop(SECRET_VARIABLE, None)  # measured without the HMAC, engines included
    try:
        with Progress(console=console, transient=True) as progress:
            rows, about = throughput(
                args.stores,
                urls,
                nbytes,
                args.blocks,
                args.batches,
                args.inflight,
                args.rounds,
                args.framed,
                progress,
            )
            result = {
                **result_header("shared"),
                "inflight": args.inflight,
                "rounds": args.rounds,
                "stores": about,
                "secret_was_set": secret is not None,
                "header_bytes": HEADER_BYTES,
                "throughput": rows,
            }
            print_throughput(console, result)  # before the engines' minutes
            e2e = (
                ttft(args.e2e_stores, urls, args.prompt_len, args.repeats, args.models, progress)
                if args.e2e
                else None
            )
    finally:
        if secret is not None:
            os.environ[SECRET_VARIABLE] = secret
    result["e2e"] = e2e
    result["targets"] = check_targets(rows, e2e)
    print_ttft(console, e2e)
    print_targets(console, result["targets"])
    json_path, png_path = write_outputs(args.out, "shared", result)
    plot(result, png_path)
    console.print(f"wrote {json_path} and {png_path}")
    failed = sum(
        r["failed_puts"]
        + r["failed_gets"]
        + (not r["bytes_equal"])
        + r["limit_failed_puts"]
        + r["limit_failed_gets"]
        + (not r["limit_bytes_equal"])
        for r in rows
    )
    return 1 if failed else 0
