"""The clause map: which check of the suite covers which promise, and the README's table of it.

``python -m kvhal_conformance.clausemap [README]`` prints the map, or rewrites it into the
README between its markers, and lists what leaves it incomplete: a clause without a check
(or without one for a direction and size it must hold in), a check naming no clause or an
unknown one. It reads the contract classes (:mod:`kvhal_conformance.base`) and the mutants;
the clauses themselves are :mod:`kvhal_conformance.clauses`."""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvhal_conformance.base import CONTRACT_CLASSES
from kvhal_conformance.clauses import KVHAL_OWN, Clause, clauses_of, hook_clauses
from kvhal_conformance.mutants import MUTANTS, reached


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


BEGIN, END = (
    "<!-- clause-map:begin (generated: python -m kvhal_conformance.clausemap) -->",
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
    return f"{BEGIN}\n{markdown_table(reached(MUTANTS))}\n{END}"


def replace_block(text: str, block: str) -> str:
    """``text`` with the part between the clause-map markers replaced by ``block``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"markers {BEGIN!r} ... {END!r} not found")
    return text[:start] + block + text[end + len(END) :]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvhal_conformance.clausemap [README]``: print the clause map, or rewrite it
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
