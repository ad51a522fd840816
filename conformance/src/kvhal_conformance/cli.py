"""``kvhal conformance --device NAME [--report DIR] [pytest args]``: run the suite.

Everything not recognised here goes to pytest (``-k``, ``-x``, ``-v`` ...). The
suite runs with its own pytest configuration, not the current project's.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvhal_conformance.settings import DEFAULT_THROUGHPUT_FLOOR

PACKAGE_DIR = Path(__file__).resolve().parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvhal conformance",
        description="Run kvhal's conformance suite against a device plugin; other arguments go to pytest.",
    )
    parser.add_argument("--device", required=True, metavar="NAME", help="the kvhal device plugin to test")
    parser.add_argument("--report", metavar="DIR", help="write NAME.json and NAME.md into DIR")
    parser.add_argument(
        "--plugin",
        action="append",
        metavar="MODULE:ATTR",
        help="test this plugin object (registered as NAME) instead of an installed one",
    )
    parser.add_argument(
        "--throughput-floor",
        type=float,
        metavar="RATIO",
        help=f"fail copies slower than RATIO times a plain torch copy (default {DEFAULT_THROUGHPUT_FLOOR})",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes (CI); publish full-size reports")
    parser.add_argument("--seed", type=int, metavar="N", help="seed of the random block mappings")
    parser.add_argument(
        "--backends",
        action="append",
        metavar="NAME,NAME",
        help="attention backend names of your kernels (comma-separated), asked of kvhal_kv_layouts",
    )
    parser.add_argument(
        "--trace",
        action="append",
        metavar="PATH",
        help="also replay this worker trace (KVHAL_TRACE_DIR's .json.gz) in the worker-path contract",
    )
    return parser


def pytest_args(argv: Sequence[str]) -> list[str]:
    """The pytest command line for ``kvhal conformance ARGV``."""
    args, rest = build_parser().parse_known_args(list(argv))
    out = ["-c", str(PACKAGE_DIR / "conformance.ini"), "--rootdir", str(PACKAGE_DIR)]
    # This module imported the package already, so pytest cannot rewrite the plugin's asserts
    # (it has none; the test modules, imported later, are rewritten).
    out += ["-W", "ignore:Module already imported so cannot be rewritten:pytest.PytestAssertRewriteWarning"]
    out += ["--pyargs", "kvhal_conformance", "--kvhal-device", args.device]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        out += ["-p", "kvhal_conformance.plugin"]
    if args.report:
        out += ["--kvhal-report", str(Path(args.report).resolve())]
    for spec in args.plugin or ():
        out += ["--kvhal-plugin", spec]
    if args.throughput_floor is not None:
        out += ["--kvhal-throughput-floor", str(args.throughput_floor)]
    if args.quick:
        out.append("--kvhal-quick")
    if args.seed is not None:
        out += ["--kvhal-seed", str(args.seed)]
    for backends in args.backends or ():
        out += ["--kvhal-backends", backends]
    for trace in args.trace or ():
        out += ["--kvhal-trace", str(Path(trace).resolve())]
    if not any(a.startswith("--tb") for a in rest):
        out.append("--tb=short")  # the messages say what broke; frames add little
    return out + rest


def main(argv: Sequence[str]) -> int:
    """Run the suite; pytest's exit code (0: every contract passed or was skipped)."""
    if os.getcwd() not in sys.path:  # --plugin MODULE may live here, as with `python -m pytest`
        sys.path.insert(0, os.getcwd())
    return int(pytest.main(pytest_args(argv)))
