"""The old path of :mod:`kvhal.tiers.backend`, kept so that code written against it keeps working.

Nothing in kvhal imports it (the layers contract in pyproject.toml leaves it out).
"""

from kvhal.tiers.backend import (
    CORRUPT,
    FOREIGN,
    IO_ERROR,
    MISSING,
    OK,
    READ_FAILURES,
    TierBackend,
    TierFactory,
    TierSpec,
)

__all__ = [
    "CORRUPT",
    "FOREIGN",
    "IO_ERROR",
    "MISSING",
    "OK",
    "READ_FAILURES",
    "TierBackend",
    "TierFactory",
    "TierSpec",
]
