"""Offloading-manager throughput, hit rate and memory on a prefix-sharing trace, against vLLM's.

Requests pick a document by Zipf popularity; each request is the
document's shared prefix blocks plus unique tail blocks, so the host tier
(smaller than the working set) must choose what to keep. Every manager sees
the same keys (vLLM 0.32 ``OffloadKey`` bytes: a 32-byte hash and the group
index in 4 bytes, created before any measurement) in the same calls:
lookup, load the hit prefix, store the rest, complete both, touch the request.
With ``--inflight N`` the completions of a request come N requests later.
When ``import vllm`` works, vLLM 0.32's ``CPUOffloadingManager`` runs in the
same process on the same trace.

Figures: requests/s and block operations/s (a block passing through one of
lookup, prepare_load, complete_load, prepare_store, complete_store, touch:
3 x blocks + hits + stored per request), best of ``--repeats`` interleaved
runs (the medians are in the JSON and the summary); the hit rate (blocks
loaded / blocks requested); and bytes per tracked block: tracemalloc's
traced memory after replaying the trace minus before creating the manager
-- everything the manager, its policy, index and slot pool hold, not the
keys (the caller's) -- divided by the blocks it tracks.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvhal.bench.common import result_header, write_outputs
from kvhal.bench.drivers import Driver, KvhalDriver, Request, TierIndexDriver
from kvhal.bench.tier_index import measure_recover
from kvhal.offload.keyindex import NATIVE
from kvhal.registry import PluginRegistry

#: Targets from the issue, checked on every run.
TARGET_SPEEDUP = 3.0
TARGET_BYTES_PER_BLOCK = 128


@dataclass(frozen=True)
class TraceSpec:
    documents: int = 2000
    prefix_blocks: int = 32
    tail_blocks: int = 4
    zipf: float = 1.0
    requests: int = 10000
    groups: int = 1
    seed: int = 0

    @property
    def working_set(self) -> int:
        """Distinct blocks the trace can touch."""
        return (self.documents * self.prefix_blocks + self.requests * self.tail_blocks) * self.groups


def make_trace(spec: TraceSpec) -> list[Request]:
    """The requests, every key a fresh bytes object (an engine hashes each request anew)."""
    rng = np.random.default_rng(spec.seed)
    weights = 1.0 / np.arange(1, spec.documents + 1) ** spec.zipf
    documents = rng.choice(spec.documents, size=spec.requests, p=weights / weights.sum())
    suffixes = [g.to_bytes(4, "big") for g in range(spec.groups)]
    trace = []
    for request, document in enumerate(documents.tolist()):
        blocks = [(document, j) for j in range(spec.prefix_blocks)]
        blocks += [(spec.documents + request, j) for j in range(spec.tail_blocks)]
        trace.append(
            [
                [d.to_bytes(16, "big") + j.to_bytes(16, "big") + suffix for d, j in blocks]
                for suffix in suffixes
            ]
        )
    return trace


@dataclass
class Replay:
    requests: int
    blocks: int
    hits: int
    stored: int
    seconds: float

    @property
    def operations(self) -> int:
        return 3 * self.blocks + self.hits + self.stored


def replay(driver: Driver, trace: Sequence[Request], inflight: int, tick: Callable[[], None]) -> Replay:
    pending: deque[object] = deque()
    hits = stored = blocks = 0
    start = time.perf_counter()
    for i, request in enumerate(trace):
        h, s, state = driver.start(request)
        hits += h
        stored += s
        pending.append(state)
        if len(pending) > inflight:
            driver.finish(pending.popleft())
        if i % 500 == 499:
            tick()
    while pending:
        driver.finish(pending.popleft())
    seconds = time.perf_counter() - start
    blocks = sum(len(keys) for request in trace for keys in request)
    return Replay(len(trace), blocks, hits, stored, seconds)


def measure_memory(make: Callable[[], Driver], trace: Sequence[Request], inflight: int) -> dict:
    """Bytes the manager holds per tracked block after ``trace`` (see the module docstring)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        driver = make()
        replay(driver, trace, inflight, lambda: None)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    tracked = driver.tracked()
    return {"bytes": held, "tracked_blocks": tracked, "bytes_per_block": held / max(tracked, 1)}


def vllm_factory(num_slots: int) -> tuple[Callable[[], Driver] | None, str]:
    """A maker of vLLM's driver, or None and why not."""
    if importlib.util.find_spec("vllm") is None:
        return None, "vllm is not installed"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep its start-up notes out of the table
    try:
        from kvhal.vllm.testing.baseline_manager import VLLMManagerDriver
    except Exception as exc:  # an installed but broken vLLM is reported, not fatal
        return None, f"import failed: {type(exc).__name__}: {exc}"
    return (lambda: VLLMManagerDriver(num_slots, "lru")), "vLLM " + _version("vllm")


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in (dist, f"{dist}-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "?"


def run_all(
    makers: dict[str, Callable[[], Driver]],
    trace: list[Request],
    memory_trace: list[Request],
    args: argparse.Namespace,
    console: Console,
) -> list[dict]:
    runs: dict[str, list[Replay]] = {label: [] for label in makers}
    ticks = len(trace) // 500
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("replaying", total=ticks * len(makers) * args.repeats + len(makers))
        for repeat in range(args.repeats):  # interleaved: load on a shared machine hits all alike
            for label, make in makers.items():
                progress.update(task, description=f"{label}: run {repeat + 1}/{args.repeats}")
                driver = make()
                gc.collect()
                runs[label].append(replay(driver, trace, args.inflight, lambda: progress.advance(task)))
                del driver
        rows = []
        for label, make in makers.items():
            progress.update(task, description=f"{label}: memory (tracemalloc)")
            memory = measure_memory(make, memory_trace, args.inflight)
            progress.advance(task)
            best = min(runs[label], key=lambda r: r.seconds)
            rows.append(
                {
                    "manager": label,
                    "requests_per_s": best.requests / best.seconds,
                    "median_requests_per_s": best.requests
                    / statistics.median(r.seconds for r in runs[label]),
                    "operations_per_s": best.operations / best.seconds,
                    "hit_rate": best.hits / best.blocks,
                    "hits": best.hits,
                    "blocks": best.blocks,
                    "stored": best.stored,
                    "seconds_all_runs": [r.seconds for r in runs[label]],
                    **memory,
                }
            )
    return rows


def check_targets(rows: list[dict]) -> dict:
    by_label = {r["manager"]: r for r in rows}
    ours = by_label.get("kvhal lru")
    theirs = next((r for r in rows if r["manager"].startswith("vLLM")), None)
    result: dict[str, Any] = {
        "bytes_per_block": ours["bytes_per_block"],
        "bytes_per_block_target": TARGET_BYTES_PER_BLOCK,
        "bytes_per_block_met": ours["bytes_per_block"] <= TARGET_BYTES_PER_BLOCK,
    }
    if theirs is not None:
        result.update(
            speedup=ours["requests_per_s"] / theirs["requests_per_s"],
            median_speedup=ours["median_requests_per_s"] / theirs["median_requests_per_s"],
            speedup_target=TARGET_SPEEDUP,
            speedup_met=ours["requests_per_s"] / theirs["requests_per_s"] >= TARGET_SPEEDUP,
            hit_rates_equal=ours["hits"] == theirs["hits"] and ours["stored"] == theirs["stored"],
            vllm_bytes_per_block=theirs["bytes_per_block"],
        )
    return result


def print_report(console: Console, rows: list[dict], targets: dict, spec: TraceSpec, args, why_no_vllm: str):
    table = Table(
        title=f"kvhal bench manager: {spec.requests} requests, {args.slots} slots, "
        f"working set {spec.working_set} blocks, {args.inflight} in flight"
    )
    for column in ("manager", "requests/s", "block ops/s", "hit rate", "bytes/block", "tracked"):
        table.add_column(column, justify="left" if column == "manager" else "right")
    for r in rows:
        table.add_row(
            r["manager"],
            f"{r['requests_per_s']:,.0f}",
            f"{r['operations_per_s']:,.0f}",
            f"{r['hit_rate']:.4f}",
            f"{r['bytes_per_block']:.1f}",
            str(r["tracked_blocks"]),
        )
    console.print(table)
    met = {True: "[green]met[/green]", False: "[red]missed[/red]"}
    if "speedup" in targets:
        console.print(
            f"kvhal lru vs vLLM lru: {targets['speedup']:.2f}x requests/s, best of {args.repeats} "
            f"(medians: {targets['median_speedup']:.2f}x; target >= {TARGET_SPEEDUP:.0f}x): "
            f"{met[targets['speedup_met']]}"
        )
        console.print(
            "hit rates "
            + (
                "equal (same hits and stores, block for block)"
                if targets["hit_rates_equal"]
                else "[yellow]differ[/yellow]: with requests in flight vLLM does not count a block "
                "another request is still storing as used at request end; kvhal's touch does"
            )
        )
    else:
        console.print(f"[yellow]no vLLM baseline[/yellow]: {why_no_vllm}")
    console.print(
        f"bytes per tracked block: {targets['bytes_per_block']:.1f} (target <= {TARGET_BYTES_PER_BLOCK}): "
        f"{met[targets['bytes_per_block_met']]}"
        + (f"; vLLM {targets['vllm_bytes_per_block']:.0f}" if "vllm_bytes_per_block" in targets else "")
        + ("" if NATIVE else " [yellow](pure-Python key index: the C extension is not built)[/yellow]")
    )


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["manager"] for r in rows]
    colors = ["C3" if label.startswith("vLLM") else "C0" for label in labels]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, name in zip(
        axes,
        ("requests_per_s", "bytes_per_block", "hit_rate"),
        ("requests/s (higher is better)", "bytes per tracked block (lower is better)", "hit rate"),
        strict=True,
    ):
        values = [r[key] for r in rows]
        ax.bar(labels, values, color=colors)
        ax.set_title(name)
        ax.tick_params(axis="x", labelrotation=15, labelsize=8)
        for i, v in enumerate(values):
            ax.annotate(f"{v:,.4f}" if key == "hit_rate" else f"{v:,.0f}", (i, v), ha="center", va="bottom")
    axes[1].axhline(TARGET_BYTES_PER_BLOCK, color="k", linestyle="--", linewidth=1, label="target")
    axes[1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TraceSpec()
    parser.add_argument("--quick", action="store_true", help="2000 requests, one run (the demo)")
    parser.add_argument("--requests", type=int, help=f"requests in the trace (default {defaults.requests})")
    parser.add_argument("--documents", type=int, default=defaults.documents, help="shared documents")
    parser.add_argument("--prefix-blocks", type=int, default=defaults.prefix_blocks, help="blocks a prefix")
    parser.add_argument(
        "--tail-blocks", type=int, default=defaults.tail_blocks, help="unique blocks a request"
    )
    parser.add_argument("--zipf", type=float, default=defaults.zipf, help="Zipf exponent of popularity")
    parser.add_argument(
        "--groups", type=int, default=defaults.groups, help="KV cache groups (keys per block)"
    )
    parser.add_argument("--slots", type=int, default=8192, help="host-tier slots (default 8192)")
    parser.add_argument("--inflight", type=int, default=0, help="requests whose transfers are pending")
    parser.add_argument("--policies", nargs="+", default=["lru", "s3fifo"], help="kvhal policies to run")
    parser.add_argument("--repeats", type=int, help="interleaved runs per manager (best counts; default 3)")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's manager")
    parser.add_argument(
        "--tier-index", nargs="*", default=[], metavar="POLICY", help="also a TierIndex with these policies"
    )
    parser.add_argument("--recover-blocks", type=int, default=0, help="time TierIndex.recover of N blocks")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG")


def run(args: argparse.Namespace) -> int:
    console = Console()
    args.requests = args.requests or (2000 if args.quick else TraceSpec.requests)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if "lru" not in args.policies:
        args.policies = ["lru", *args.policies]
    spec = TraceSpec(
        args.documents, args.prefix_blocks, args.tail_blocks, args.zipf, args.requests, args.groups, args.seed
    )
    with console.status("building the trace"):
        trace = make_trace(spec)
    registry = PluginRegistry()
    makers: dict[str, Callable[[], Driver]] = {
        f"kvhal {policy}": (lambda p=policy: KvhalDriver(args.slots, p, registry)) for policy in args.policies
    }
    if args.tier_index:
        for policy in args.tier_index:
            makers[f"tier-index {policy}"] = lambda p=policy: TierIndexDriver(args.slots, p, registry)
    why_no_vllm = "--no-vllm"
    if not args.no_vllm:
        with console.status("importing vLLM"):
            vllm_make, why_no_vllm = vllm_factory(args.slots)
        if vllm_make is not None:
            makers[f"{why_no_vllm} lru"] = vllm_make
    # Memory needs the tier full and churning, not the whole trace under tracemalloc.
    memory_trace = trace[: max(len(trace) // 2, min(len(trace), 3000))]
    rows = run_all(makers, trace, memory_trace, args, console)
    targets = check_targets(rows)
    print_report(console, rows, targets, spec, args, why_no_vllm)
    result = {
        **result_header("manager"),
        "trace": {**asdict(spec), "working_set_blocks": spec.working_set},
        "slots": args.slots,
        "inflight": args.inflight,
        "repeats": args.repeats,
        "native_key_index": NATIVE,
        "rows": rows,
        "targets": targets,
    }
    if args.recover_blocks:
        with console.status(f"TierIndex.recover of {args.recover_blocks} blocks"):
            result["recover"] = measure_recover(args.recover_blocks)
        console.print(
            f"TierIndex.recover: {args.recover_blocks} blocks in {result['recover']['seconds']:.3f} s, "
            f"{result['recover']['blocks_per_s'] / 1e6:.2f}M blocks/s"
        )
    json_path, png_path = write_outputs(args.out, "manager", result)
    plot(rows, png_path, f"{spec.requests} requests, {args.slots} slots, working set {spec.working_set}")
    console.print(f"wrote {json_path} and {png_path}")
    return 0
