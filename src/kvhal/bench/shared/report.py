"""``kvhal bench shared``'s targets, tables and plot."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvhal.bench.common import size_name
from kvhal.bench.shared.stores import SECRET_VARIABLE
from kvhal.tiers.remote.format import HEADER_BYTES

#: Targets from the issue.
TARGET_SHARE = 0.8


TARGET_SHARED_VS_RECOMPUTE = 0.2


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
            f"{s['refused_blocks']:.0f}; loads failed {reader.get('tier_failed_loads', 0):.0f} "
            f"(of them timed out: {reader.get('tier_load_timeouts', 0):.0f}); shared hit "
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
