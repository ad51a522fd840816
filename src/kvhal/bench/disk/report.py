"""``kvhal bench disk``'s targets, tables and plot."""

from __future__ import annotations

import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvhal.bench.common import size_name
from kvhal.bench.disk.storage import TARGET_SHARE, TARGET_SHARE_FROM_BLOCK

TARGET_DISK_VS_RECOMPUTE = 0.15


TARGET_INDEX_BYTES = 32


TARGET_RECOVER_RATE = 1e6


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
