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
``tier_loaded_blocks`` (``vllm:kvhal_tier_loaded_blocks{tier="disk"}``) says how many
blocks came from the disk.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import tempfile
from pathlib import Path

from rich.progress import Progress

from kvhal.bench.common import console as make_console
from kvhal.bench.common import parse_size, result_header, write_outputs
from kvhal.bench.disk.report import check_targets, plot, print_storage, print_targets, print_ttft
from kvhal.bench.disk.storage import (
    LIMIT_CHUNK,
    drop_cache,
    index_memory,
    throughput,
    warm_restart,
)
from kvhal.bench.ttft import TTFTRig, add_ttft_arguments
from kvhal.tiers.disk.format import TREE

# ---------------------------------------------------------------------- TTFT


def ttft(folder: str, prompt_len: int, repeats: int, models: Path, progress: Progress) -> dict:
    """Recompute, host hit and disk hit, medians of ``repeats`` distinct prompts (engines in subprocesses)."""
    rig = TTFTRig(prompt_len, repeats, models, progress, scenarios=4)
    # the timeout policy: a disk hit is measured reading (auto may recompute a read it
    # predicts slower, the choice the chat bench's slow configuration measures)
    disk = {
        "disk_path": os.path.join(folder, "e2e-disk"),
        "disk_bytes_to_use": 1 << 30,
        "lower_tier_wait_policy": "timeout",
    }
    recompute, host = rig.recompute(), rig.host_hit()
    written = rig.populate("writing the prompts to disk", {"cpu_bytes_to_use": 2 << 30, **disk})
    tier_files = glob.glob(os.path.join(disk["disk_path"], TREE, "m-*", "rank*", "*.bin"))
    drop_cache(tier_files)  # nothing there with O_DIRECT; a buffered fallback's pages go too
    from_disk = rig.hits(
        "disk hit (a fresh engine)", {"cpu_bytes_to_use": rig.small_host, **disk}, "disk hit"
    )
    table = [rig.category("recompute", recompute), rig.category("host hit", host)]
    table.append(rig.category("disk hit", from_disk))
    outputs = {r["category"]: r.pop("outputs") for r in table}
    by = {r["category"]: r["ttft_s"] for r in table}
    written_counts, read = rig.metrics(written, "disk"), rig.metrics(from_disk, "disk")
    return {
        **rig.header(),
        "rows": table,
        "disk_vs_recompute": by["disk hit"] / by["recompute"],
        "host_vs_recompute": by["host hit"] / by["recompute"],
        "disk_vs_host": by["disk hit"] / by["host hit"],
        "outputs_equal": outputs["disk hit"] == outputs["recompute"] == outputs["host hit"],
        "tier_written_blocks": written_counts.get("tier_written_blocks", 0),
        **{
            name: read.get(name, 0)
            for name in (
                "tier_recovered_blocks",
                "tier_loaded_blocks",
                "tier_read_bytes",
                "tier_corrupt_blocks",
            )
        },
        "disk_hit_prompts": repeats + 1,  # the warm-up's disk hit counts too
    }


# ---------------------------------------------------------------------- report


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
    add_ttft_arguments(parser)
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
