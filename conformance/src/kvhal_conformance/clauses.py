"""The clause map: every promise of every device hook, and the checks that test it.

Each device hook's docstring in :mod:`kvhal.hookspecs` lists its promises, one
bullet each, under a stable id::

    - ``copy.ordering``: it must not start before work submitted to ``stream``
      earlier has completed, in either direction, at any size.

A check (a test method of a contract class of :mod:`kvhal_conformance.base`) names the clauses it covers with
:func:`covers`; a failure names the clauses it found broken with :func:`violated`
(``[copy.ordering] ...``), so the report can say which promise a plugin broke.
:mod:`kvhal_conformance.clausemap` holds the map from clauses to checks: the
suite's own tests fail when a clause has no check, when a check names an unknown
clause, or when a clause that must hold in every direction and at every size
lacks a check for one of them.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import pytest

from kvhal import hookspecs

F = TypeVar("F", bound=Callable[..., Any])

#: ``- ``id``: text`` with the text's continuation lines indented under it.
_PROMISE = re.compile(r"^- ``(?P<id>[a-z_]+(?:\.[a-z_]+)+)``: (?P<text>.*(?:\n {2,}\S.*)*)", re.M)
#: A failure message that names the clauses it found broken.
_TAG = re.compile(r"^\[(?P<ids>[a-z_]+(?:\.[a-z_]+)+(?:, [a-z_]+(?:\.[a-z_]+)+)*)\] ")

DIRECTIONS = ("d2h", "h2d")
#: ``small``: one block of 4 KiB; ``odd``: one block whose size is no multiple of a page or
#: of 64 bytes; ``large``: a batch of many MiB.
SIZES = ("small", "odd", "large")
#: Clauses that must be checked in every combination of these parameters of their checks.
REQUIRED_VARIANTS: dict[str, dict[str, tuple[str, ...]]] = {
    clause: {"direction": DIRECTIONS, "size": SIZES}
    for clause in (
        "copy.data",
        "copy.dst_only",
        "copy.ordering",
        "copy.event",
        "record.after_work",
        "wait.orders",
    )
}
#: Marks a check of kvhal's own validation (it runs before any hook: no plugin clause).
KVHAL_OWN = "kvhal.own_checks"


@dataclass(frozen=True)
class Clause:
    """One promise of one hook.

    :param id: stable id, ``area.promise``.
    :param hook: the hook that makes it.
    :param text: the promise, as the hookspec states it.
    """

    id: str
    hook: str
    text: str

    @property
    def variants(self) -> dict[str, tuple[str, ...]]:
        return REQUIRED_VARIANTS.get(self.id, {})


def _one_line(text: str) -> str:
    return " ".join(text.split())


#: The promise of the hooks together, in a vLLM worker's order (the ``worker_path`` contract).
WORKER_PATH = Clause(
    "worker.path",
    "(a vLLM worker's calls)",
    "driven by a vLLM worker's recorded connector calls (a kept trace, replayed by kvhal.replay: "
    "the KV cache as the engine had it, every step's loads, per-layer waits and stores in the "
    "recorded order), the hooks together load every block with the bytes stored from it, store "
    "every block whole, and end every job as it ended when recorded",
)


def hook_clauses() -> tuple[Clause, ...]:
    """Every promise the device hooks' (and the test hooks') docstrings state, in hook order, plus
    ``plugin.hooks`` first and :data:`WORKER_PATH` last."""
    found = [
        Clause(
            "plugin.hooks",
            "(every device hook)",
            "a device plugin implements every hook of kvhal.hookspecs.DEVICE_HOOKS "
            '("Every device hook is required", the hookspecs\' module docstring)',
        )
    ]
    for hook in (*hookspecs.DEVICE_HOOKS, *hookspecs.TEST_HOOKS):
        doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
        found += [Clause(m["id"], hook, _one_line(m["text"])) for m in _PROMISE.finditer(doc)]
    return (*found, WORKER_PATH)


def clause_ids() -> frozenset[str]:
    return frozenset(c.id for c in hook_clauses())


# -- tagging checks and failures ------------------------------------------------


def covers(*ids: str) -> Callable[[F], F]:
    """Decorate a check with the clauses it tests (its failures default to all of them)."""

    def mark(func: F) -> F:
        func.kvhal_clauses = tuple(ids)  # type: ignore[attr-defined]
        return func

    return mark


def clauses_of(func: object) -> tuple[str, ...]:
    return tuple(getattr(func, "kvhal_clauses", ()))


def depends_on(*ids: str, judges: Sequence[str] = ()) -> Callable[[F], F]:
    """Decorate a check whose verdict rests on other clauses holding (throughput timed by events
    that may lie, copies judged through views whose layout may be wrong): when a check not
    itself in doubt found one of ``ids`` broken, this check is reported "not judged: depends
    on X, which failed", neither passed nor failed, for the clauses in ``judges`` (default: every
    clause it covers; its verdict on the others stands). See
    :func:`~kvhal_conformance.results.judge_dependencies`."""

    def mark(func: F) -> F:
        func.kvhal_depends = tuple(ids)  # type: ignore[attr-defined]
        func.kvhal_judges = tuple(judges)  # type: ignore[attr-defined]
        return func

    return mark


def dependencies_of(func: object) -> tuple[str, ...]:
    return tuple(getattr(func, "kvhal_depends", ()))


def doubtful_of(func: object) -> tuple[str, ...]:
    """The clauses a check's verdict on is in doubt when a clause it depends on failed."""
    return tuple(getattr(func, "kvhal_judges", ())) or clauses_of(func)


def tag(ids: str | Sequence[str], message: str) -> str:
    """``[a, b] message``: a failure message naming the clauses broken."""
    names = (ids,) if isinstance(ids, str) else tuple(ids)
    return f"[{', '.join(names)}] {message}"


def violated(ids: str | Sequence[str], message: str) -> NoReturn:
    """Fail the calling check, naming the clauses broken."""
    pytest.fail(tag(ids, message), pytrace=False)


def expect(condition: object, ids: str | Sequence[str], message: str | Callable[[], str]) -> None:
    """:func:`violated` unless ``condition``; ``message`` may be a callable (built only on failure)."""
    if not condition:
        violated(ids, message() if callable(message) else message)


def broken_clauses(message: str) -> tuple[str, ...] | None:
    """The clauses a failure message names, or None when it names none."""
    match = _TAG.match(message)
    return tuple(match["ids"].split(", ")) if match else None
