"""``kvhal bench disk``'s storage half: the disk tier against the device's raw limit, the index's
memory, and a warm restart."""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import random
import shutil
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
from rich.progress import Progress

from kvhal.bench.common import KEY_BYTES, size_name
from kvhal.registry import PluginRegistry
from kvhal.tiers.backend import OK, ReadOutcome, TierSpec
from kvhal.tiers.disk import DiskTier
from kvhal.tiers.disk.format import ALIGN, RECORD_BYTES, pack_record
from kvhal.tiers.disk.io import aligned_buffer, preadv_all, pwritev_all
from kvhal.tiers.index import TierIndex

#: Target from the issue: the tier moves this share of the limit, for blocks from this size.
TARGET_SHARE, TARGET_SHARE_FROM_BLOCK = 0.8, 256 << 10
#: The limit's request size (``dd bs=4M``).
LIMIT_CHUNK = 4 << 20
#: Host buffers of one row (batches in flight x batch x block) stay under this.
MAX_POOL_BYTES = 512 << 20


def _open_direct(path: str, flags: int) -> tuple[int, bool]:
    """``path`` opened with O_DIRECT where the file system takes it; ``(fd, direct)``."""
    try:
        fd = os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return os.open(path, flags | os.O_CLOEXEC), False
    try:
        os.preadv(fd, [aligned_buffer(ALIGN)], 0)
    except OSError:
        os.close(fd)
        return os.open(path, flags | os.O_CLOEXEC), False
    return fd, True


def drop_cache(paths: Sequence[str], sync: bool = True) -> None:
    """Flush ``paths`` and drop them from the page cache (no-op for pages O_DIRECT never cached)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if sync:
                os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential(fd: int, nbytes: int, buffer: memoryview, *, write: bool) -> None:
    """Move ``nbytes`` from offset 0 in ``len(buffer)``-byte requests, one at a time."""
    move = pwritev_all if write else preadv_all
    chunk = buffer.nbytes
    for offset in range(0, nbytes, chunk):
        move(fd, [buffer[: min(chunk, nbytes - offset)]], offset)


class Limit:
    """The disk's limit: a plain file moved sequentially in 4 MiB O_DIRECT requests (as ``dd``)."""

    def __init__(self, folder: str, nbytes: int) -> None:
        self.path = os.path.join(folder, "limit.bin")
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
        self.fd, self.direct = _open_direct(self.path, os.O_RDWR)
        self.buffer = aligned_buffer(LIMIT_CHUNK)
        self.buffer[:] = np.random.default_rng(1).integers(0, 256, LIMIT_CHUNK, dtype=np.uint8).tobytes()
        sequential(self.fd, nbytes, self.buffer, write=True)  # unwritten extents become written, untimed
        drop_cache([self.path])

    def write(self) -> float:
        start = time.perf_counter()
        sequential(self.fd, self.nbytes, self.buffer, write=True)
        if not self.direct:
            os.fdatasync(self.fd)
        return time.perf_counter() - start

    def read(self) -> float:
        drop_cache([self.path])
        start = time.perf_counter()
        sequential(self.fd, self.nbytes, self.buffer, write=False)
        return time.perf_counter() - start

    def close(self) -> None:
        os.close(self.fd)


class TierRig:
    """A disk tier of ``blocks`` slots of ``block_bytes``, its keys and its data files."""

    def __init__(self, folder: str, block_bytes: int, blocks: int) -> None:
        self.folder = os.path.join(folder, f"tier-{block_bytes}")
        spec = TierSpec(
            {"path": self.folder, "bytes_to_use": blocks * (block_bytes + RECORD_BYTES)},
            block_bytes,
            fingerprint={"benchmark": "kvhal bench disk"},
            role="io",
        )
        self.tier = DiskTier(spec)
        assert self.tier.num_slots >= blocks, (self.tier.num_slots, blocks)
        self.block_bytes = block_bytes
        self.blocks = blocks
        self.keys = [b"kvhal-bench-disk" + i.to_bytes(KEY_BYTES - 16, "big") for i in range(blocks)]
        self.data_files = sorted(glob.glob(os.path.join(self.tier.namespace, "rank0of1", "data-*.bin")))
        # Written extents, as in a tier in use (preallocation leaves them unwritten), untimed.
        chunk = aligned_buffer(LIMIT_CHUNK)
        for path in self.data_files:
            fd, _ = _open_direct(path, os.O_WRONLY)
            try:
                sequential(fd, os.fstat(fd).st_size, chunk, write=True)
            finally:
                os.close(fd)
        drop_cache(self.data_files)

    def run(self, slots: list[int], views: list[memoryview], batch: int, inflight: int, *, write: bool):
        """Write (or read back) every block, ``inflight`` batches at a time: ``(seconds, failed blocks)``."""
        tier, keys = self.tier, self.keys
        call = tier.write if write else tier.read
        if not write:
            drop_cache(self.data_files, sync=False)
        pending: deque = deque()
        failed = 0

        def finish() -> int:
            outcomes = pending.popleft().result()
            # a read's outcome as the backend gives it: OK, or None (the contract's first form)
            return sum(1 for o in outcomes if (o is not True if write else ReadOutcome.of(o) is not OK))

        start = time.perf_counter()
        for k, first in enumerate(range(0, len(slots), batch)):
            if len(pending) >= inflight:
                failed += finish()
            ring = (k % inflight) * batch  # batches in flight never share a buffer
            n = min(batch, len(slots) - first)
            pending.append(call(slots[first : first + n], keys[first : first + n], views[ring : ring + n]))
        while pending:
            failed += finish()
        if write and not tier.direct:
            drop_cache(self.data_files)  # buffered: the write is done when it is on the disk
        return time.perf_counter() - start, failed

    def close(self) -> None:
        self.tier.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def host_buffers(block_bytes: int, count: int) -> tuple[memoryview, list[memoryview]]:
    """``count`` page-aligned blocks of noise (one mapping) and a view of each."""
    pool = aligned_buffer(block_bytes * count)
    noise = np.random.default_rng(0).integers(0, 256, min(pool.nbytes, 4 << 20), dtype=np.uint8)
    whole = np.frombuffer(pool, np.uint8)
    for start in range(0, pool.nbytes, noise.size):
        whole[start : start + noise.size] = noise[: pool.nbytes - start]
        whole[start] = (start // noise.size) & 0xFF  # no two blocks alike
    return pool, [pool[i * block_bytes : (i + 1) * block_bytes] for i in range(count)]


def measure_row(
    rig: TierRig,
    limit: Limit,
    order: str,
    batch: int,
    inflight: int,
    tier_first: bool,
    step: Callable[[str], None],
) -> dict:
    """One (block, batch) row: the tier's write and read, each beside the limit's."""
    block_bytes, blocks = rig.block_bytes, rig.blocks
    slots = list(range(blocks))
    if order == "random":
        random.Random(block_bytes).shuffle(slots)
    batch = min(batch, blocks)
    depth = max(1, min(inflight, MAX_POOL_BYTES // (batch * block_bytes)))
    pool, views = host_buffers(block_bytes, depth * batch)
    seconds: dict[str, float] = {}
    failed = {"write": 0, "read": 0}
    try:
        for direction in ("write", "read"):
            write = direction == "write"
            pair = [("tier", None), ("limit", limit.write if write else limit.read)]
            for who, limit_step in pair if tier_first else pair[::-1]:
                step(f"{who} {direction}")
                if limit_step is None:
                    seconds[f"tier_{direction}"], failed[direction] = rig.run(
                        slots, views, batch, depth, write=write
                    )
                else:
                    seconds[f"limit_{direction}"] = limit_step()
    finally:
        del views
        pool.release()
    moved = blocks * block_bytes
    gbps = {k: moved / v / 1e9 for k, v in seconds.items()}
    shares = {d: gbps[f"tier_{d}"] / gbps[f"limit_{d}"] for d in ("write", "read")}
    return {
        "block_bytes": block_bytes,
        "batch": batch,
        "inflight": depth,
        "bytes": moved,
        "blocks": blocks,
        "write_gbps": gbps["tier_write"],
        "read_gbps": gbps["tier_read"],
        "limit_write_gbps": gbps["limit_write"],
        "limit_read_gbps": gbps["limit_read"],
        "write_share": shares["write"],
        "read_share": shares["read"],
        "seconds": seconds,
        "failed_writes": failed["write"],
        "failed_reads": failed["read"],
        "tier_direct": rig.tier.direct,
        "target_met": min(shares.values()) >= TARGET_SHARE
        if block_bytes >= TARGET_SHARE_FROM_BLOCK
        else None,
    }


def throughput(
    folder: str,
    nbytes: int,
    block_sizes: Sequence[int],
    batches: Sequence[int],
    inflight: int,
    order: str,
    progress: Progress,
) -> tuple[list[dict], bool]:
    """Every (block, batch) row, the limit measured beside each; and whether the limit used O_DIRECT."""
    rows: list[dict] = []
    task = progress.add_task("throughput", total=len(block_sizes) * len(batches) * 4)
    limit: Limit | None = None
    try:
        for block_bytes in block_sizes:
            blocks = max(1, nbytes // block_bytes)
            if limit is None or limit.nbytes != blocks * block_bytes:
                if limit is not None:
                    limit.close()
                limit = Limit(folder, blocks * block_bytes)
            rig = TierRig(folder, block_bytes, blocks)
            try:
                for batch in batches:
                    label = f"{size_name(block_bytes)} x {min(batch, blocks)}"

                    def step(what: str, label: str = label) -> None:
                        progress.update(task, description=f"{label}: {what}")
                        progress.advance(task)

                    # the order of tier and limit alternates, so drift of the disk hits both alike
                    rows.append(measure_row(rig, limit, order, batch, inflight, len(rows) % 2 == 0, step))
            finally:
                rig.close()
    finally:
        direct = limit.direct if limit is not None else False
        if limit is not None:
            limit.close()
            with contextlib.suppress(OSError):
                os.unlink(limit.path)
    return rows, direct


def index_memory(num_slots: int, policy: str = "clock", batch: int = 64, churn: float = 0.1) -> dict:
    """Bytes a :class:`TierIndex` holds per block, full and churning (``kvhal bench manager``'s method)."""
    total = num_slots + int(num_slots * churn)
    keys = [i.to_bytes(KEY_BYTES, "big") for i in range(total)]  # the caller's, made before
    registry = PluginRegistry()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = TierIndex(num_slots, policy, registry=registry)
        for first in range(0, total, batch):
            plan = index.prepare_store(keys[first : first + batch])
            if plan is not None and plan.keys:
                index.complete_store(plan.keys)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    tracked = len(index)
    return {
        "slots": num_slots,
        "policy": policy,
        "stored_keys": total,
        "bytes": held,
        "tracked_blocks": tracked,
        "bytes_per_block": held / max(tracked, 1),
    }


def warm_restart(folder: str, blocks: int, policy: str = "clock") -> dict:
    """A restart's index rebuild: open the tier, check its ``blocks`` records, fill a :class:`TierIndex`.

    The records are written as the tier writes them (4 KiB slots, payloads not
    needed to recover); the record file is dropped from the page cache first.
    """
    path = os.path.join(folder, "restart")
    spec = TierSpec(
        {"path": path, "bytes_to_use": blocks * (ALIGN + RECORD_BYTES)},
        ALIGN,
        fingerprint={"benchmark": "kvhal bench disk"},
        role="index",
    )
    try:
        tier = DiskTier(spec)  # creates and preallocates the files
        tier.close()
        digest = spec.digest()
        index_path = os.path.join(tier.namespace, "rank0of1", "index.bin")
        fd = os.open(index_path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            step = 1 << 16
            for first in range(0, blocks, step):
                records = b"".join(
                    pack_record(i.to_bytes(KEY_BYTES, "big"), digest, 0)
                    for i in range(first, min(blocks, first + step))
                )
                os.pwrite(fd, records, first * RECORD_BYTES)
        finally:
            os.close(fd)
        drop_cache([index_path])
        registry = PluginRegistry()  # found once at engine start, whatever the tier
        gc.collect()
        start = time.perf_counter()
        tier = DiskTier(spec)
        try:
            slots, keys = tier.recover()
            read = time.perf_counter()
            index = TierIndex(tier.num_slots, policy, registry=registry)
            indexed = index.recover(slots, keys)
        finally:
            tier.close()
        end = time.perf_counter()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    assert indexed == blocks, (indexed, blocks)
    return {
        "blocks": blocks,
        "seconds": end - start,
        "blocks_per_s": blocks / (end - start),
        "tier_recover_seconds": read - start,
        "index_recover_seconds": end - read,
    }
