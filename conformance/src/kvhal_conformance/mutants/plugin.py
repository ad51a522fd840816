"""Mutants of the plugin as a whole: its hooks, its probe, its capabilities."""

from __future__ import annotations

import queue
import threading

import torch

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


#: The arena :class:`ProbeReservesArena` reserves in its first probe.
PROBE_ARENA = 256 << 20


@mutant("probe.no_work")
class ProbeReservesArena(CPUPlugin):
    """The first probe reserves a 256 MiB staging arena (touched, so resident) to check the
    device can hold one, and keeps it for later copies; probing again reuses it."""

    def __init__(self) -> None:
        super().__init__()
        self._arena: torch.Tensor | None = None

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        if self._arena is None:
            self._arena = torch.ones(PROBE_ARENA, dtype=torch.uint8)
        return super().kvhal_probe()


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        job()


@mutant("probe.no_work")
class ProbeStartsWorker(CPUPlugin):
    """The first probe starts the DMA worker thread (to check the device answers) and keeps it
    for later; probing again finds it running."""

    def __init__(self) -> None:
        super().__init__()
        self._jobs: queue.SimpleQueue | None = None

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name="kvhal-dma-worker", daemon=True).start()
        return super().kvhal_probe()


@mutant("fault.inject")
class FaultHookIsAStub(CPUPlugin):
    """Declares test.faults and answers True to every kvhal_inject_device_fault without arming
    anything (a fault hook left as a stub): the suite's fault checks would pass on faults that
    never happened."""

    @hookimpl
    def kvhal_inject_device_fault(self, fault: str, stream: object, seconds: float) -> bool:
        return True


@mutant("memory.report")
class MemoryReportIsAStub(CPUPlugin):
    """Reports its device memory as a constant (a counter never updated): the first probe's
    measurement, which trusts the report, would miss an arena the probe keeps."""

    @hookimpl
    def kvhal_device_memory_in_use(self) -> int:
        return 0
