"""Test outcomes grouped per contract: what the report and the terminal summary show."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvhal_conformance.clauses import Clause, broken_clauses, clauses_of, hook_clauses
from kvhal_conformance.contracts import CONTRACTS, Contract

PASS, FAIL, SKIP, NOT_RUN = "pass", "fail", "skip", "not run"


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
        result = TestResult(item.nodeid, item.name, contract, summary, clauses=clauses_of(function))
        results[item.nodeid] = result
    result.duration_s += report.duration
    if result.outcome != PASS:
        return
    if report.failed:
        result.outcome, result.message = FAIL, short_message(call.excinfo)
        result.broken = broken_clauses(result.message) or result.clauses
    elif report.skipped:
        result.outcome, result.message = SKIP, short_message(call.excinfo)


def contract_status(tests: list[TestResult]) -> str:
    outcomes = {t.outcome for t in tests}
    if not tests:
        return NOT_RUN
    if FAIL in outcomes:
        return FAIL
    return PASS if PASS in outcomes else SKIP


def by_contract(results: dict[str, TestResult]) -> list[tuple[Contract, list[TestResult]]]:
    grouped: dict[str, list[TestResult]] = {c.id: [] for c in CONTRACTS}
    for result in results.values():
        grouped[result.contract.id].append(result)
    return [(c, grouped[c.id]) for c in CONTRACTS]


def verdict(groups: list[tuple[Contract, list[TestResult]]]) -> str:
    """fail if any contract failed; pass if every contract ran without failing; else incomplete."""
    statuses = [contract_status(tests) for _, tests in groups]
    if FAIL in statuses:
        return FAIL
    return "incomplete" if NOT_RUN in statuses else PASS


def clause_status(clause_id: str, results: dict[str, TestResult]) -> tuple[str, list[TestResult]]:
    """A clause's status: fail if a check broke it; pass if a check covering it passed; skip
    if every check covering it skipped; not run if none ran. And the checks concerned."""
    concerned = [t for t in results.values() if clause_id in t.clauses or clause_id in t.broken]
    if any(clause_id in t.broken for t in concerned):
        return FAIL, concerned
    covering = [t for t in concerned if clause_id in t.clauses]
    if any(t.outcome == PASS for t in covering):
        return PASS, concerned
    if covering and all(t.outcome == SKIP for t in covering):
        return SKIP, concerned
    return NOT_RUN, concerned


def by_clause(results: dict[str, TestResult]) -> list[tuple[Clause, str, list[TestResult]]]:
    """Every clause of the hookspecs with its status and the checks concerned."""
    return [(clause, *clause_status(clause.id, results)) for clause in hook_clauses()]
