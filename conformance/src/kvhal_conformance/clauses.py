"""The clause map: every promise of every device hook, and the checks that test it.

Each device hook's docstring in :mod:`kvhal.hookspecs` lists its promises, one
bullet each, under a stable id::

    - ``copy.ordering``: it must not start before work submitted to ``stream``
      earlier has completed, in either direction, at any size.

A check (a test method of a contract class of :mod:`kvhal_conformance.base`) names the clauses it covers with
:func:`covers`; a failure names the clauses it found broken with :func:`violated`
(``[copy.ordering] ...``), so the report can say which promise a plugin broke.
The suite's own tests parse the hookspecs and fail when a clause has no check,
when a check names an unknown clause, or when a clause that must hold in every
direction and at every size lacks a check for one of them.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
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


def hook_clauses() -> tuple[Clause, ...]:
    """Every promise the device hooks' docstrings state, in hook order, plus ``plugin.hooks``."""
    found = [
        Clause(
            "plugin.hooks",
            "(every device hook)",
            "a device plugin implements every hook of kvhal.hookspecs.DEVICE_HOOKS "
            '("Every device hook is required", the hookspecs\' module docstring)',
        )
    ]
    for hook in hookspecs.DEVICE_HOOKS:
        doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
        found += [Clause(m["id"], hook, _one_line(m["text"])) for m in _PROMISE.finditer(doc)]
    return tuple(found)


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


# -- the checks the suite has -----------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One check of the suite and what it covers.

    :param name: ``ContractClass::test_method``.
    :param clauses: the clause ids it names.
    :param variants: per parameter name, the values it is parametrized over.
    """

    name: str
    clauses: tuple[str, ...]
    variants: dict[str, frozenset[str]] = field(default_factory=dict)

    def covers_variant(self, axes: dict[str, str]) -> bool:
        """Whether this check runs with every ``axis = value`` given (a check not
        parametrized over an axis does not cover its values)."""
        return all(value in self.variants.get(axis, ()) for axis, value in axes.items())


def _parametrized(func: object) -> dict[str, frozenset[str]]:
    values: dict[str, set[str]] = {}
    for mark in getattr(func, "pytestmark", ()):
        if mark.name != "parametrize":
            continue
        names, argvalues = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        for value in argvalues:
            value = value.values if hasattr(value, "values") and not isinstance(value, dict) else value
            row = value if len(names) > 1 else (value,)
            for name, item in zip(names, row, strict=True):
                if isinstance(item, str):
                    values.setdefault(name, set()).add(item)
    return {name: frozenset(v) for name, v in values.items()}


def suite_checks() -> list[Check]:
    """Every check of the suite (a ``test_*`` method of a contract class of
    :mod:`kvhal_conformance.base`) with the clauses it covers and its parameters."""
    from kvhal_conformance.base import CONTRACT_CLASSES

    checks = []
    for cls in CONTRACT_CLASSES:
        for name, func in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("test_"):
                checks.append(Check(f"{cls.__name__}::{name}", clauses_of(func), _parametrized(func)))
    return checks


def coverage_problems(
    clauses: Iterable[Clause] | None = None, checks: Iterable[Check] | None = None
) -> list[str]:
    """Everything that leaves the map incomplete: a clause without a check (or without a
    check for a direction and size it must hold in), a check naming no clause or an
    unknown one."""
    clauses = tuple(hook_clauses() if clauses is None else clauses)
    checks = tuple(suite_checks() if checks is None else checks)
    known = {c.id for c in clauses}
    problems = []
    seen: dict[str, str] = {}
    for clause in clauses:
        if clause.id in seen:
            problems.append(f"clause {clause.id} is stated twice ({seen[clause.id]} and {clause.hook})")
        seen[clause.id] = clause.hook
    for check in checks:
        if not check.clauses:
            problems.append(f"check {check.name} names no clause (decorate it with @covers(...))")
        for clause_id in check.clauses:
            if clause_id not in known and clause_id != KVHAL_OWN:
                problems.append(f"check {check.name} names unknown clause {clause_id}")
    for clause in clauses:
        mine = [c for c in checks if clause.id in c.clauses]
        if not mine:
            problems.append(f"clause {clause.id} ({clause.hook}) has no check")
            continue
        for combination in variant_combinations(clause):
            if not any(c.covers_variant(combination) for c in mine):
                where = ", ".join(f"{axis} {value}" for axis, value in combination.items())
                problems.append(f"clause {clause.id} has no check for {where}")
    return problems


def variant_combinations(clause: Clause) -> list[dict[str, str]]:
    combos: list[dict[str, str]] = [{}]
    for axis, values in clause.variants.items():
        combos = [{**c, axis: v} for c in combos for v in values]
    return [c for c in combos if c]


# -- the README table -------------------------------------------------------------

BEGIN, END = (
    "<!-- clause-map:begin (generated: python -m kvhal_conformance.clauses) -->",
    "<!-- clause-map:end -->",
)


_ROLE = re.compile(r":[a-z]+:`~?(?:[\w.]+\.)?([\w]+)`")


def _markdown(text: str) -> str:
    """A docstring's reStructuredText as Markdown for a table cell."""
    text = _ROLE.sub(r"`\1`", text).replace("``", "`")
    return text.replace("|", "\\|")


def markdown_table(mutations: dict[str, list[str]] | None = None) -> str:
    """The clause map as a Markdown table: clause, hook, promise, checks, mutants."""
    checks = suite_checks()
    mutations = mutations or {}
    lines = [
        "| Clause | Hook | Promise | Checks | Variants | Mutants that break it |",
        "|---|---|---|---|---|---|",
    ]
    for clause in hook_clauses():
        names = sorted(c.name.split("::")[1] for c in checks if clause.id in c.clauses)
        variants = " x ".join("/".join(v) for v in clause.variants.values()) or ""
        mutants = ", ".join(f"`{m}`" for m in mutations.get(clause.id, ())) or "**none**"
        lines.append(
            f"| `{clause.id}` | `{clause.hook}` | {_markdown(clause.text)} | "
            f"{', '.join(f'`{n}`' for n in names)} | {variants} | {mutants} |"
        )
    return "\n".join(lines)


def readme_block() -> str:
    from kvhal_conformance.mutants import MUTANTS, reached

    return f"{BEGIN}\n{markdown_table(reached(MUTANTS))}\n{END}"


def replace_block(text: str, block: str) -> str:
    """``text`` with the part between the clause-map markers replaced by ``block``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"markers {BEGIN!r} ... {END!r} not found")
    return text[:start] + block + text[end + len(END) :]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvhal_conformance.clauses [README]``: print the clause map, or rewrite it
    into README between the markers; list coverage problems (exit 1 if any)."""
    import sys
    from pathlib import Path

    args = list(sys.argv[1:] if argv is None else argv)
    block = readme_block()
    if args:
        path = Path(args[0])
        path.write_text(replace_block(path.read_text(), block))
    else:
        print(block)
    problems = coverage_problems()
    for problem in problems:
        print(f"clause map: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
