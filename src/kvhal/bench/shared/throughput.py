"""``kvhal bench shared``'s throughput half: kvhal's remote tier and the store's raw client, put and
get of the same blocks, batch by batch."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from rich.progress import Progress

from kvhal.bench.common import KEY_BYTES, size_name
from kvhal.bench.shared.report import TARGET_SHARE
from kvhal.bench.shared.stores import FRAMED, LIMITS, MooncakeLimit, RedisLimit, store_server
from kvhal.offload.host_tier import HostTier
from kvhal.tiers.backend import OK, ReadOutcome, TierSpec
from kvhal.tiers.remote.tier import RemoteTier

#: Host buffers of one side of one row (write ring + read ring) stay under this.
MAX_POOL_BYTES = 1 << 30


NOISE_BYTES = 4 << 20


STAMP = np.dtype("<u8")


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

        def count_get(outcomes: list[ReadOutcome], first: int, n: int, pos: int) -> int:
            bad = sum(1 for outcome in outcomes if outcome is not OK)
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
