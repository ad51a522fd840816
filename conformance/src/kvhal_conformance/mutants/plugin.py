"""Mutants of the plugin as a whole: its hooks, its probe, its capabilities."""

from __future__ import annotations

from kvhal.cpu import CPUPlugin
from kvhal.cpu.streams import CPUStream
from kvhal.descriptor import Capability, DeviceDescriptor, Refusal
from kvhal.hookspecs import hookimpl
from kvhal_conformance.mutants.registry import (
    EVERY_CLAUSE,
    _replace_caps,
    mutant,
)


@mutant(
    "plugin.hooks", also=(EVERY_CLAUSE,), why="a plugin that cannot be bound fails every check needing it"
)
class MissingQueryHook(CPUPlugin):
    """Does not implement kvhal_query_event (a port that only ever synchronizes)."""

    kvhal_query_event = None


@mutant("probe.result")
class ProbeFailsWhenCalledAgain(CPUPlugin):
    """The probe initializes the driver and raises "already initialized" when called again
    after selection (kvhal probes a plugin twice to bind it)."""

    def __init__(self) -> None:
        super().__init__()
        self._probes = 0

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        self._probes += 1
        if self._probes > 2:
            raise RuntimeError("driver already initialized")
        return super().kvhal_probe()


@mutant("probe.descriptor")
class TypoCapability(CPUPlugin):
    """Declares ``copy.batch`` for ``copy.batched`` (a typo kvhal cannot act on)."""

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        return _replace_caps(super().kvhal_probe(), add={"copy.batch"}, drop={Capability.BATCHED_COPY.value})


@mutant("probe.no_work")
class ProbeKeepsStream(CPUPlugin):
    """Each probe creates a copy stream to check the device works, and keeps it (its thread
    keeps running)."""

    def __init__(self) -> None:
        super().__init__()
        self._probe_streams: list[CPUStream] = []

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        self._probe_streams.append(CPUStream("kvhal-probe-check"))
        return super().kvhal_probe()
