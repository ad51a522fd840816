"""The kernel's word on memory locked with ``mlock``: ``/proc/self/smaps``.

``mlock`` marks the range's mappings ``VM_LOCKED`` (``lo`` in ``VmFlags``; the
kernel splits a mapping at the range's ends) and faults every page in, so a
locked range is covered, page for page, by mappings whose ``VmFlags`` hold ``lo``
and whose ``Locked:`` equals their ``Size:``. The CPU plugin's host buffers are
locked this way (:mod:`kvhal.cpu.memory`), and so is any plugin's memory for a
device whose tensors are ``cpu`` tensors.
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass

from kvhal.cpu.memory import _has_cap_ipc_lock
from kvhal.witness import PinningWitness, Witnessed

SMAPS = "/proc/self/smaps"
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


@dataclass(frozen=True)
class Mapping:
    """One mapping of ``smaps``: ``[start, end)``, its ``Locked:`` bytes, ``lo`` in its flags."""

    start: int
    end: int
    locked_bytes: int
    vm_locked: bool

    @property
    def fully_locked(self) -> bool:
        return self.vm_locked and self.locked_bytes >= self.end - self.start


def read_mappings(address: int, nbytes: int, path: str = SMAPS) -> list[Mapping]:
    """The mappings of ``path`` that overlap ``[address, address + nbytes)``, by address."""
    end = address + nbytes
    found: list[Mapping] = []
    current: dict[str, int | bool] | None = None
    with open(path) as smaps:
        for line in smaps:
            match = _MAPPING.match(line)
            if match:
                if current is not None:
                    found.append(Mapping(**current))  # type: ignore[arg-type]
                start, stop = int(match[1], 16), int(match[2], 16)
                overlaps = start < end and address < stop
                current = (
                    {"start": start, "end": stop, "locked_bytes": 0, "vm_locked": False} if overlaps else None
                )
            elif current is not None and line.startswith("Locked:"):
                current["locked_bytes"] = int(line.split()[1]) * 1024
            elif current is not None and line.startswith("VmFlags:"):
                current["vm_locked"] = "lo" in line.split()[1:]
    if current is not None:
        found.append(Mapping(**current))  # type: ignore[arg-type]
    return sorted(found, key=lambda m: m.start)


def judge(address: int, nbytes: int, mappings: list[Mapping]) -> Witnessed:
    """Whether ``mappings`` lock every byte of ``[address, address + nbytes)`` (a pure decision)."""
    at, end = address, address + nbytes
    for count, mapping in enumerate(mappings, 1):
        if mapping.start > at:
            break  # a hole: ``at`` is not mapped
        if not mapping.fully_locked:
            flags = "VmFlags lo" if mapping.vm_locked else "no VmFlags lo"
            size_kb = (mapping.end - mapping.start) >> 10
            why = f"in a mapping with {flags}, Locked {mapping.locked_bytes >> 10} kB of {size_kb} kB"
            return Witnessed(False, at - address, f"{SMAPS}: the byte at offset {at - address} is {why}")
        at = max(at, mapping.end)
        if at >= end:
            return Witnessed(True, None, f"{SMAPS}: {count} mapping(s) with VmFlags lo, Locked = Size")
    return Witnessed(False, at - address, f"{SMAPS}: the byte at offset {at - address} is not mapped")


class MlockWitness(PinningWitness):
    """Memory locked with ``mlock``, as ``/proc/self/smaps`` shows it (torch device type ``cpu``)."""

    name = "mlock (/proc/self/smaps)"
    device_type = "cpu"

    def __init__(self, path: str = SMAPS) -> None:
        self.path = path

    def unavailable(self) -> str | None:
        if not os.access(self.path, os.R_OK):
            return f"{self.path} cannot be read (the kernel's view of locked memory is Linux's)"
        return None

    def witness(self, address: int, nbytes: int) -> Witnessed:
        return judge(address, nbytes, read_mappings(address, nbytes, self.path))

    def size_limit(self) -> int | None:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft == resource.RLIM_INFINITY or _has_cap_ipc_lock():
            return None
        return int(soft)
