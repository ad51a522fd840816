"""The mutants' registry (:func:`mutant`, :data:`MUTANTS`) and what their defects share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvhal.cache import KVCache
from kvhal.copyplan import CopyPlan
from kvhal.cpu.streams import CPUEvent, CPUStream, InlineStream
from kvhal.descriptor import DeviceDescriptor, Refusal

Stream = CPUStream | InlineStream
#: Copies below this many bytes take a mutant's "small copy" path.
SMALL = 64 << 10
#: Allocations from this size take a mutant's "large" path (the suite's caches, host tiers and
#: throughput batches exceed it at every size preset; its busy scratch does not).
LARGE = 8 << 20
#: ``also`` of a plugin that cannot be bound: every check needing the device fails.
EVERY_CLAUSE = "*"


@dataclass(frozen=True)
class Mutant:
    """A broken plugin and the clauses the suite must find broken.

    :param name: the class name (``--plugin kvhal_conformance.mutants:NAME``).
    :param plugin: the plugin class.
    :param breaks: clauses the suite must report broken (every one of them).
    :param also: clauses it may report broken too, as a consequence of the defect.
    :param why: why those are broken too.
    :param floor: the throughput floor to run with (None: 0, throughput not judged).
    :param sizes: the size preset to run with, where the mutation run's own (``tiny``) is too
        small to reach the defect (None: the run's).
    :param not_judged: clauses the report must read "not judged" (their checks rest on a clause
        the defect breaks); for ``copy.throughput``, every throughput row too.
    """

    name: str
    plugin: type
    breaks: tuple[str, ...]
    also: tuple[str, ...] = ()
    why: str = ""
    floor: float | None = None
    sizes: str | None = None
    not_judged: tuple[str, ...] = ()

    @property
    def defect(self) -> str:
        return " ".join((self.plugin.__doc__ or "").strip().split("\n\n")[0].split())


MUTANTS: dict[str, Mutant] = {}


def mutant(
    *breaks: str,
    also: Sequence[str] = (),
    why: str = "",
    floor: float | None = None,
    sizes: str | None = None,
    not_judged: Sequence[str] = (),
) -> Callable[[type], type]:
    def register(cls: type) -> type:
        MUTANTS[cls.__name__] = Mutant(
            cls.__name__,
            cls,
            tuple(breaks),
            tuple(also),
            why,
            floor,
            sizes=sizes,
            not_judged=tuple(not_judged),
        )
        return cls

    return register


def reached(mutants: dict[str, Mutant]) -> dict[str, list[str]]:
    """Clause id -> the mutants that break it."""
    found: dict[str, list[str]] = {}
    for m in mutants.values():
        for clause in m.breaks:
            found.setdefault(clause, []).append(m.name)
    return found


def _copy(engine: Any, plan: CopyPlan) -> Callable[[], None]:
    def run() -> None:
        engine.run(*plan.descriptors)  # the closure keeps the plan, and its caches' memory, alive

    return run


def _record_after(stream: Stream, work: Callable[[], None]) -> CPUEvent:
    stream.submit(work)
    done = CPUEvent()
    stream.record(done)
    return done


def _storage_end(cache: KVCache) -> int:
    return max(address + size for address, size in cache.storage_spans)


def _replace_caps(
    descriptor: DeviceDescriptor | Refusal, add: set[str] = frozenset(), drop: set[str] = frozenset()
) -> Any:
    assert isinstance(descriptor, DeviceDescriptor)
    caps = (set(descriptor.capabilities) - set(drop)) | set(add)
    return dataclasses.replace(descriptor, capabilities=frozenset(caps))
