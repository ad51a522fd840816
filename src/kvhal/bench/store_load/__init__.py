"""``kvhal bench store-load``: a shared store under a fleet's load, with faults mid-run.

For each store (``redis``: one server; ``cluster``: a Redis Cluster of 3 masters;
``mooncake``: a master and a store node; each started here on loopback, behind a TCP proxy
that can stall, :mod:`~kvhal.bench.store_load.rigs`), ``--clients`` processes each run
kvhal's own remote tier (:class:`~kvhal.tiers.remote.tier.RemoteTier`, ``io`` role, values
signed with a secret: the real format) over a CPU host tier's slots, as an engine's worker
does: batches of blocks written and read, ``--inflight`` at a time, some shared by every
client (a prefix the fleet writes at once), some a client's own, read by all. A block's
content is a function of its key, so every byte read is checked (:mod:`.blocks`).

Faults are dealt at even intervals over ``--duration``: ``kill`` (a client SIGKILLed while
a batch write of it is in flight, replaced at once by a fresh process), ``pause`` (``CLIENT
PAUSE ... ALL`` on every Redis master), ``stall`` (the proxies stop delivering: the
clients' network path), ``restart`` (a server killed and started again: Redis and the
cluster's master lose their values, no persistence; Mooncake's master loses every name).

Reported per store: blocks per second held (overall, and before, during and after each
fault), read latency p50/p99 (a batch, from its call to its answer), values lost (written,
acknowledged, then absent at the end: those written before a restart began are expected
and said so; others must be 0), values served wrong (must be 0), host slots leaked when the
clients drained (must be 0), batches past their deadline, the remote tier's own counts
(unreachable transitions, values refused), and the names a killed client left mid-write
(written again by the checker: when they could be stored again). A table (rich), JSON and a
PNG of blocks/s over time.

The clients, the servers and the proxies share the machine: on a small one the figures
are the machine's, not the store's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvhal.bench.common import console as make_console
from kvhal.bench.common import parse_size, result_header, write_outputs
from kvhal.bench.store_load.figures import failures
from kvhal.bench.store_load.fleet import ClientPool, LoadConfig, run_store
from kvhal.bench.store_load.report import plot, print_failures, print_faults, print_stores
from kvhal.bench.store_load.rigs import FAULTS, STORES
from kvhal.errors import ValidationError

#: LoadConfig's fields whose command-line flag has another name
FLAGS = {
    "duration_s": "duration",
    "block_bytes": "block",
    "pause_s": "pause",
    "stall_s": "stall",
    "window_s": "window",
    "op_deadline_s": "op_deadline",
    "drain_s": "drain",
    "blocked_wait_s": "blocked_wait",
    "mooncake_discard_s": "mooncake_discard",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = LoadConfig()
    parser.add_argument(
        "--stores", nargs="+", choices=STORES, default=list(STORES), help="default: all three"
    )
    parser.add_argument(
        "--clients", type=int, default=d.clients, help=f"client processes (default {d.clients})"
    )
    parser.add_argument("--duration", type=float, default=d.duration_s, help="seconds per store (default 60)")
    parser.add_argument("--block", type=parse_size, default=d.block_bytes, help="block size (default 64K)")
    parser.add_argument("--batch", type=int, default=d.batch, help=f"blocks per call (default {d.batch})")
    parser.add_argument(
        "--inflight", type=int, default=d.inflight, help="calls in flight per client (default 2)"
    )
    parser.add_argument("--write-fraction", type=float, default=d.write_fraction, help="default 0.5")
    parser.add_argument(
        "--shared-fraction", type=float, default=d.shared_fraction, help="batches of the shared blocks (0.25)"
    )
    parser.add_argument("--own-blocks", type=int, default=d.own_blocks, help="each client's blocks (512)")
    parser.add_argument("--shared-blocks", type=int, default=d.shared_blocks, help="blocks all share (512)")
    parser.add_argument(
        "--faults", nargs="*", choices=FAULTS, default=list(FAULTS), help="in this order (default: all)"
    )
    parser.add_argument("--pause", type=float, default=d.pause_s, help="CLIENT PAUSE seconds (default 3)")
    parser.add_argument("--stall", type=float, default=d.stall_s, help="stall seconds (default 6)")
    parser.add_argument("--window", type=float, default=d.window_s, help="seconds before/after a fault (2)")
    parser.add_argument("--op-deadline", type=float, default=d.op_deadline_s, help="a batch's deadline (30)")
    parser.add_argument("--drain", type=float, default=d.drain_s, help="seconds to drain at the end (30)")
    parser.add_argument(
        "--blocked-wait",
        type=float,
        default=d.blocked_wait_s,
        help="how long the check waits for names a killed client left to be writable again (60)",
    )
    parser.add_argument(
        "--mooncake-discard",
        type=int,
        default=d.mooncake_discard_s,
        help="the Mooncake master's put_start_discard_timeout_sec (default: Mooncake's, 30 s)",
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG")


def config_of(args: argparse.Namespace) -> LoadConfig:
    config = LoadConfig(
        clients=args.clients,
        duration_s=args.duration,
        block_bytes=args.block,
        batch=args.batch,
        inflight=args.inflight,
        write_fraction=args.write_fraction,
        shared_fraction=args.shared_fraction,
        own_blocks=args.own_blocks,
        shared_blocks=args.shared_blocks,
        faults=tuple(args.faults),
        pause_s=args.pause,
        stall_s=args.stall,
        window_s=args.window,
        op_deadline_s=args.op_deadline,
        drain_s=args.drain,
        blocked_wait_s=args.blocked_wait,
        mooncake_discard_s=args.mooncake_discard,
        seed=args.seed,
    )
    config.check()
    return config


def run(args: argparse.Namespace) -> int:
    console = make_console()
    try:
        config = config_of(args)
    except ValidationError as exc:  # named as the command line names it
        flag = "--" + FLAGS.get(exc.argument, exc.argument).replace("_", "-")
        message = str(exc).removeprefix(f"{exc.argument}: ")
        console.print(f"[red]kvhal bench store-load[/red]: {flag}: {message}")
        return 2
    rows = []
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with ClientPool() as pool, Progress(*columns, console=console, transient=True) as progress:
        for kind in args.stores:
            task = progress.add_task(kind, total=config.duration_s)
            began = time.monotonic()

            def tick(what: str, t: float, task: int = task, kind: str = kind) -> None:
                progress.update(task, completed=min(t, config.duration_s), description=f"{kind}: {what}")

            rows.append(run_store(kind, config, pool, tick))
            rows[-1]["wall_s"] = time.monotonic() - began
            progress.remove_task(task)
    result = {**result_header("store-load"), "config": asdict(config), "stores": rows}
    result["failures"] = [line for row in rows for line in failures(row)]
    print_stores(console, result)
    print_faults(console, result)
    print_failures(console, result["failures"])
    json_path, png_path = write_outputs(args.out, "store-load", result)
    plot(result, png_path)
    console.print(f"wrote {json_path} and {png_path}")
    return 1 if result["failures"] else 0
