"""What a plugin's first probe leaves behind: threads, host memory (RSS) and device memory,
measured right before and right after it (``probe.no_work``).

The first probe is the one that counts: a probe that reserves an arena or starts a worker
once, and keeps it, adds nothing when probed again. The suite binds the plugin (and so
probes it first) before any check runs, so :class:`~kvhal_conformance.target.Target` takes
both snapshots, and the probe check judges them later.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MiB = 1 << 20
#: More host memory than this kept by a CPU device's first probe is an allocation, not
#: detection (the built-in CPU plugin's first probe keeps none).
HOST_PROBE_LIMIT = 32 * MiB


def rss_bytes() -> int | None:
    """This process's resident set size, or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil  # type: ignore[import-untyped]

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return None


def accelerator_memory() -> tuple[str, int] | None:
    """(torch's current accelerator type, bytes torch has allocated on it), or None. Reading it
    initializes nothing: torch answers 0 for a device it has not initialized."""
    try:
        if not torch.accelerator.is_available():
            return None
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            return None
        return accelerator.type, int(torch.accelerator.memory_allocated())
    except (RuntimeError, AttributeError):
        return None


@dataclass(frozen=True)
class Snapshot:
    threads: frozenset[threading.Thread]
    rss: int | None
    accelerator: tuple[str, int] | None
    #: the plugin's own report (``kvhal_device_memory_in_use``), None where it has none
    reported: int | None = None

    @classmethod
    def take(cls, report: Callable[[], int | None] | None = None) -> Snapshot:
        reported = report() if report is not None else None
        return cls(frozenset(threading.enumerate()), rss_bytes(), accelerator_memory(), reported)


@dataclass(frozen=True)
class Footprint:
    """Snapshots right before and right after a plugin's first probe."""

    before: Snapshot
    after: Snapshot
    started: tuple[threading.Thread, ...] = field(default=())

    @classmethod
    def between(cls, before: Snapshot, after: Snapshot) -> Footprint:
        started = tuple(t for t in after.threads if t not in before.threads)
        return cls(before, after, started)

    def threads_kept(self) -> list[threading.Thread]:
        """Threads the first probe started that are still running."""
        return [t for t in self.started if t.is_alive()]

    @property
    def host_growth(self) -> int | None:
        if self.before.rss is None or self.after.rss is None:
            return None
        return self.after.rss - self.before.rss

    def device_growth(self, device_type: str) -> tuple[int | None, str]:
        """(bytes of device memory the first probe kept, or None when not measured; how measured).

        torch's allocator for torch's current accelerator of that type; else the plugin's own
        report (the test hook ``kvhal_device_memory_in_use``), where it has one; else the
        process's host memory (RSS) for a ``cpu`` device, whose memory is host memory; else
        not measured."""
        before, after = self.before.accelerator, self.after.accelerator
        if before is not None and after is not None and before[0] == device_type:
            return after[1] - before[1], f"torch.accelerator.memory_allocated() on {device_type}"
        if self.before.reported is not None and self.after.reported is not None:
            return self.after.reported - self.before.reported, (
                "kvhal_device_memory_in_use(), the plugin's own report (checked by memory.report)"
            )
        if device_type == "cpu":
            return self.host_growth, "host memory (RSS): a cpu device's memory is host memory"
        return None, (
            f"not measured: torch's current accelerator is not of type {device_type!r} and the "
            "plugin does not implement kvhal_device_memory_in_use"
        )


def describe(nbytes: int | None) -> str:
    if nbytes is None:
        return "not measured"
    return f"{nbytes / MiB:+.1f} MiB"
