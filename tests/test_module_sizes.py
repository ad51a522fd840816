"""No module under ``src/`` is longer than 500 lines: a longer one is split into modules whose
names say what they hold. ``hookspecs.py`` is excepted: every contract with a device stays in
one module, as pytest keeps its ``hookspec.py``.
"""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
MAX_LINES = 500
#: exempt for good: every hookspec in one module
EXCEPTED = {"kvhal/hookspecs.py"}


def line_counts() -> dict[str, int]:
    """Lines of each Python module under ``src/``, by its path relative to ``src/``."""
    return {
        path.relative_to(SRC).as_posix(): len(path.read_text().splitlines())
        for path in sorted(SRC.rglob("*.py"))
    }


def test_the_scan_finds_the_modules() -> None:
    counts = line_counts()
    assert {"kvhal/registry.py", "kvhal/hookspecs.py", "kvhal/tiers/stores/redis.py"} <= counts.keys()
    assert len(counts) > 100


def test_no_module_is_over_500_lines() -> None:
    long = {p: n for p, n in line_counts().items() if n > MAX_LINES and p not in EXCEPTED}
    assert not long, f"modules over {MAX_LINES} lines (split each by what it holds): {long}"


def test_the_exception_names_a_module_that_exists() -> None:
    # a module moved or renamed must not leave a stale exemption behind
    stale = sorted(EXCEPTED - line_counts().keys())
    assert not stale, f"no such module: {stale}"
