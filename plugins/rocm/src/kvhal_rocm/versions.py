"""HIP version numbers: ``major * 10**7 + minor * 10**5 + patch`` (``hipRuntimeGetVersion``)."""

from __future__ import annotations

import re


def hip_version_int(text: str | None) -> int | None:
    """``torch.version.hip`` (``"7.1.25424-..."``) as a HIP version int, or ``None``."""
    if not text:
        return None
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        return None
    major, minor, patch = (int(g or 0) for g in match.groups())
    return major * 10_000_000 + minor * 100_000 + patch


def hip_major_minor(version: int) -> tuple[int, int]:
    return version // 10_000_000, version // 100_000 % 100


def format_hip_version(version: int | None) -> str:
    if version is None:
        return "unknown"
    major, minor = hip_major_minor(version)
    return f"{major}.{minor}.{version % 100_000}"
