"""The shared tier: put/get throughput beside each store's own client, TTFT of a shared hit.

Throughput: for each store (Mooncake Store, Redis and an S3 object store, each started here on
loopback unless ``--mooncake-url`` / ``--redis-url`` / ``--s3-url`` names one: SeaweedFS's S3
gateway for S3, its credentials in the AWS variables for the run), block size and
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
  copies them into its host slots;
- S3: obstore's client (the one kvhal's store drives), one ``PUT`` (or range
  ``GET``) per block, a batch's requests at once, copied into the destination
  buffer.

What kvhal adds: a 96-byte header per value (:mod:`kvhal.tiers.remote.format`), its
crc32c on put and the check of header and crc32c on get; with Mooncake the
header is a second slice of each value (the header rows and the host slot are
apart), with Redis and S3 header and block are joined into one value (a copy) on put.
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
``tier_loaded_blocks`` of the store's tier (``vllm:kvhal_tier_loaded_blocks{tier="redis"}``,
``"mooncake"`` or ``"s3"``) says how many blocks engine B read from the store.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from rich.progress import Progress

from kvhal.bench.common import console as make_console
from kvhal.bench.common import parse_size, result_header, write_outputs
from kvhal.bench.counters import store_tier
from kvhal.bench.shared.report import check_targets, plot, print_targets, print_throughput, print_ttft
from kvhal.bench.shared.stores import SECRET_VARIABLE, STORES, store_server
from kvhal.bench.shared.throughput import throughput
from kvhal.bench.ttft import TTFTRig, add_ttft_arguments
from kvhal.tiers.remote.format import HEADER_BYTES

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
    rig = TTFTRig(prompt_len, repeats, models, progress, scenarios=2 + 2 * len(stores))
    table = [rig.category("recompute", rig.recompute()), rig.category("host hit", rig.host_hit())]
    for row in table:
        row["store"] = None
    shared: dict[str, dict] = {}
    for kind in stores:
        # each store's own server (or the one given): engine B finds only what engine A wrote
        with store_server(kind, urls.get(kind), 1 << 30) as (url, where):
            writer = rig.populate(
                f"{kind}: engine A writes the prompts to the store",
                # no HMAC, as the throughput rows (remote_auth "none": said in so many words)
                {"cpu_bytes_to_use": 2 << 30, "remote_url": url, "remote_auth": "none"},
            )
            reader = rig.hits(
                f"{kind}: a fresh engine B reads them",
                # the timeout policy: this measures the reading itself (as `bench disk` does)
                {
                    "cpu_bytes_to_use": rig.small_host,
                    "remote_url": url,
                    "remote_wait_policy": "timeout",
                    "remote_auth": "none",
                },
                "shared hit",
            )
        row = {**rig.category("shared hit", reader), "category": f"shared hit ({kind})", "store": kind}
        table.append(row)
        # the store's counters: the per-tier families, labelled with its URL's scheme
        written, read = rig.metrics(writer, store_tier(url)), rig.metrics(reader, store_tier(url))
        shared[kind] = {
            "where": where,
            "writer": {k: v for k, v in written.items() if k.startswith("tier_")},
            "reader": {k: v for k, v in read.items() if k.startswith("tier_")},
            "written_blocks": written.get("tier_written_blocks", 0),
            "loaded_blocks": read.get("tier_loaded_blocks", 0),
            "hit_tokens": read.get("tier_hit_tokens", 0),
            "refused_blocks": sum(
                read.get(f"tier_{c}_blocks", 0) for c in ("corrupt", "foreign", "unauthenticated")
            ),
        }
    rig.done()
    by = {r["category"]: r["ttft_s"] for r in table}
    reference = table[0]["outputs"]
    for r in table:
        r["outputs_equal_recompute"] = r.pop("outputs") == reference
    return {
        **rig.header(),
        "rows": table,
        "host_vs_recompute": by["host hit"] / by["recompute"],
        "shared_vs_recompute": {k: by[f"shared hit ({k})"] / by["recompute"] for k in stores},
        "shared_vs_host": {k: by[f"shared hit ({k})"] / by["host hit"] for k in stores},
        "outputs_equal": all(r["outputs_equal_recompute"] for r in table),
        "shared": shared,
        "shared_hit_prompts": repeats + 1,  # the warm-up's shared hit counts too
    }


# ---------------------------------------------------------------------- report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stores", nargs="+", choices=STORES, default=list(STORES), help="stores to measure (default: all)"
    )
    parser.add_argument(
        "--mooncake-url",
        help="measure this Mooncake Store (mooncake://...) instead of starting one on loopback",
    )
    parser.add_argument(
        "--redis-url", help="measure this Redis (redis://...) instead of starting one on loopback"
    )
    parser.add_argument(
        "--s3-url",
        help="measure this bucket (s3://BUCKET/PREFIX?endpoint=..., credentials in the AWS variables) "
        "instead of starting SeaweedFS on loopback",
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
    add_ttft_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG")


def run(args: argparse.Namespace) -> int:
    console = make_console()
    urls = {"mooncake": args.mooncake_url, "redis": args.redis_url, "s3": args.s3_url}
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
