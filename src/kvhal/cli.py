"""The ``kvhal`` command: ``kvhal devices``, ``bench ...``, ``conformance``, ``new-plugin``,
``config check``, ``size``, ``--version``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from kvhal import build_info
from kvhal.bench.common import console as make_console
from kvhal.registry import PluginRegistry
from kvhal.selection import Selection

#: ``kvhal bench NAME`` -> module with ``add_arguments(parser)`` and ``run(args) -> int``.
BENCHMARKS = {
    "chat": "kvhal.bench.chat",
    "copy": "kvhal.bench.copy",
    "disk": "kvhal.bench.disk",
    "e2e": "kvhal.bench.e2e",
    "manager": "kvhal.bench.manager",
    "shared": "kvhal.bench.shared",
    "store-load": "kvhal.bench.store_load",
}


def devices_report(selection: Selection) -> dict:
    """Every plugin found, what its probe said, and which one is selected (JSON-able)."""
    chosen = selection.device.plugin_name if selection.device else None
    rows = []
    outcomes = {o.info.name: o for o in selection.outcomes}
    registry_plugins = [o.info for o in selection.outcomes]
    for info in registry_plugins:
        outcome = outcomes[info.name]
        d = outcome.descriptor
        if info.name == chosen:
            status = "selected"
        elif outcome.error is not None:
            status = "error"
        elif d is not None:
            status = "present"
        else:
            status = "declined"
        rows.append(
            {
                "plugin": info.name,
                "distribution": info.distribution,
                "status": status,
                "reason": selection.why if status == "selected" else selection.others.get(info.name),
                "device": d.name if d else None,
                "torch_device_type": d.torch_device_type if d else None,
                "vendor": d.vendor if d else None,
                "priority": d.priority if d else None,
                "capabilities": sorted(d.capabilities) if d else [],
                "details": dict(d.details) if d else {},
            }
        )
    return {
        "selected": chosen,
        "why": selection.why if chosen else None,
        "error": str(selection.error) if selection.error else None,
        "plugins": rows,
    }


def _devices_blocked(registry: PluginRegistry) -> list[dict]:
    return [
        {"plugin": p.name, "distribution": p.distribution, "status": "not loaded", "reason": p.blocked_by}
        for p in registry.plugins
        if p.blocked_by
    ]


def cmd_devices(args: argparse.Namespace) -> int:
    registry = PluginRegistry()
    selection = registry.explain(args.device, device_type=args.device_type)
    report = devices_report(selection)
    report["plugins"].extend(_devices_blocked(registry))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["selected"] else 1
    console = make_console()
    table = Table(title="kvhal device plugins")
    for column in ("plugin", "distribution", "status", "why", "priority", "capabilities"):
        table.add_column(column, overflow="fold")
    for row in report["plugins"]:
        cells = (
            row["plugin"],
            row.get("distribution") or "",
            row["status"],
            row.get("reason") or "",
            "" if row.get("priority") is None else str(row["priority"]),
            ", ".join(row.get("capabilities", [])),
        )
        table.add_row(*(escape(cell) for cell in cells))  # reasons may contain [brackets]
    console.print(table)
    if report["selected"]:
        console.print(f"selected: [bold]{escape(report['selected'])}[/bold] ({escape(report['why'])})")
        for row in report["plugins"]:
            if row["plugin"] == report["selected"] and row["details"]:
                for key, value in row["details"].items():
                    console.print(f"  {escape(key)}: {escape(value)}")
        return 0
    console.print(f"[red]no device selected[/red]: {escape(report['error'])}")
    return 1


def cmd_bench(args: argparse.Namespace) -> int:
    return args.bench_run(args)


def cmd_demo(args: argparse.Namespace) -> int:
    """vLLM serving with kvhal on the auto-selected device: the TTFT table."""
    from kvhal.bench import e2e
    from kvhal.bench.common import native_dtype

    if args.dtype == "auto":
        args.dtype = native_dtype()
    e2e.run_bench(args, e2e.DEMO_MODEL, "demo")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    """Replay worker traces on a device plugin: a table per trace, 1 if any was wrong."""
    from kvhal.replay import replay
    from kvhal.vllm.trace import TraceError

    console = make_console()
    results, status = [], 0
    for path in args.traces:
        try:
            result = replay(path, args.device, tokens=args.tokens)
        except TraceError as exc:
            console.print(f"[red]{escape(str(path))}: refused: {escape(str(exc))}[/red]")
            status = max(status, 2)
            continue
        summary = result.summary()
        results.append(summary)
        table = Table(title=f"{result.trace} on {result.device}: {result.status}")
        for column in ("call", "calls", "median us", "p90 us", "total ms"):
            table.add_column(column, justify="left" if column == "call" else "right")
        for name, row in summary["calls"].items():
            table.add_row(
                name,
                str(row["calls"]),
                f"{row['median_us']:.1f}",
                f"{row['p90_us']:.1f}",
                f"{row['total_ms']:.1f}",
            )
        console.print(table)
        console.print(
            f"{result.steps} steps, {result.jobs} jobs; blocks checked: {result.blocks_loaded} loaded, "
            f"{result.blocks_stored} stored ({result.blocks_unchecked} loaded blocks unchecked: no store "
            f"of the trace made them); kvhal's calls a step: median "
            f"{summary.get('step_median_us', 0):.0f} us, p90 {summary.get('step_p90_us', 0):.0f} us; "
            f"{result.wall_s:.1f} s"
        )
        if result.reason:
            console.print(f"{result.status}: {escape(result.reason)}")
        for failure in result.failures[1:]:
            console.print(f"  {escape(failure)}")
        if result.status == "failed":
            status = max(status, 1)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return status


def cmd_conformance(args: argparse.Namespace) -> int:
    try:
        runner = importlib.import_module("kvhal_conformance.cli")
    except ImportError:
        print(
            "kvhal conformance needs the kvhal-conformance package (pip install ./conformance)",
            file=sys.stderr,
        )
        return 2
    return runner.main(args.conformance_args)


def cmd_new_plugin(args: argparse.Namespace) -> int:
    from kvhal.errors import ValidationError
    from kvhal.scaffold import write_plugin

    try:
        root = write_plugin(args.name, args.dir)
    except ValidationError as exc:
        print(f"kvhal new-plugin: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {root}: every hook is a stub naming its section of kvhal's docs/vendor-guide.md")
    print(f"next: pip install -e '{root}[test]' && kvhal conformance --device {args.name} --quick")
    return 0


def read_config_argument(text: str | None, file: Path | None) -> tuple[str, str]:
    """The kv-transfer-config's text and where it came from: inline JSON, ``@FILE`` or ``--file FILE``.

    :raises ValidationError: no configuration, or two, or a file that cannot be read.
    """
    from kvhal.errors import ValidationError

    if (text is None) == (file is None):
        raise ValidationError("kv-transfer-config", "give it once: inline JSON, @FILE, or --file FILE")
    if text is not None and not text.startswith("@"):
        return text, "kv-transfer-config"
    path = file if file is not None else Path(text[1:])  # type: ignore[index]
    try:
        return path.read_text(), str(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError(str(path), f"cannot be read: {getattr(exc, 'strerror', None) or exc}") from None


def config_summary(settings: object) -> str:
    """What a configuration that passed sets up, in one line per part."""
    from kvhal.vllm.extra_config import ExtraSettings, RemoteTierConfig

    assert isinstance(settings, ExtraSettings)
    lines = [f"host tier: {settings.cpu_bytes_to_use} bytes of pinned host memory per engine"]
    for tier in settings.tiers:
        if isinstance(tier, RemoteTierConfig):
            lines.append(
                f"store {tier.name!r}: {tier.url} (its scheme is offered; the store is not contacted)"
            )
        else:
            options = ", ".join(f"{k}={v}" for k, v in tier.options.items())
            lines.append(f"local tier {tier.name!r}: backend {tier.backend} ({options})")
    return "\n".join(lines)


def cmd_config_check(args: argparse.Namespace) -> int:
    """``kvhal config check``: the connector's checks on a kv-transfer-config, no engine, no model."""
    from kvhal.errors import ValidationError
    from kvhal.vllm.config_check import check_kv_transfer, parse_transfer_config

    try:
        text, source = read_config_argument(args.config, args.file)
        settings = check_kv_transfer(parse_transfer_config(text, source))
    except ValidationError as exc:
        print(f"kvhal config check: {exc}", file=sys.stderr)
        return 1
    print(f"ok: {source} is a configuration KVHALConnector starts with")
    print(config_summary(settings))
    return 0


def version_text() -> str:
    """``kvhal --version``: kvhal's and every plugin distribution's version, and the C
    extensions built (a missing one runs a slower path: its warning says what it costs)."""
    lines = [f"{name} {version}" for name, version in build_info.distribution_versions().items()]
    status = build_info.extension_status()
    missing = {module: reason for module, reason in status.items() if reason is not None}
    lines.append(f"C extensions: {len(status) - len(missing)} of {len(status)} built")
    by_module = {ext.module: ext for ext in build_info.EXTENSIONS}
    lines += [build_info.missing_extension_warning(by_module[m], reason) for m, reason in missing.items()]
    return "\n".join(lines)


class _Version(argparse.Action):
    # computed when asked for, not at every parser build (it imports the extensions)
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the versions of kvhal and its plugins")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(version_text())
        parser.exit()


def add_config_parser(sub: argparse._SubParsersAction) -> None:
    """``kvhal config check``."""
    config = sub.add_parser("config", help="check a kv-transfer-config without vLLM's engine or a model")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser(
        "check",
        help="run the connector's checks on a kv-transfer-config JSON: non-zero naming the key at fault",
    )
    check.add_argument("config", nargs="?", help="the JSON of --kv-transfer-config, or @FILE")
    check.add_argument("--file", type=Path, help="a file holding the JSON")
    check.set_defaults(func=cmd_config_check)


def add_size_parser(sub: argparse._SubParsersAction) -> None:
    """``kvhal size MODEL``: KV bytes per token and each tier's budget (:mod:`kvhal.sizing`)."""
    from kvhal import sizing

    size = sub.add_parser("size", help="a model's KV bytes per token, and each tier's budget for a workload")
    sizing.add_arguments(size)
    size.set_defaults(func=sizing.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvhal", description=__doc__)
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)

    devices = sub.add_parser("devices", help="list device plugins, their probes, and the selected one")
    devices.add_argument("--json", action="store_true", help="print JSON instead of a table")
    devices.add_argument("--device", help="select this plugin (as KVHAL_DEVICE would)")
    devices.add_argument("--device-type", help="select among plugins serving this torch device type")
    devices.set_defaults(func=cmd_devices)

    bench = sub.add_parser("bench", help="benchmarks: print a table, write JSON (and a plot)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        bench_parser = bench_sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(bench_parser)
        run: Callable[[argparse.Namespace], int] = module.run
        bench_parser.set_defaults(func=cmd_bench, bench_run=run)

    demo = sub.add_parser("demo", help="vLLM with kvhal on the auto-selected device: a TTFT table")
    demo.add_argument("--prompt-len", type=int, default=1024)
    demo.add_argument("--repeats", type=int, default=2)
    demo.add_argument("--models", type=Path, default=Path.home() / ".cache" / "kvhal-bench-models")
    demo.add_argument("--out", type=Path, default=Path("bench-results"))
    demo.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="the engines' dtype (auto: bfloat16 where the CPU has AVX512-BF16 or AMX, else float32)",
    )
    demo.set_defaults(
        func=cmd_demo,
        no_throughput=True,
        rounds=0,
        malloc_default=False,
        env=[],
        print_targets=False,
    )

    new_plugin = sub.add_parser("new-plugin", help="write the package of a new device plugin, hooks stubbed")
    new_plugin.add_argument("name", help="the plugin's name (its entry point; KVHAL_DEVICE=NAME selects it)")
    new_plugin.add_argument("--dir", type=Path, default=Path("."), help="write kvhal-NAME/ here (default: .)")
    new_plugin.set_defaults(func=cmd_new_plugin)

    add_config_parser(sub)
    add_size_parser(sub)

    replay = sub.add_parser(
        "replay", help="run recorded vLLM worker traces on a device plugin, checking every block (no vLLM)"
    )
    replay.add_argument("traces", nargs="+", type=Path, help="trace files (KVHAL_TRACE_DIR's, or kept ones)")
    replay.add_argument("--device", help="the device plugin (default: the auto-selected one)")
    replay.add_argument("--tokens", type=int, default=64, help="tokens of the stand-in forward per layer")
    replay.add_argument("--json", type=Path, help="write every trace's result here")
    replay.set_defaults(func=cmd_replay)

    conformance = sub.add_parser("conformance", help="run the conformance suite against a device plugin")
    conformance.add_argument(
        "conformance_args", nargs=argparse.REMAINDER, help="see kvhal conformance --help"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["conformance"]:  # its own parser takes every remaining option
        return cmd_conformance(argparse.Namespace(conformance_args=argv[1:]))
    if argv[:1] in (["config"], ["size"]):  # in seconds: without importing every benchmark's parser
        parser = argparse.ArgumentParser(prog="kvhal")
        sub = parser.add_subparsers(dest="command", required=True)
        (add_config_parser if argv[0] == "config" else add_size_parser)(sub)
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
