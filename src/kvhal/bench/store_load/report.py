"""``kvhal bench store-load``'s tables and plot."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvhal.bench.store_load.rigs import FAULTS


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _bad(value: int) -> str:
    """A count that must be 0: red otherwise."""
    return f"[red]{value}[/red]" if value else "0"


def _killed(row: dict) -> str:
    """Names a killed client was writing, and when after the kill they could be stored again
    ("first check": at the check's first try, which began so long after the kill)."""
    left = row["killed_left"]
    if not left:
        return "-"
    if row["killed_left_never"]:
        return f"{left}, [red]{row['killed_left_never']} never[/red]"
    if row["killed_left_first_try"] == left:
        return f"{left}, at the first check ({row['killed_left_checked_s']:.1f} s)"
    return f"{left}, {row['killed_left_stored_s']:.1f} s"


def print_stores(console: Console, result: dict) -> None:
    rows = result["stores"]
    table = Table(
        title=f"kvhal bench store-load: {result['config']['clients']} client processes per store, "
        f"{result['config']['block_bytes'] >> 10} KiB blocks in batches of {result['config']['batch']}, "
        f"{result['machine'].get('cpu_count')} CPUs; blocks/s = blocks written (acknowledged) or read "
        "(served and checked, or a miss)"
    )
    columns = ["store", "s", "blocks/s", "failed/s", "read ms p50/p99", "no fault: p50/p99", "wrong", "lost"]
    columns += ["lost, no restart"]
    columns += [
        "leaked slots",
        "hung",
        "unreachable",
        "refused",
        "killed mid-write: names, stored again after",
    ]
    for column in columns:
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["store"],
            f"{r['duration_s']:.0f}",
            _rate(r["ops_s"]),
            _rate(r["failed_ops_s"]),
            f"{_ms(r['read_p50_ms'])} / {_ms(r['read_p99_ms'])}",
            f"{_ms(r['quiet_read_p50_ms'])} / {_ms(r['quiet_read_p99_ms'])}",
            _bad(r["wrong"]),
            f"{r['lost']} of {r['checked_at_end']}",
            _bad(r["lost_unexplained"]),
            _bad(r["leaked_slots"]),
            _bad(r["hung_ops"] + r["unclosed_tiers"]),
            str(r["unreachable"]),
            str(r["refused"]),
            _killed(r),
        )
    console.print(table)
    for r in rows:
        if r["restart_loses"] and r["lost"]:
            console.print(
                f"{r['store']}: a restart loses {r['restart_loses']}: {r['lost_to_restart']} lost so"
            )


def print_faults(console: Console, result: dict) -> None:
    table = Table(
        title=f"around each fault: blocks/s in the {result['config']['window_s']:g} s before, during, "
        f"the {result['config']['window_s']:g} s after; first block done after its end"
    )
    columns = ["store", "fault", "at s", "lasted s", "before", "during", "after", "held"]
    columns += ["first block after s", "failed during", "tiers down"]
    for column in columns:
        table.add_column(column, justify="right")
    for r in result["stores"]:
        for e in r["events"]:
            note = " (mid-write)" if e.get("writing") else ""
            table.add_row(
                r["store"],
                e["fault"] + note,
                f"{e['at_s']:.1f}",
                f"{e['end_s'] - e['at_s']:.1f}",
                _rate(e["before_ops_s"]),
                _rate(e["during_ops_s"]),
                _rate(e["after_ops_s"]),
                "-" if e["held_after"] is None else f"{e['held_after']:.0%}",
                "[red]never[/red]" if e["recovered_s"] is None else f"{e['recovered_s']:.1f}",
                str(e["failed_during"]),
                str(e["tiers_down"]),
            )
    console.print(table)


def print_failures(console: Console, failures: list[str]) -> None:
    if not failures:
        console.print(
            "[green]0 values served wrong, 0 slots leaked, 0 hangs, every fault recovered from[/green]"
        )
    for line in failures:
        console.print(f"[red]FAILED[/red] {escape(line)}")


def plot(result: dict, path: Path) -> None:
    """Blocks/s over time per store, each fault's window shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["stores"]
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 2.8 * max(1, len(rows))), squeeze=False)
    for ax, r in zip(axes[:, 0], rows, strict=True):
        step = r["bucket_s"]
        per = max(1, round(0.5 / step))  # 0.5 s bins
        series = r["ops_s_series"]
        bins = [sum(series[i : i + per]) / per for i in range(0, len(series), per)]
        ax.plot([i * per * step for i in range(len(bins))], bins, color="C0", lw=1.2)
        for e in r["events"]:
            end = max(e["end_s"], e["at_s"] + step)
            color = f"C{1 + FAULTS.index(e['fault'])}"  # a fault has its colour in every panel
            ax.axvspan(e["at_s"], end, color=color, alpha=0.3, label=e["fault"])
        ax.axvline(r["duration_s"], color="grey", ls=":", lw=1)
        ax.set_title(
            f"{r['store']}: {r['ops_s']:,.0f} blocks/s, read p99 {_ms(r['read_p99_ms'])} ms, "
            f"{r['wrong']} wrong, {r['leaked_slots']} slots leaked",
            fontsize=9,
        )
        ax.set_ylabel("blocks/s")
        ax.set_ylim(bottom=0)
        if r["events"]:
            ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds into the run (dotted: the clients told to stop)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
