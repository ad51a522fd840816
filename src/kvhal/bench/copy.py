"""Block-copy throughput of the selected device: layer-separate vs cross-layer vs one plain memcpy.

For each per-layer chunk size and batch size it copies a random batch of
blocks device -> host and host -> device through the device facade (the same
path offloading takes: validation, coalescing, the plugin's copy, the event)
in a layer-separate layout (LBHNC) and a cross-layer one (BLHNC), and, in the
same run, one plain copy of the same number of bytes between two contiguous
buffers (the limit). Ratios are taken within the run.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvhal.bench.common import console as make_console
from kvhal.bench.common import result_header, write_outputs
from kvhal.cache import KVCache, dense_kv_cache
from kvhal.device import Device
from kvhal.geometry import KVGeometry
from kvhal.layouts import BLHNC, LBHNC, KVLayout
from kvhal.registry import select_device

KiB = 1 << 10
CHUNKS_KIB = (4, 16, 64, 256, 1024)
BATCHES = (16, 64, 256)
QUICK_CHUNKS_KIB = (4, 16, 64, 1024)
QUICK_BATCHES = (64,)
#: Head size 64 with K and V packed (C = 128), 16 tokens a block, bf16: 4 KiB per head.
HEAD_SIZE, BLOCK_SIZE, DTYPE = 64, 16, torch.bfloat16
#: Every cache holds a little more than one batch; four caches and two plain buffers stay in memory.
MAX_BATCH_BYTES = 1 << 30
#: Targets from the issue, checked on every run.
TARGET_CROSS_VS_MEMCPY, TARGET_CROSS_BLOCK_MIN = 0.90, 64 * KiB
TARGET_CROSS_VS_SEPARATE, TARGET_SEPARATE_CHUNK_MAX = 2.0, 16 * KiB


def geometry_for(chunk_bytes: int, num_layers: int, num_blocks: int) -> KVGeometry:
    per_head = BLOCK_SIZE * 2 * HEAD_SIZE * torch.empty((), dtype=DTYPE).element_size()
    return KVGeometry(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        num_kv_heads=max(1, chunk_bytes // per_head),
        head_size=HEAD_SIZE,
        dtype=DTYPE,
    )


def _time(fn, repeats: int, min_seconds: float) -> float:
    """Median seconds of ``fn`` over at least ``repeats`` runs (after one warm-up)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 50 * repeats:
            break
    return statistics.median(times)


class Case:
    """One layout's device cache, host cache and random mappings for one size."""

    def __init__(
        self, device: Device, geometry: KVGeometry, layout: KVLayout, batch: int, rng: np.random.Generator
    ):
        self.device = device
        self.cache: KVCache = device.allocate_kv_cache(geometry, layout)
        self.host: KVCache = device.allocate_host_cache(geometry, layout, geometry.num_blocks)
        src = rng.choice(geometry.num_blocks, size=batch, replace=False)
        dst = rng.choice(geometry.num_blocks, size=batch, replace=False)
        self.store = np.stack([src, dst], axis=1)
        self.load = np.stack([dst, src], axis=1)
        self.stream = device.create_stream()

    def run(self, direction: str) -> None:
        if direction == "d2h":
            event = self.device.copy_blocks(self.cache, self.host, self.store, self.stream)
        else:
            event = self.device.copy_blocks(self.host, self.cache, self.load, self.stream)
        self.device.synchronize_event(event)

    def close(self) -> None:
        self.device.free_host_cache(self.host)


class PlainCopy:
    """One copy of ``nbytes`` between two contiguous buffers: the limit.

    Two plain copies are timed and the faster counts: the device's own copy of
    a single descriptor (for the CPU, its engine with every thread) and
    ``torch.Tensor.copy_``.
    """

    def __init__(self, device: Device, nbytes: int):
        self.device = device
        self.host = device.allocate_host_buffer(nbytes)
        self.other = torch.zeros(nbytes, dtype=torch.int8, device=device.torch_device)
        # One layer, one block, one head, one token: the whole buffer is one descriptor.
        geometry = KVGeometry(1, 1, 1, 1, nbytes // 4, torch.bfloat16)
        self._caches = (
            dense_kv_cache(geometry, LBHNC, self.other),
            dense_kv_cache(geometry, LBHNC, self.host),
        )
        self.stream = device.create_stream()

    def run_device(self, direction: str) -> None:
        a, b = self._caches if direction == "d2h" else self._caches[::-1]
        self.device.synchronize_event(self.device.copy_blocks(a, b, [(0, 0)], self.stream))

    def run_torch(self, direction: str) -> None:
        if direction == "d2h":
            self.host.copy_(self.other)
        else:
            self.other.copy_(self.host)
        if self.device.torch_device.type != "cpu":
            torch.accelerator.synchronize()

    def close(self) -> None:
        self.device.free_host_buffer(self.host)


def measure(
    device: Device, chunks_kib, batches, num_layers: int, repeats: int, min_seconds: float, console: Console
):
    rng = np.random.default_rng(0)
    rows = []
    total = len(chunks_kib) * len(batches)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("copy benchmark", total=total)
        for chunk_kib in chunks_kib:
            for batch in batches:
                chunk = chunk_kib * KiB
                if batch * num_layers * chunk > MAX_BATCH_BYTES:
                    console.print(
                        f"skipped {chunk_kib} KiB x {num_layers} layers x {batch} blocks: "
                        f"over {MAX_BATCH_BYTES >> 20} MiB a batch"
                    )
                    progress.advance(task)
                    continue
                # a few spare blocks, so the random ids are scattered, not a permutation of all
                geometry = geometry_for(chunk, num_layers, num_blocks=batch + batch // 4 + 4)
                nbytes = batch * geometry.block_bytes
                progress.update(task, description=f"{chunk_kib} KiB x {num_layers} layers x {batch} blocks")
                separate = Case(device, geometry, LBHNC, batch, rng)
                cross = Case(device, geometry, BLHNC, batch, rng)
                plain = PlainCopy(device, nbytes)
                for direction in ("d2h", "h2d"):
                    timed = {
                        name: _time(functools.partial(fn, direction), repeats, min_seconds)
                        for name, fn in (
                            ("device", plain.run_device),
                            ("torch", plain.run_torch),
                            ("separate", separate.run),
                            ("cross", cross.run),
                        )
                    }
                    t_dev, t_torch, t_sep, t_cross = (
                        timed[k] for k in ("device", "torch", "separate", "cross")
                    )
                    t_plain = min(t_dev, t_torch)
                    rows.append(
                        {
                            "direction": direction,
                            "chunk_bytes": chunk,
                            "cross_layer_block_bytes": geometry.block_bytes,
                            "batch_blocks": batch,
                            "num_layers": num_layers,
                            "bytes": nbytes,
                            "plain_gib_s": nbytes / t_plain / 2**30,
                            "plain_source": "device" if t_dev <= t_torch else "torch.copy_",
                            "layer_separate_gib_s": nbytes / t_sep / 2**30,
                            "cross_layer_gib_s": nbytes / t_cross / 2**30,
                            "layer_separate_descriptors": device.plan_copy(
                                separate.cache, separate.host, separate.store
                            ).num_descriptors,
                            "cross_layer_descriptors": device.plan_copy(
                                cross.cache, cross.host, cross.store
                            ).num_descriptors,
                        }
                    )
                for case in (separate, cross, plain):
                    case.close()
                progress.advance(task)
    for row in rows:
        row["cross_vs_plain"] = row["cross_layer_gib_s"] / row["plain_gib_s"]
        row["separate_vs_plain"] = row["layer_separate_gib_s"] / row["plain_gib_s"]
        row["cross_vs_separate"] = row["cross_layer_gib_s"] / row["layer_separate_gib_s"]
    return rows


def check_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, evaluated row by row."""
    checks = []
    for row in rows:
        if row["cross_layer_block_bytes"] >= TARGET_CROSS_BLOCK_MIN:
            checks.append(
                {
                    "target": f"cross-layer >= {TARGET_CROSS_VS_MEMCPY:.0%} of memcpy (blocks >= 64 KiB)",
                    "row": (row["direction"], row["chunk_bytes"], row["batch_blocks"]),
                    "value": row["cross_vs_plain"],
                    "met": row["cross_vs_plain"] >= TARGET_CROSS_VS_MEMCPY,
                }
            )
        if row["chunk_bytes"] <= TARGET_SEPARATE_CHUNK_MAX:
            checks.append(
                {
                    "target": f"cross-layer >= {TARGET_CROSS_VS_SEPARATE:.0f}x layer-separate "
                    "(chunks <= 16 KiB)",
                    "row": (row["direction"], row["chunk_bytes"], row["batch_blocks"]),
                    "value": row["cross_vs_separate"],
                    "met": row["cross_vs_separate"] >= TARGET_CROSS_VS_SEPARATE,
                }
            )
    return checks


def print_table(console: Console, device: Device, rows: list[dict], checks: list[dict]) -> None:
    table = Table(title=f"kvhal bench copy: {device.plugin_name} ({device.distribution})")
    for column in (
        "dir",
        "chunk/layer",
        "layers",
        "batch",
        "MiB",
        "memcpy GiB/s",
        "layer-sep GiB/s",
        "cross-layer GiB/s",
        "cross/memcpy",
        "cross/sep",
        "descriptors sep/cross",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["direction"],
            f"{r['chunk_bytes'] // KiB} KiB",
            str(r["num_layers"]),
            str(r["batch_blocks"]),
            f"{r['bytes'] / 2**20:.0f}",
            f"{r['plain_gib_s']:.1f}",
            f"{r['layer_separate_gib_s']:.1f}",
            f"{r['cross_layer_gib_s']:.1f}",
            f"{r['cross_vs_plain']:.0%}",
            f"{r['cross_vs_separate']:.2f}x",
            f"{r['layer_separate_descriptors']}/{r['cross_layer_descriptors']}",
        )
    console.print(table)
    by_target: dict[str, list[dict]] = {}
    for check in checks:
        by_target.setdefault(check["target"], []).append(check)
    for target, items in by_target.items():
        met = sum(c["met"] for c in items)
        worst = min(items, key=lambda c: c["value"])
        console.print(
            f"target {target}: met in {met}/{len(items)} rows; worst {worst['value']:.2f} at {worst['row']}"
        )


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = sorted({r["direction"] for r in rows})
    batches = sorted({r["batch_blocks"] for r in rows})
    fig, axes = plt.subplots(1, len(directions), figsize=(6 * len(directions), 4.5), squeeze=False)
    for ax, direction in zip(axes[0], directions, strict=True):
        for batch, style in zip(batches, ("-", "--", ":", "-."), strict=False):
            sub = sorted(
                (r for r in rows if r["direction"] == direction and r["batch_blocks"] == batch),
                key=lambda r: r["chunk_bytes"],
            )
            x = [r["chunk_bytes"] // KiB for r in sub]
            ax.plot(x, [r["plain_gib_s"] for r in sub], "k" + style, label=f"memcpy, {batch} blocks")
            ax.plot(
                x,
                [r["cross_layer_gib_s"] for r in sub],
                "C0" + style,
                marker="o",
                label=f"cross-layer, {batch} blocks",
            )
            ax.plot(
                x,
                [r["layer_separate_gib_s"] for r in sub],
                "C3" + style,
                marker="s",
                label=f"layer-separate, {batch} blocks",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("per-layer chunk (KiB)")
        ax.set_ylabel("GiB/s")
        ax.set_title(f"{title}: {direction}")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", help="device plugin to benchmark (default: the selected one)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats (the demo)")
    parser.add_argument("--layers", type=int, default=16, help="layers per cache (default 16)")
    parser.add_argument("--chunks", type=int, nargs="+", help="per-layer chunk sizes in KiB")
    parser.add_argument("--batches", type=int, nargs="+", help="blocks per copy")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG")


def run(args: argparse.Namespace) -> int:
    console = make_console()
    device = select_device(args.device)
    chunks = args.chunks or (QUICK_CHUNKS_KIB if args.quick else CHUNKS_KIB)
    batches = args.batches or (QUICK_BATCHES if args.quick else BATCHES)
    repeats = args.repeats or (3 if args.quick else 7)
    min_seconds = 0.05 if args.quick else 0.3
    rows = measure(device, chunks, batches, args.layers, repeats, min_seconds, console)
    checks = check_targets(rows)
    print_table(console, device, rows, checks)
    result = {
        **result_header("copy"),
        "device": {
            "plugin": device.plugin_name,
            "distribution": device.distribution,
            "details": dict(device.descriptor.details),
        },
        "rows": rows,
        "targets": checks,
    }
    json_path, png_path = write_outputs(args.out, "copy", result)
    plot(rows, png_path, f"{device.plugin_name} copy")
    console.print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
