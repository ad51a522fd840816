"""What this install of kvhal is: its version, its plugins' distributions, and which of its C
extensions were built.

The four C extensions are optional at build (setup.py): without a C compiler kvhal installs and
slower Python paths run. Nothing else would tell the user, so ``kvhal --version`` and the vLLM
engine's start report them, and each one missing is a warning naming what it costs and the fix.
Imports neither vLLM nor the modules that use the extensions.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
from dataclasses import dataclass

__all__ = [
    "EXTENSIONS",
    "FIX",
    "PLUGIN_GROUP",
    "Extension",
    "distribution_versions",
    "extension_status",
    "kvhal_version",
    "missing_extension_warning",
]

#: The entry-point group device plugins are offered in (kvhal.registry reads the same).
PLUGIN_GROUP = "kvhal.plugins"
#: What builds a missing extension.
FIX = (
    "install a C compiler and Python's headers (Debian/Ubuntu: apt-get install gcc python3-dev), "
    "then reinstall kvhal (pip install --force-reinstall --no-deps kvhal, or pip install -e . in a checkout)"
)


@dataclass(frozen=True)
class Extension:
    """One optional C extension, and what runs without it."""

    module: str
    #: what it does, in a few words
    role: str
    #: what runs instead, and what that costs (BENCHMARKS.md's figures where measured)
    cost: str


EXTENSIONS = (
    Extension(
        "kvhal.cpu._memcpy",
        "the CPU plugin's batch copy kernel",
        "the CPU plugin copies with ctypes.memmove, one Python call per descriptor and no "
        "non-temporal stores: 3-5x the time (64 MiB on one thread in 11-13 ms against 2.1-2.7 ms, "
        "16 KiB descriptors; scripts/probes/memcpy_fallback.py)",
    ),
    Extension(
        "kvhal._copyplan",
        "copy plans (checks, runs, descriptors)",
        "copy plans are made with numpy: about 660 us a 60-block plan on cold caches against 130 us "
        "in C (BENCHMARKS.md, scripts/probes/cold_copy_plan.py), on the engine's thread each step",
    ),
    Extension(
        "kvhal.offload._keyindex",
        "the manager's key index",
        "the manager indexes keys with a dict: more memory per tracked block than the C index's "
        "81 bytes (an estimated 60-110 bytes more, BENCHMARKS.md)",
    ),
    Extension(
        "kvhal.tiers.stores._resp",
        "the Redis reader that receives values into host slots",
        "Redis values are read through valkey-glide or redis-py: 60 values of 192 KiB in 11.9 ms "
        "against 4.1 ms, with 8x the CPU time (BENCHMARKS.md)",
    ),
)


def extension_status() -> dict[str, str | None]:
    """Each C extension's module -> ``None`` if it imports, else why not (the ImportError)."""
    status: dict[str, str | None] = {}
    for ext in EXTENSIONS:
        try:
            importlib.import_module(ext.module)
        except ImportError as exc:  # what the module using it catches, to run its fallback
            status[ext.module] = f"{type(exc).__name__}: {exc}"
        else:
            status[ext.module] = None
    return status


def missing_extension_warning(ext: Extension, reason: str) -> str:
    """The warning for one extension that did not import: its cost and the fix."""
    return (
        f"kvhal: the C extension {ext.module} ({ext.role}) is not built ({reason}); {ext.cost}. Fix: {FIX}."
    )


def kvhal_version() -> str:
    """kvhal's installed distribution version (``unknown`` when run from a tree not installed)."""
    try:
        return importlib.metadata.version("kvhal")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def distribution_versions() -> dict[str, str]:
    """``{distribution: version}``: kvhal, every distribution offering a device plugin (a
    ``kvhal.plugins`` entry point), and the conformance suite where installed."""
    versions = {"kvhal": kvhal_version()}
    plugins = {}
    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        dist = getattr(ep, "dist", None)
        if dist is not None:
            plugins[dist.name] = dist.version
        else:  # an entry point without its distribution's metadata: named by its plugin
            plugins[f"(plugin {ep.name})"] = "unknown"
    versions.update(sorted(plugins.items()))
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):  # the suite is optional
        versions["kvhal-conformance"] = importlib.metadata.version("kvhal-conformance")
    return versions
