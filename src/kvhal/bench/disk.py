"""The disk tier: throughput beside the disk's limit, index size and restart speed, TTFT of a disk hit.

Throughput: for each block size and batch size, the built-in disk tier
(:class:`~kvhal.tiers.disk.DiskTier`, ``io`` role) writes ``--gib`` of blocks
from page-aligned host buffers, then reads them back (verified), with
``--inflight`` batches in flight as futures, the way the connector's workers
drive it. Beside each row, in the same run and on a file in the same
directory, the limit: a plain sequential ``O_DIRECT`` ``pwrite``/``pread`` of
the same bytes in 4 MiB requests, one at a time (what ``dd oflag=direct
bs=4M`` does). The order of tier and limit alternates from row to row, so a
disk whose speed drifts hits both alike. Reads never come from the page
cache: the tier and the limit use ``O_DIRECT`` where the file system takes it;
where not, writes are timed up to ``fdatasync`` and the files are dropped from
the page cache (``posix_fadvise(DONTNEED)``) before every read.

Index: bytes per block of the scheduler's :class:`~kvhal.tiers.index.TierIndex`
(``clock``) of ``--index-slots`` slots, measured as ``kvhal bench manager``
measures them (tracemalloc's traced memory once the index is full and
churning, minus before it was made, over the blocks it tracks; the keys are
the caller's); the speed of :meth:`TierIndex.recover
<kvhal.tiers.index.TierIndex.recover>` (:func:`kvhal.bench.tier_index.measure_recover`);
and a whole warm restart: opening the tier, reading and checking its records
(``DiskTier.recover``, the record file out of the page cache) and rebuilding
the index.

TTFT (``--e2e``) on ``kvhal bench e2e``'s model and prompts, each engine in its
own process: recompute (an engine without kvhal), a host hit (kvhal's host
tier, after ``reset_prefix_cache``) and a disk hit: one engine writes the
prompts through to a disk tier and exits; a fresh engine on the same
``disk_path``, with a host tier too small to matter, loads them from disk in
its first round (``O_DIRECT`` reads: not from the page cache).
``tier_loaded_blocks`` says how many blocks came from the disk.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import os
import random
import shutil
import statistics
import tempfile
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvhal.bench.common import console as make_console
from kvhal.bench.common import result_header, write_outputs
from kvhal.registry import PluginRegistry
from kvhal.tiers.backend import TierSpec
from kvhal.tiers.disk import DiskTier
from kvhal.tiers.disk.format import ALIGN, RECORD_BYTES, TREE, pack_record
from kvhal.tiers.disk.io import aligned_buffer, preadv_all, pwritev_all
from kvhal.tiers.index import TierIndex

#: Targets from the issue.
TARGET_SHARE, TARGET_SHARE_FROM_BLOCK = 0.8, 256 << 10
TARGET_DISK_VS_RECOMPUTE = 0.15
TARGET_INDEX_BYTES = 32
TARGET_RECOVER_RATE = 1e6
#: The limit's request size (``dd bs=4M``).
LIMIT_CHUNK = 4 << 20
#: Host buffers of one row (batches in flight x batch x block) stay under this.
MAX_POOL_BYTES = 512 << 20
KEY_BYTES = 36  # a vLLM 0.32 OffloadKey: 32-byte hash + 4-byte group


def parse_size(text: str) -> int:
    """``"64K"``, ``"4M"``, ``"1G"`` (binary units) or plain bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def size_name(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0 else f"{nbytes >> 10} KiB"


# ---------------------------------------------------------------------- files and the page cache


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


# ---------------------------------------------------------------------- the tier


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
        self.data_files = sorted(glob.glob(os.path.join(self.folder, TREE, "rank0of1", "data-*.bin")))
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
            return sum(1 for o in outcomes if (o is not True if write else o is not None))

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


# ---------------------------------------------------------------------- the index


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
        DiskTier(spec).close()  # creates and preallocates the files
        digest = spec.digest()
        index_path = os.path.join(path, TREE, "rank0of1", "index.bin")
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


# ---------------------------------------------------------------------- TTFT


def ttft(folder: str, prompt_len: int, repeats: int, models: Path, progress: Progress) -> dict:
    """Recompute, host hit and disk hit, medians of ``repeats`` distinct prompts (engines in subprocesses)."""
    from kvhal.bench.e2e import SHARING_ENV, _prompt, engine_args
    from kvhal.testing.models import BENCH_MODEL
    from kvhal.testing.scenario import run_scenario

    task = progress.add_task("TTFT: building the model", total=4)
    model = str(BENCH_MODEL.build(models))
    rng = random.Random(0)
    warm, *prompts = [_prompt(rng, prompt_len, BENCH_MODEL.vocab_size) for _ in range(repeats + 1)]
    fresh = _prompt(rng, prompt_len, BENCH_MODEL.vocab_size)
    env = SHARING_ENV
    engine = {**engine_args(prompt_len), "disable_log_stats": False}  # the tier_* metrics
    m = BENCH_MODEL  # one block's KV: layers x 32 tokens x KV heads x (K, V) x head size x bf16
    block_bytes = m.num_hidden_layers * 32 * m.num_key_value_heads * 2 * m.head_dim * 2
    disk = {"disk_path": os.path.join(folder, "e2e-disk"), "disk_bytes_to_use": 1 << 30}
    # Room for one prompt's promotions and the warm-up's stores, nothing more (2048 tokens: 64 blocks).
    small_host = (2 * (prompt_len // 32) + 8) * block_bytes

    def gen(prompt: list[int], name: str) -> dict:
        return {"op": "generate", "prompts": [prompt], "max_tokens": 1, "name": name}

    def scenario(label: str, kvhal: dict | None, steps: list[dict]) -> dict:
        progress.update(task, description=f"TTFT: {label}")
        result = run_scenario({"model": model, "kvhal": kvhal, "steps": steps, "engine": engine, "env": env})
        progress.advance(task)
        return result

    recompute = scenario(
        "recompute (no kvhal)", None, [gen(warm, "warm-up")] + [gen(p, "recompute") for p in prompts]
    )
    host_steps = [gen(warm, "warm-up"), {"op": "reset"}, gen(warm, "warm-up")]
    for p in prompts:
        host_steps += [gen(p, "cold"), {"op": "reset"}, gen(p, "host hit")]
    host = scenario("host hit", {"cpu_bytes_to_use": 2 << 30}, host_steps)
    # A store's write-through starts when a later engine step sees the store done, and a
    # write left unstarted when the process exits fails there: every engine ends with steps
    # (a short prompt decoding a few tokens), a pause for the writes, and one more step.
    drain = [
        {"op": "generate", "prompts": [fresh[:64]], "max_tokens": 8, "name": "drain"},
        {"op": "sleep", "seconds": 3},
        {"op": "generate", "prompts": [fresh[64:128]], "max_tokens": 8, "name": "drain"},
        {"op": "metrics"},
    ]
    written = scenario(
        "writing the prompts to disk",
        {"cpu_bytes_to_use": 2 << 30, **disk},
        [gen(p, "populate") for p in (warm, *prompts)] + drain,
    )
    tier_files = glob.glob(os.path.join(disk["disk_path"], TREE, "rank*", "*.bin"))
    drop_cache(tier_files)  # nothing there with O_DIRECT; a buffered fallback's pages go too
    disk_steps = [{**gen(fresh, "warm-up"), "max_tokens": 8}, {"op": "sleep", "seconds": 3}]
    disk_steps += [gen(warm, "warm-up"), *(gen(p, "disk hit") for p in prompts), *drain]
    from_disk = scenario("disk hit (a fresh engine)", {"cpu_bytes_to_use": small_host, **disk}, disk_steps)

    def rows(result: dict, name: str) -> list[dict]:
        return [s for s in result["steps"] if s["name"] == name]

    def metric(result: dict, name: str) -> float:
        found = [s for s in result["steps"] if s["op"] == "metrics"][-1]["metrics"]
        return found.get(f"vllm:kvhal_{name}", 0)

    categories = {"recompute": recompute, "host hit": host, "disk hit": from_disk}
    table = []
    for name, result in categories.items():
        runs = rows(result, name)
        table.append(
            {
                "category": name,
                "ttft_s": statistics.median(s["seconds"] for s in runs),
                "ttft_all_s": [s["seconds"] for s in runs],
                "prompt_tokens": prompt_len,
                "cached_tokens": statistics.median(s["outputs"][0]["num_cached_tokens"] for s in runs),
                "kvhal_loaded_tokens": statistics.median(
                    s["outputs"][0]["kvhal_loaded_tokens"] or 0 for s in runs
                ),
            }
        )
    by = {r["category"]: r["ttft_s"] for r in table}
    outputs = {
        name: [s["outputs"][0]["tokens"] for s in rows(result, name)] for name, result in categories.items()
    }
    return {
        "model": {"recipe": BENCH_MODEL.tag, "parameters": BENCH_MODEL.parameters},
        "block_bytes": block_bytes,
        "small_host_bytes": small_host,
        "rows": table,
        "disk_vs_recompute": by["disk hit"] / by["recompute"],
        "host_vs_recompute": by["host hit"] / by["recompute"],
        "disk_vs_host": by["disk hit"] / by["host hit"],
        "outputs_equal": outputs["disk hit"] == outputs["recompute"] == outputs["host hit"],
        "tier_written_blocks": metric(written, "tier_written_blocks"),
        "tier_recovered_blocks": metric(from_disk, "tier_recovered_blocks"),
        "tier_loaded_blocks": metric(from_disk, "tier_loaded_blocks"),
        "tier_read_bytes": metric(from_disk, "tier_read_bytes"),
        "tier_corrupt_blocks": metric(from_disk, "tier_corrupt_blocks"),
        "disk_hit_prompts": repeats + 1,  # the warm-up's disk hit counts too
    }


# ---------------------------------------------------------------------- report


def check_targets(rows: list[dict], index: dict, recover: dict, restart: dict | None, e2e: dict | None):
    targeted = [r for r in rows if r["target_met"] is not None]
    checks = []
    if targeted:
        worst = min(min(r["write_share"], r["read_share"]) for r in targeted)
        checks.append(
            {
                "target": f"tier >= {TARGET_SHARE:.0%} of the limit, write and read, blocks >= "
                f"{size_name(TARGET_SHARE_FROM_BLOCK)} ({sum(r['target_met'] for r in targeted)}/"
                f"{len(targeted)} rows met)",
                "value": worst,
                "met": all(r["target_met"] for r in targeted),
            }
        )
    checks.append(
        {
            "target": f"index <= {TARGET_INDEX_BYTES} bytes per disk block",
            "value": index["bytes_per_block"],
            "met": index["bytes_per_block"] <= TARGET_INDEX_BYTES,
        }
    )
    for name, measured in (("TierIndex.recover", recover), ("warm restart (records + index)", restart)):
        if measured is not None:
            checks.append(
                {
                    "target": f"{name} >= {TARGET_RECOVER_RATE / 1e6:.0f}M blocks/s",
                    "value": measured["blocks_per_s"],
                    "met": measured["blocks_per_s"] >= TARGET_RECOVER_RATE,
                }
            )
    if e2e is not None:
        checks.append(
            {
                "target": f"disk hit TTFT <= {TARGET_DISK_VS_RECOMPUTE}x recompute",
                "value": e2e["disk_vs_recompute"],
                "met": e2e["disk_vs_recompute"] <= TARGET_DISK_VS_RECOMPUTE,
            }
        )
    return checks


def print_storage(console: Console, result: dict) -> None:
    """The throughput table and the index figures."""
    rows = result["throughput"]
    table = Table(
        title=f"kvhal bench disk: {result['path']} ({'O_DIRECT' if result['limit_direct'] else 'buffered'}), "
        f"{size_name(rows[0]['bytes']) if rows else '?'} per measurement, GB/s = 1e9 bytes/s"
    )
    columns = ("block", "batch", "in flight", "write GB/s", "read GB/s", "limit write", "limit read")
    for column in (*columns, "% of limit w/r", "target met"):
        table.add_column(column, justify="right")
    met = {True: "[green]yes[/green]", False: "[red]no[/red]", None: "-"}
    for r in rows:
        table.add_row(
            size_name(r["block_bytes"]),
            str(r["batch"]),
            str(r["inflight"]),
            f"{r['write_gbps']:.2f}",
            f"{r['read_gbps']:.2f}",
            f"{r['limit_write_gbps']:.2f}",
            f"{r['limit_read_gbps']:.2f}",
            f"{r['write_share']:.0%} / {r['read_share']:.0%}",
            met[r["target_met"]],
        )
    console.print(table)
    failed = sum(r["failed_writes"] + r["failed_reads"] for r in rows)
    if failed:
        console.print(f"[red]{failed} blocks failed to write or read back[/red]")
    index, recover, restart = result["index"], result["recover"], result["warm_restart"]
    console.print(
        f"index: TierIndex ({index['policy']}) of {index['slots']:,} slots, full and churning: "
        f"{index['bytes_per_block']:.1f} bytes per block"
    )
    console.print(
        f"TierIndex.recover of {recover['blocks']:,} blocks: {recover['seconds']:.3f} s, "
        f"{recover['blocks_per_s'] / 1e6:.2f}M blocks/s"
    )
    if restart is not None:
        console.print(
            f"warm restart, {restart['blocks']:,} blocks: {restart['seconds']:.3f} s "
            f"({restart['blocks_per_s'] / 1e6:.2f}M blocks/s): tier opened and records checked "
            f"{restart['tier_recover_seconds']:.3f} s, index rebuilt {restart['index_recover_seconds']:.3f} s"
        )


def print_ttft(console: Console, e2e: dict) -> None:
    if e2e is not None:
        recompute = next(r["ttft_s"] for r in e2e["rows"] if r["category"] == "recompute")
        ttft_table = Table(
            title=f"TTFT, {e2e['rows'][0]['prompt_tokens']}-token prompt (kvhal bench e2e's model)"
        )
        for column in ("", "TTFT (s)", "vs recompute", "cached tokens", "from kvhal"):
            ttft_table.add_column(column, justify="right")
        for r in e2e["rows"]:
            ttft_table.add_row(
                r["category"],
                f"{r['ttft_s']:.4f}",
                f"{r['ttft_s'] / recompute:.3f}x",
                f"{r['cached_tokens']:.0f}",
                f"{r['kvhal_loaded_tokens']:.0f}",
            )
        console.print(ttft_table)
        console.print(
            f"disk-hit engine: {e2e['tier_recovered_blocks']:.0f} blocks recovered at start, "
            f"{e2e['tier_loaded_blocks']:.0f} read from disk ({e2e['tier_read_bytes'] / 2**20:.0f} MiB, "
            f"{e2e['disk_hit_prompts']} prompts), {e2e['tier_corrupt_blocks']:.0f} corrupt; outputs "
            + ("equal in all three" if e2e["outputs_equal"] else "[red]differ[/red]")
        )


def print_targets(console: Console, checks: list[dict]) -> None:
    for check in checks:
        value = check["value"]
        shown = f"{value / 1e6:.2f}M" if value > 1e5 else f"{value:.3f}"
        console.print(f"target {check['target']}: {'met' if check['met'] else '[red]MISSED[/red]'} ({shown})")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, e2e = result["throughput"], result["e2e"]
    fig, axes = plt.subplots(1, 3 if e2e else 2, figsize=(15 if e2e else 10, 4))
    blocks = sorted({r["block_bytes"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    for ax, direction in zip(axes, ("write", "read"), strict=False):
        for i, batch in enumerate(batches):
            mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["block_bytes"])
            xs = [r["block_bytes"] >> 10 for r in mine]
            ax.plot(
                xs, [r[f"{direction}_gbps"] for r in mine], "o-", color=f"C{i}", label=f"tier, batch {batch}"
            )
            ax.plot(xs, [r[f"limit_{direction}_gbps"] for r in mine], "x:", color=f"C{i}", alpha=0.6)
        limits = [r[f"limit_{direction}_gbps"] for r in rows]
        ax.axhline(statistics.median(limits), color="k", linestyle="--", linewidth=1, label="limit (median)")
        ax.axhline(
            TARGET_SHARE * statistics.median(limits), color="r", linestyle=":", linewidth=1, label="80% of it"
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks([b >> 10 for b in blocks], [size_name(b) for b in blocks])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("block (x: the limit measured beside that row)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"disk tier {direction}")
        ax.legend(fontsize=7)
    if e2e:
        ax = axes[2]
        names = [r["category"] for r in e2e["rows"]]
        values = [r["ttft_s"] for r in e2e["rows"]]
        ax.bar(names, values, color=["C3", "C0", "C2"])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3f}s ({v / values[0]:.3f}x)", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("time to first token (s)")
        ax.set_title(f"TTFT, {e2e['rows'][0]['prompt_tokens']}-token prompt")
    fig.suptitle(f"kvhal bench disk ({result['machine'].get('git', '?')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--path",
        type=Path,
        help="a directory on the file system to measure (a temporary folder is made in it and removed; "
        "default: one in --out, on the repository's file system)",
    )
    parser.add_argument("--gib", type=float, default=1.0, help="GiB moved per measurement (default 1)")
    parser.add_argument(
        "--blocks",
        nargs="+",
        type=parse_size,
        default=[64 << 10, 256 << 10, 1 << 20, 4 << 20],
        help="block sizes (64K, 1M, ...; default 64K 256K 1M 4M)",
    )
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64], help="blocks per batch")
    parser.add_argument("--inflight", type=int, default=4, help="batches in flight (default 4)")
    parser.add_argument(
        "--order",
        choices=("sequential", "random"),
        default="sequential",
        help="slots of consecutive blocks: adjacent (a fresh tier) or shuffled (a churned one)",
    )
    parser.add_argument("--index-slots", type=int, default=1 << 20, help="TierIndex slots for bytes/block")
    parser.add_argument("--recover-blocks", type=int, default=1 << 20, help="blocks of a warm restart")
    parser.add_argument("--no-restart", action="store_true", help="skip the warm restart from disk records")
    parser.add_argument(
        "--e2e", action=argparse.BooleanOptionalAction, default=True, help="TTFT of a disk hit"
    )
    parser.add_argument("--prompt-len", type=int, default=2048, help="TTFT prompt tokens (default 2048)")
    parser.add_argument("--repeats", type=int, default=3, help="distinct prompts per TTFT category")
    parser.add_argument("--models", type=Path, default=Path.home() / ".cache" / "kvhal-bench-models")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG")


def run(args: argparse.Namespace) -> int:
    console = make_console()
    parent = args.path or args.out
    parent.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="kvhal-bench-disk-", dir=parent)
    nbytes = max(LIMIT_CHUNK, int(args.gib * (1 << 30)) // LIMIT_CHUNK * LIMIT_CHUNK)
    try:
        with Progress(console=console, transient=True) as progress:
            rows, direct = throughput(
                folder, nbytes, args.blocks, args.batches, args.inflight, args.order, progress
            )
            task = progress.add_task(
                f"index: TierIndex of {args.index_slots:,} slots (tracemalloc)", total=None
            )
            index = index_memory(args.index_slots)
            from kvhal.bench.tier_index import measure_recover

            progress.update(task, description=f"TierIndex.recover of {args.recover_blocks:,} blocks")
            recover = measure_recover(args.recover_blocks)
            restart = None
            if not args.no_restart:
                progress.update(task, description=f"warm restart of {args.recover_blocks:,} blocks")
                restart = warm_restart(folder, args.recover_blocks)
            progress.remove_task(task)
            result = {
                **result_header("disk"),
                "path": str(Path(parent).resolve()),
                "limit_direct": direct,
                "inflight": args.inflight,
                "order": args.order,
                "throughput": rows,
                "index": index,
                "recover": recover,
                "warm_restart": restart,
            }
            print_storage(console, result)  # before the engines' minutes
            e2e = ttft(folder, args.prompt_len, args.repeats, args.models, progress) if args.e2e else None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result["e2e"] = e2e
    result["targets"] = check_targets(rows, index, recover, restart, e2e)
    print_ttft(console, e2e)
    print_targets(console, result["targets"])
    json_path, png_path = write_outputs(args.out, "disk", result)
    plot(result, png_path)
    console.print(f"wrote {json_path} and {png_path}")
    return 0
