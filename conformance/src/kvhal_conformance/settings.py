"""The suite's command-line options and the sizes they select."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

import pytest

DEFAULT_THROUGHPUT_FLOOR = 0.25
MiB = 1 << 20


@dataclass(frozen=True)
class Sizes:
    """How much work each check does; vendors run the full sizes, CI the quick ones.

    :param busy_seconds: how long a stream is kept busy (sized from a measured copy) when
        a check needs work still running, e.g. to see an event incomplete.
    :param scratch_bytes: the scratch caches whose copies keep streams busy.
    :param watched_bytes: the copy whose event is watched while it runs: 64-byte pieces, so
        that it takes a while on any device without needing much memory.
    :param large_batch: blocks in the "large batch" copies (one descriptor or more each).
    :param throughput_bytes: bytes moved per throughput measurement.
    :param throughput_repeats: measurements per side (the fastest counts).
    """

    busy_seconds: float
    scratch_bytes: int
    watched_bytes: int
    large_batch: int
    throughput_bytes: int
    throughput_repeats: int


FULL = Sizes(
    busy_seconds=0.25,
    scratch_bytes=64 * MiB,
    watched_bytes=64 * MiB,
    large_batch=2048,
    throughput_bytes=256 * MiB,
    throughput_repeats=7,
)
QUICK = Sizes(
    busy_seconds=0.06,
    scratch_bytes=16 * MiB,
    watched_bytes=32 * MiB,
    large_batch=512,
    throughput_bytes=32 * MiB,
    throughput_repeats=5,
)


@dataclass(frozen=True)
class Settings:
    """What the user asked for on the command line."""

    device: str | None
    plugins: tuple[str, ...]
    report_dir: Path | None
    throughput_floor: float
    quick: bool
    seed: int

    @property
    def sizes(self) -> Sizes:
        return QUICK if self.quick else FULL

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        seed = config.getoption("kvhal_seed")
        report = config.getoption("kvhal_report")
        return cls(
            device=config.getoption("kvhal_device"),
            plugins=tuple(config.getoption("kvhal_plugin") or ()),
            report_dir=Path(report) if report else None,
            throughput_floor=config.getoption("kvhal_throughput_floor"),
            quick=config.getoption("kvhal_quick"),
            seed=seed if seed is not None else secrets.randbelow(1 << 31),
        )


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvhal-conformance", "kvhal device plugin conformance suite")
    group.addoption(
        "--kvhal-device",
        metavar="NAME",
        help="run the conformance suite against the kvhal device plugin NAME "
        "(without it the suite's tests skip)",
    )
    group.addoption(
        "--kvhal-plugin",
        metavar="MODULE:ATTR",
        action="append",
        help="register this plugin object (a class is instantiated) under the --kvhal-device "
        "name instead of loading installed plugins; for plugins not installed through an entry point",
    )
    group.addoption("--kvhal-report", metavar="DIR", help="write NAME.json and NAME.md reports into DIR")
    group.addoption(
        "--kvhal-throughput-floor",
        metavar="RATIO",
        type=float,
        default=DEFAULT_THROUGHPUT_FLOOR,
        help="fail copies slower than RATIO times a plain torch copy of the same bytes "
        f"(default {DEFAULT_THROUGHPUT_FLOOR})",
    )
    group.addoption(
        "--kvhal-quick",
        action="store_true",
        help="smaller sizes (for CI); a published report should use the full sizes",
    )
    group.addoption(
        "--kvhal-seed", metavar="N", type=int, help="seed of the random block mappings (default: random)"
    )
