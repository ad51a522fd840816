"""Test outcomes grouped per contract: what the report and the terminal summary show."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvhal_conformance.clauses import (
    Clause,
    broken_clauses,
    clauses_of,
    dependencies_of,
    doubtful_of,
    hook_clauses,
)
from kvhal_conformance.contracts import CONTRACTS, Contract

PASS, FAIL, SKIP, NOT_RUN = "pass", "fail", "skip", "not run"
#: A check whose verdict rests on a clause another check found broken (see :func:`judge_dependencies`).
NOT_JUDGED = "not judged"


@dataclass
class TestResult:
    """One suite test's outcome (its first failure or skip wins over later phases)."""

    nodeid: str
    name: str
    contract: Contract
    doc: str
    outcome: str = PASS
    message: str = ""
    duration_s: float = 0.0
    #: the clauses the check covers, and those its failure broke (named by the failure, else all)
    clauses: tuple[str, ...] = ()
    broken: tuple[str, ...] = ()
    #: the clauses its verdict rests on (``@depends_on``), and which of them failed elsewhere
    depends: tuple[str, ...] = ()
    #: the clauses whose verdict is in doubt then (the others keep its own outcome)
    doubtful: tuple[str, ...] = ()
    unjudged_by: tuple[str, ...] = ()
    #: its own outcome and message before it was found not judged
    own_outcome: str = ""
    own_message: str = ""

    def outcome_for(self, clause_id: str) -> str:
        """Its outcome as far as ``clause_id`` goes: a check not judged keeps its own outcome for
        the clauses not in doubt."""
        if self.outcome == NOT_JUDGED and clause_id not in self.doubtful:
            return self.own_outcome
        return self.outcome


def short_message(excinfo: pytest.ExceptionInfo[BaseException] | None) -> str:
    """The part of a failure or skip a vendor needs: the message, not the traceback."""
    if excinfo is None:
        return ""
    value = excinfo.value
    if isinstance(value, (pytest.fail.Exception, pytest.skip.Exception)):
        return value.msg
    if isinstance(value, AssertionError):
        text = str(value).split("\nassert ", 1)[0]
        return text or "assertion failed"
    return f"{type(value).__name__}: {value}"


def record(
    results: dict[str, TestResult],
    item: pytest.Item,
    contract: Contract,
    call: pytest.CallInfo,
    report: pytest.TestReport,
) -> None:
    result = results.get(item.nodeid)
    if result is None:
        doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
        summary = " ".join(doc.strip().split("\n\n")[0].split())
        function = getattr(item, "function", None)
        result = TestResult(
            item.nodeid,
            item.name,
            contract,
            summary,
            clauses=clauses_of(function),
            depends=dependencies_of(function),
            doubtful=doubtful_of(function),
        )
        results[item.nodeid] = result
    result.duration_s += report.duration
    if result.outcome != PASS:
        return
    if report.failed:
        result.outcome, result.message = FAIL, short_message(call.excinfo)
        result.broken = broken_clauses(result.message) or result.clauses
    elif report.skipped:
        result.outcome, result.message = SKIP, short_message(call.excinfo)


def not_judged_message(failed: tuple[str, ...]) -> str:
    names = ", ".join(failed)
    return f"not judged: depends on {names}, which failed"


def judge_dependencies(results: dict[str, TestResult]) -> None:
    """Mark "not judged" every check (passed or failed) whose verdict rests on a clause
    (``@depends_on``) that a judged check found broken: its own verdict proves nothing (a
    throughput timed by events that complete early; copies read through views whose layout is
    wrong), and its failure is no clause's. Clauses broken by checks without dependencies count
    first; then those broken by dependent checks that stay judged, until nothing changes.
    Idempotent: a check once marked keeps its own outcome in ``own_outcome``."""
    for t in results.values():  # start over from the checks' own outcomes
        if t.outcome == NOT_JUDGED:
            t.outcome, t.message, t.unjudged_by = t.own_outcome, t.own_message, ()
            t.broken = (broken_clauses(t.message) or t.clauses) if t.outcome == FAIL else ()
    dependent = [t for t in results.values() if t.depends and t.outcome in (PASS, FAIL)]
    firm = {c for t in results.values() if not t.depends and t.outcome == FAIL for c in t.broken}
    undecided = list(dependent)
    while True:
        unjudged = [t for t in undecided if any(c in firm for c in t.depends)]
        judged = [t for t in undecided if t not in unjudged]
        added = {c for t in judged if t.outcome == FAIL for c in t.broken} - firm
        if not added:
            break
        firm |= added
    for t in unjudged:
        t.unjudged_by = tuple(c for c in t.depends if c in firm)
        t.own_outcome, t.own_message = t.outcome, t.message
        t.outcome, t.broken = NOT_JUDGED, tuple(c for c in t.broken if c not in t.doubtful)
        own = f" (its own outcome: {t.own_outcome}" + (f": {t.own_message}" if t.own_message else "") + ")"
        t.message = not_judged_message(t.unjudged_by) + own


def contract_status(tests: list[TestResult]) -> str:
    """fail if a check failed; not judged if none did but one was not judged; else pass, skip."""
    outcomes = {t.outcome for t in tests}
    if not tests:
        return NOT_RUN
    if FAIL in outcomes:
        return FAIL
    if NOT_JUDGED in outcomes:
        return NOT_JUDGED
    return PASS if PASS in outcomes else SKIP


def by_contract(results: dict[str, TestResult]) -> list[tuple[Contract, list[TestResult]]]:
    judge_dependencies(results)
    grouped: dict[str, list[TestResult]] = {c.id: [] for c in CONTRACTS}
    for result in results.values():
        grouped[result.contract.id].append(result)
    return [(c, grouped[c.id]) for c in CONTRACTS]


def verdict(groups: list[tuple[Contract, list[TestResult]]]) -> str:
    """fail if any contract failed; pass if every contract ran without failing and was judged;
    else incomplete."""
    statuses = [contract_status(tests) for _, tests in groups]
    if FAIL in statuses:
        return FAIL
    return "incomplete" if NOT_RUN in statuses or NOT_JUDGED in statuses else PASS


def clause_status(clause_id: str, results: dict[str, TestResult]) -> tuple[str, list[TestResult]]:
    """A clause's status: fail if a check broke it; not judged if a check covering it could
    not be judged (it depends on a clause that failed); pass if a check covering it passed;
    skip if every check covering it skipped; not run if none ran. And the checks concerned."""
    concerned = [t for t in results.values() if clause_id in t.clauses or clause_id in t.broken]
    if any(clause_id in t.broken for t in concerned):
        return FAIL, concerned
    covering = [t for t in concerned if clause_id in t.clauses]
    outcomes = [t.outcome_for(clause_id) for t in covering]
    if NOT_JUDGED in outcomes:
        return NOT_JUDGED, concerned
    if PASS in outcomes:
        return PASS, concerned
    if covering and all(o == SKIP for o in outcomes):
        return SKIP, concerned
    return NOT_RUN, concerned


def unjudged_by(tests: list[TestResult], clause_id: str | None = None) -> tuple[str, ...]:
    """The failed clauses that left the checks among ``tests`` not judged (on ``clause_id``)."""
    return tuple(
        dict.fromkeys(
            c
            for t in tests
            if t.outcome == NOT_JUDGED and (clause_id is None or clause_id in t.doubtful)
            for c in t.unjudged_by
        )
    )


def by_clause(results: dict[str, TestResult]) -> list[tuple[Clause, str, list[TestResult]]]:
    """Every clause of the hookspecs with its status and the checks concerned."""
    judge_dependencies(results)
    return [(clause, *clause_status(clause.id, results)) for clause in hook_clauses()]
