"""The suite's command-line options and the sizes they select."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
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
    :param large_batch: blocks in the "large batch" copies (one descriptor or more each).
    :param large_copy_bytes: the "large" copies of the ordering and event checks: 64-byte
        pieces, so that one takes a while on any device without needing much memory.
    :param cache_bytes: the KV cache whose zeroing is checked at a realistic size.
    :param tier_bytes: the host buffer the size of a host tier (zeroing, reuse, pinning).
    :param throughput_bytes: bytes moved per throughput measurement.
    :param throughput_repeats: measurements per side (the fastest counts).
    :param witness_bytes: the large host buffers whose pinning is witnessed, each bounded by
        the memory the machine has available (:mod:`kvhal_conformance.pinning`); none: the
        host tier's size.
    """

    busy_seconds: float
    scratch_bytes: int
    large_batch: int
    large_copy_bytes: int
    cache_bytes: int
    tier_bytes: int
    throughput_bytes: int
    throughput_repeats: int
    witness_bytes: tuple[int, ...] = ()


#: The presets, the fields of :class:`Sizes` in order, every ``*_bytes`` in MiB. ``full`` is for
#: the published report, ``quick`` for CI; ``tiny`` is the least the checks still hold at on a
#: CPU, for running the suite many times over (against every mutant of the CPU plugin).
PRESETS = {
    name: Sizes(busy, scratch * MiB, batch, large * MiB, cache * MiB, tier * MiB, throughput * MiB, repeats)
    for name, (busy, scratch, batch, large, cache, tier, throughput, repeats) in {
        #        busy s  scratch  batch  large copy  cache  tier  throughput  repeats
        "full":  (0.25,  64,      2048,  32,         256,   1024, 256,        7),
        "quick": (0.06,  16,      512,   8,          32,    64,   32,         5),
        "tiny":  (0.03,  8,       256,   4,          16,    16,   16,         2),
    }.items()
}  # fmt: skip
#: The large buffers whose pinning is witnessed, per preset: just over 256 MiB and just over
#: 2 GiB (where a 32-bit size overflows), a host tier, 4 GiB; one of gigabytes in ``quick``.
WITNESS_BYTES = {
    "full": (257 * MiB, 1024 * MiB, 2112 * MiB, 4096 * MiB),
    "quick": (2112 * MiB,),
    "tiny": (257 * MiB,),
}
PRESETS = {name: replace(sizes, witness_bytes=WITNESS_BYTES[name]) for name, sizes in PRESETS.items()}
FULL, QUICK, TINY = PRESETS["full"], PRESETS["quick"], PRESETS["tiny"]


@dataclass(frozen=True)
class Settings:
    """What the user asked for on the command line."""

    device: str | None
    plugins: tuple[str, ...]
    report_dir: Path | None
    throughput_floor: float
    size_preset: str
    seed: int
    pin_timeout: float = 60.0
    #: attention backend names of the vendor's kernels, asked of ``kvhal_kv_layouts`` besides
    #: vLLM's and those the plugin declares (``ATTENTION_BACKENDS``)
    backends: tuple[str, ...] = ()
    #: worker traces replayed besides the kept ones (``--kvhal-trace``)
    traces: tuple[Path, ...] = ()

    @property
    def sizes(self) -> Sizes:
        return PRESETS[self.size_preset]

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        seed = config.getoption("kvhal_seed")
        report = config.getoption("kvhal_report")
        return cls(
            device=config.getoption("kvhal_device"),
            plugins=tuple(config.getoption("kvhal_plugin") or ()),
            report_dir=Path(report) if report else None,
            throughput_floor=config.getoption("kvhal_throughput_floor"),
            size_preset=config.getoption("kvhal_sizes")
            or ("quick" if config.getoption("kvhal_quick") else "full"),
            seed=seed if seed is not None else secrets.randbelow(1 << 31),
            pin_timeout=config.getoption("kvhal_pin_timeout"),
            backends=parse_backends(config.getoption("kvhal_backends")),
            traces=tuple(Path(p) for p in config.getoption("kvhal_trace") or ()),
        )


def parse_backends(values: list[str] | None) -> tuple[str, ...]:
    """``["FLASH_ATTN,MY_ATTN", "X"]`` -> ``("FLASH_ATTN", "MY_ATTN", "X")``: comma-separated,
    the option repeatable, blanks and repeats dropped."""
    names = (name.strip() for value in values or () for name in value.split(","))
    return tuple(dict.fromkeys(name for name in names if name))


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
        "--kvhal-sizes",
        choices=sorted(PRESETS),
        help="size preset: full (default), quick (= --kvhal-quick) or tiny (for running the suite "
        "many times over, e.g. against mutants)",
    )
    group.addoption(
        "--kvhal-seed", metavar="N", type=int, help="seed of the random block mappings (default: random)"
    )
    group.addoption(
        "--kvhal-backends",
        metavar="NAME,NAME",
        action="append",
        help="attention backend names of your kernels (comma-separated, repeatable): kvhal_kv_layouts "
        "is asked about each besides vLLM's names and those the plugin declares in ATTENTION_BACKENDS",
    )
    group.addoption(
        "--kvhal-trace",
        metavar="PATH",
        action="append",
        help="a worker trace (KVHAL_TRACE_DIR's .json.gz, docs/replay.md) the worker-path contract "
        "replays besides the kept ones (repeatable)",
    )
    group.addoption(
        "--kvhal-pin-timeout",
        metavar="SECONDS",
        type=float,
        default=60.0,
        help="how long a plugin declaring host.pinned may take to report a buffer pinned (default 60)",
    )
