"""What object size suits kvhal's S3 tier: the same bytes moved as objects of 64 KiB to 16 MiB
through kvhal's own S3Store (obstore) against a local SeaweedFS, one object per block against
one object per run of blocks (as LMCache's chunks).

Per object size, each round: TOTAL bytes PUT as TOTAL / size objects in one ``S3Store.put``
call (fresh names, ``If-None-Match: *`` as kvhal writes; ``max_requests`` in flight, the URL's
default as kvhal runs it), then range-GET back in one ``S3Store.get`` call into preallocated
buffers (size + 1 bytes asked, as kvhal reads) and checked byte for byte (untimed), then
deleted (untimed, so the server never fills). A request may take ``--timeout`` (60 s): at
the URL's default 5 s, 16 PUTs of 4 MiB at once timed out here (each waits for its share of
a server writing 15-40 MB/s on loaded cores), and the probe measures sizes, not timeouts.
Then, one request at a time, SERIAL PUTs and GETs of that size: a request's own latency. The
sizes run in a rotated order each round, so the machine's load (others' tests) falls on all
of them alike; every figure is the median of the rounds with its min-max spread.

Two fits say what a request costs beyond its bytes: the serial latencies against the object's
bytes (latency = overhead + bytes / rate), and the batch times against the object count at
the same total bytes (time = count x per-request cost + a constant): the second is what a
request costs kvhal with ``max_requests`` of them overlapping. It also prints one rank's block
(16 tokens, vLLM's default) of a few real models (:func:`kvhal.sizing.kv_shape` on their
``config.json`` fields), the sizes this chooses between.

    .venv/bin/python scripts/probes/s3_object_size.py [--total-mib 64] [--repeats 5] [--markdown] \
        [--out docs/benchmarks/s3-object-size-cpu]

writes OUT.json and OUT.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import obstore
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvhal.registry import PluginRegistry
from kvhal.sizing import BLOCK_SIZE, kv_shape
from kvhal.testing.seaweedfs_servers import SeaweedS3
from kvhal.tiers.media import open_store
from kvhal.tiers.remote.format import HEADER_BYTES
from kvhal.tiers.stores.s3_url import DEFAULT_MAX_REQUESTS

KIB = 1 << 10
MIB = 1 << 20
SIZES_KIB = (64, 256, 512, 1024, 4096, 16384)
KINDS = ("put", "get", "put_cpu", "get_cpu")
#: the fields of each model's published config.json that size its KV (Hugging Face hub)
MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "Qwen2.5-0.5B": (
        {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
         "hidden_size": 896, "torch_dtype": "bfloat16"}, 1),
    "Llama-3.2-1B": (
        {"num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 2048, "head_dim": 64, "torch_dtype": "bfloat16"}, 1),
    "Qwen2-7B": (
        {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
         "hidden_size": 3584, "torch_dtype": "bfloat16"}, 1),
    "Llama-3-8B": (
        {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096, "torch_dtype": "bfloat16"}, 1),
    "Llama-3-8B, TP=8": (
        {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096, "torch_dtype": "bfloat16"}, 8),
    "Llama-3-70B, TP=8": (
        {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
         "hidden_size": 8192, "torch_dtype": "bfloat16"}, 8),
    "DeepSeek-V3 (MLA), TP=8": (
        {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
         "qk_rope_head_dim": 64, "hidden_size": 7168, "torch_dtype": "bfloat16"}, 8),
}  # fmt: skip


def model_blocks(block_size: int = BLOCK_SIZE) -> list[dict[str, Any]]:
    """One rank's block of each of :data:`MODELS` (one S3 object per block per rank)."""
    rows = []
    for name, (config, tp) in MODELS.items():
        shape = kv_shape(config)
        block = block_size * shape.rank_bytes_per_token(tp)
        rows.append(
            {"model": name, "tensor_parallel": tp, "block_bytes": block, "object_bytes": block + HEADER_BYTES}
        )
    return rows


class Probe:
    """The bytes, the buffers and the store for one object size after another."""

    def __init__(self, s3: SeaweedS3, total: int, max_requests: int, timeout: float) -> None:
        os.environ.update(s3.credentials)
        url = s3.url(prefix="size-probe", max_requests=max_requests, timeout=timeout)
        self.store = open_store(url, PluginRegistry())
        self.total = total
        # random: no two objects alike, nothing a server could compress
        self.source = np.random.default_rng().integers(0, 256, total, dtype=np.uint8)
        self.target = np.zeros(total, dtype=np.uint8)
        self.tag = f"{time.monotonic_ns()}"
        self.runs = 0

    def views(self, array: np.ndarray, size: int, count: int) -> list[list[memoryview]]:
        """``count`` values of ``size`` bytes of ``array``, from its start (again once it ends)."""
        whole, fit = memoryview(array), len(array) // size
        return [[whole[(i % fit) * size : (i % fit + 1) * size]] for i in range(count)]

    def names(self, size: int, count: int) -> list[str]:
        self.runs += 1
        return [f"{self.tag}/{size}/{self.runs}/{i}" for i in range(count)]

    def remove(self, names: list[str]) -> None:
        for first in range(0, len(names), 1000):  # DeleteObjects takes 1000 names a request
            obstore.delete(self.store.object_store, names[first : first + 1000])

    def batch(self, size: int) -> dict[str, float]:
        """Seconds to PUT, then to GET, ``total`` bytes as objects of ``size`` in one call each,
        and the CPU seconds of this process (the client's) in each (``put_cpu``, ``get_cpu``)."""
        count = self.total // size
        names = self.names(size, count)
        values, buffers = self.views(self.source, size, count), self.views(self.target, size, count)
        self.target[:] = 0
        start, cpu = time.perf_counter(), time.process_time()
        stored = self.store.put(names, values)
        put, put_cpu = time.perf_counter() - start, time.process_time() - cpu
        start, cpu = time.perf_counter(), time.process_time()
        sizes = self.store.get(names, buffers)
        get, get_cpu = time.perf_counter() - start, time.process_time() - cpu
        assert all(stored) and sizes == [size] * count, (size, stored.count(False), set(sizes))
        assert np.array_equal(self.source[: count * size], self.target[: count * size]), size
        self.remove(names)
        return {"put": put, "get": get, "put_cpu": put_cpu, "get_cpu": get_cpu}

    def serial(self, size: int, requests: int) -> tuple[list[float], list[float]]:
        """Each request's seconds, one at a time: ``requests`` PUTs of ``size``, then their GETs."""
        names = self.names(size, requests)
        values, buffers = self.views(self.source, size, requests), self.views(self.target, size, requests)
        puts, gets = [], []
        for name, value in zip(names, values, strict=True):
            start = time.perf_counter()
            assert self.store.put([name], [value]) == [True]
            puts.append(time.perf_counter() - start)
        for name, buffer in zip(names, buffers, strict=True):
            start = time.perf_counter()
            assert self.store.get([name], [buffer]) == [size]
            gets.append(time.perf_counter() - start)
        self.remove(names)
        return puts, gets

    def close(self) -> None:
        self.store.close()


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fit(x: list[float], y: list[float]) -> tuple[float, float]:
    """``y = slope * x + intercept`` by least squares of the relative residuals (the times span
    three decades: plain least squares would fit the largest alone)."""
    ys = np.asarray(y, dtype=float)
    slope, intercept = np.polyfit(np.asarray(x, dtype=float), ys, 1, w=1.0 / ys)
    return float(slope), float(intercept)


def measure(args: argparse.Namespace, on_round: Callable[[int], None]) -> dict[str, Any]:
    sizes = [kib * KIB for kib in args.sizes_kib]
    total = args.total_mib * MIB
    for size in sizes:
        if total % size or total < size:
            raise SystemExit(
                f"--total-mib {args.total_mib} is not a whole number of {size // KIB} KiB objects"
            )
    batch: dict[int, dict[str, list[float]]] = {s: {k: [] for k in KINDS} for s in sizes}
    serial: dict[int, dict[str, list[float]]] = {s: {"put": [], "get": []} for s in sizes}
    loads = [os.getloadavg()[0]]
    with SeaweedS3() as s3:
        probe = Probe(s3, total, args.max_requests, args.timeout)
        try:
            for size in sizes:  # warm: connections, the server's first volumes
                probe.serial(size, 2)
            for r in range(args.repeats):
                order = sizes[r % len(sizes) :] + sizes[: r % len(sizes)]
                for size in order:
                    for kind, seconds in probe.batch(size).items():
                        batch[size][kind].append(seconds)
                    requests = max(4, min(32, args.serial_mib * MIB // size))
                    puts, gets = probe.serial(size, requests)
                    serial[size]["put"].append(statistics.median(puts))
                    serial[size]["get"].append(statistics.median(gets))
                loads.append(os.getloadavg()[0])
                on_round(r)
        finally:
            probe.close()
    rows = []
    for size in sizes:
        count = total // size
        row: dict[str, Any] = {"object_bytes": size, "objects": count}
        for op in ("put", "get"):
            row[op] = {
                "batch_s": spread(batch[size][op]),
                "mb_per_s": spread([total / 1e6 / t for t in batch[size][op]]),
                "requests_per_s": spread([count / t for t in batch[size][op]]),
                "serial_request_s": spread(serial[size][op]),
                "client_cpu_s": spread(batch[size][f"{op}_cpu"]),
            }
        rows.append(row)
    fits = {}
    counts = [total // s for s in sizes]
    for op in ("put", "get"):
        per_byte, overhead = fit(sizes, [statistics.median(serial[s][op]) for s in sizes])
        per_request, rest = fit(counts, [statistics.median(batch[s][op]) for s in sizes])
        fits[op] = {
            "serial_overhead_s": overhead,
            "serial_mb_per_s": 1e-6 / per_byte if per_byte > 0 else None,
            "batch_per_request_s": per_request,
            "batch_bytes_s": rest,
            "client_cpu_per_request_s": fit(
                counts, [statistics.median(batch[s][f"{op}_cpu"]) for s in sizes]
            )[0],
        }
    return {
        "total_bytes": total,
        "max_requests": args.max_requests,
        "timeout_s": args.timeout,
        "repeats": args.repeats,
        "cores": os.cpu_count(),
        "load": {"min": min(loads), "max": max(loads)},
        "rows": rows,
        "fits": fits,
        "models": model_blocks(),
    }


def cells(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The main table's header and rows: median [min-max] of the rounds."""

    def cell(m: dict[str, float], scale: float, digits: int) -> str:
        return (
            f"{m['median'] * scale:.{digits}f} [{m['min'] * scale:.{digits}f}-{m['max'] * scale:.{digits}f}]"
        )

    header = ["object", "objects", "op", "batch s", "MB/s", "requests/s", "one alone, ms", "client CPU s"]
    rows = []
    for row in result["rows"]:
        for op in ("put", "get"):
            m = row[op]
            rows.append([
                f"{row['object_bytes'] // KIB} KiB", str(row["objects"]), op.upper(),
                cell(m["batch_s"], 1, 3), cell(m["mb_per_s"], 1, 0), cell(m["requests_per_s"], 1, 0),
                cell(m["serial_request_s"], 1e3, 1), cell(m["client_cpu_s"], 1, 3),
            ])  # fmt: skip
    return header, rows


def fit_cells(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    in_flight = f"{result['max_requests']} in flight"
    header = [
        "op",
        "alone: overhead ms",
        "alone: MB/s",
        f"{in_flight}: ms a request",
        "client CPU ms a request",
    ]
    rows = []
    for op, f in result["fits"].items():
        rate = "-" if f["serial_mb_per_s"] is None else f"{f['serial_mb_per_s']:.0f}"
        rows.append([
            op.upper(), f"{f['serial_overhead_s'] * 1e3:.2f}", rate, f"{f['batch_per_request_s'] * 1e3:.2f}",
            f"{f['client_cpu_per_request_s'] * 1e3:.2f}",
        ])  # fmt: skip
    return header, rows


def model_cells(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["model", "one rank's block", "object (+ 96 B header)"]
    rows = [
        [m["model"], f"{m['block_bytes'] / KIB:.0f} KiB", f"{m['object_bytes']:,} B"]
        for m in result["models"]
    ]
    return header, rows


def captions(result: dict[str, Any]) -> list[str]:
    load = result["load"]
    return [
        f"{result['total_bytes'] / MIB:.0f} MiB moved per run, max_requests={result['max_requests']}; "
        f"median [min-max] of {result['repeats']} rounds; load {load['min']:.0f}-{load['max']:.0f} "
        f"on {result['cores']} cores",
        "what a request costs beyond its bytes (fits of the medians)",
        f"one rank's block of {BLOCK_SIZE} tokens in the model's dtype: one S3 object each",
    ]


def tables(result: dict[str, Any]) -> list[Table]:
    built = []
    for caption, (header, rows) in zip(
        captions(result), (cells(result), fit_cells(result), model_cells(result)), strict=True
    ):
        table = Table(title=Text(caption))
        for i, column in enumerate(header):
            table.add_column(Text(column), justify="left" if i == 0 or column == "op" else "right")
        for row in rows:
            table.add_row(*(Text(c) for c in row))
        built.append(table)
    return built


def markdown(result: dict[str, Any]) -> str:
    out = []
    for caption, (header, rows) in zip(
        captions(result), (cells(result), fit_cells(result), model_cells(result)), strict=True
    ):
        right = ["---" if i == 0 or h == "op" else "---:" for i, h in enumerate(header)]
        lines = [f"{caption}:", "", "| " + " | ".join(header) + " |", "| " + " | ".join(right) + " |"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        out.append("\n".join(lines))
    return "\n\n".join(out)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kib = [row["object_bytes"] // KIB for row in result["rows"]]
    fig, (rate, alone) = plt.subplots(1, 2, figsize=(10, 3.6))
    for op, marker in (("put", "o"), ("get", "s")):
        for ax, key, scale in ((rate, "mb_per_s", 1.0), (alone, "serial_request_s", 1e3)):
            med = [row[op][key]["median"] * scale for row in result["rows"]]
            low = [m - row[op][key]["min"] * scale for m, row in zip(med, result["rows"], strict=True)]
            high = [row[op][key]["max"] * scale - m for m, row in zip(med, result["rows"], strict=True)]
            ax.errorbar(kib, med, yerr=[low, high], marker=marker, capsize=3, label=op.upper())
    for m in result["models"]:
        rate.axvline(m["block_bytes"] / KIB, color="grey", lw=0.5, ls=":")
    total = result["total_bytes"] / MIB
    rate.set(xscale="log", yscale="log", xlabel="object size, KiB (dotted: model blocks)", ylabel="MB/s",
             title=f"{total:.0f} MiB per run, {result['max_requests']} in flight")  # fmt: skip
    alone.set(xscale="log", yscale="log", xlabel="object size, KiB", ylabel="ms", title="one request alone")
    for ax in (rate, alone):
        ax.set_xticks(kib, [str(k) for k in kib])
        ax.legend()
    fig.suptitle("kvhal S3Store on a local SeaweedFS: median, min-max of the rounds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total-mib", type=int, default=64, help="bytes moved per size and round (64)")
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=list(SIZES_KIB))
    parser.add_argument("--repeats", type=int, default=5, help="rounds, each over every size (5)")
    parser.add_argument(
        "--serial-mib", type=int, default=16, help="bytes of the one-at-a-time requests (4-32 of them)"
    )
    parser.add_argument("--max-requests", type=int, default=DEFAULT_MAX_REQUESTS)
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds a request may take (60; the URL default, 5, timed out big PUTs here)",
    )
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown too")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/s3-object-size-cpu"))
    args = parser.parse_args(argv)
    if SeaweedS3.missing():
        raise SystemExit(SeaweedS3.missing())
    console = Console(width=200)
    result = measure(
        args, lambda r: console.print(f"round {r + 1}/{args.repeats}, load {os.getloadavg()[0]:.1f}")
    )
    for table in tables(result):
        console.print(table)
    if args.markdown:
        print(markdown(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
