"""Mutants: the built-in CPU plugin with one clause of the map broken each.

Each mutant is a realistic defect (a fast path that skips the stream, an event
pool that hands out busy events, an allocator that rounds the wrong way) that
breaks the clauses it names in ``breaks``; ``also`` names clauses its defect
breaks as a consequence (and why). Running the suite against every mutant
(:mod:`kvhal_conformance.mutation`) proves each check can fail, and shows the
clauses no mutant reaches.

These are plugins for testing the suite, not for use: run one with
``kvhal conformance --device mutant --plugin kvhal_conformance.mutants:NAME``. Each module
of this package holds the mutants of one part of the contract, and registers them when
imported (:mod:`~kvhal_conformance.mutants.registry`).
"""

from __future__ import annotations

# Imported for their @mutant registrations, in the order of the contract (MUTANTS keeps it).
# isort: off
from kvhal_conformance.mutants import plugin, layouts, allocation, host_memory, streams, copies, worker_path

# isort: on
from kvhal_conformance.mutants.registry import EVERY_CLAUSE, LARGE, MUTANTS, SMALL, Mutant, mutant, reached

__all__ = ["EVERY_CLAUSE", "LARGE", "MUTANTS", "PARTS", "SMALL", "Mutant", "mutant", "reached"]


#: The modules holding the mutants, in the order of the contract.
PARTS = (plugin, layouts, allocation, host_memory, streams, copies, worker_path)


def __getattr__(name: str) -> type:
    """A class of a mutants module by its name: ``kvhal_conformance.mutants:NAME`` (``--plugin``)
    and ``from kvhal_conformance.mutants import NAME`` (a mutant, or a defect others build on)."""
    for part in PARTS:
        found = getattr(part, name, None)
        if isinstance(found, type) and found.__module__ == part.__name__:
            return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
