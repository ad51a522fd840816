"""The conformance suite's outcomes: "not judged" (a check resting on a clause another check
found broken), and a failure repeated by many checks said once."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("kvhal_conformance")

from kvhal_conformance import report
from kvhal_conformance.contracts import CONTRACTS
from kvhal_conformance.results import (
    FAIL,
    NOT_JUDGED,
    PASS,
    by_clause,
    by_contract,
    contract_status,
    judge_dependencies,
)
from kvhal_conformance.results import (
    TestResult as Outcome,
)
from kvhal_conformance.target import Target

CONTRACT = {c.id: c for c in CONTRACTS}


def result(
    name: str,
    contract: str,
    outcome: str,
    clauses: tuple[str, ...],
    message: str = "",
    depends: tuple[str, ...] = (),
    doubtful: tuple[str, ...] = (),
) -> Outcome:
    broken = clauses if outcome == FAIL and not message.startswith("[") else ()
    if message.startswith("["):
        broken = tuple(message[1 : message.index("]")].split(", "))
    return Outcome(
        name,
        name,
        CONTRACT[contract],
        "",
        outcome,
        message,
        clauses=clauses,
        broken=broken,
        depends=depends,
        doubtful=doubtful or clauses,
    )


def statuses(results: dict[str, Outcome]) -> dict[str, str]:
    return {clause.id: status for clause, status, _ in by_clause(results)}


def throughput_run(event_fails: bool) -> dict[str, Outcome]:
    tests = [
        result(
            "test_event",
            "streams_events",
            FAIL if event_fails else PASS,
            ("copy.event",),
            "[copy.event] the event completed before the bytes were written" if event_fails else "",
        ),
        result(
            "test_throughput[d2h]",
            "throughput",
            PASS,
            ("copy.throughput", "host.pinned"),
            depends=("copy.event", "sync.waits"),
            doubtful=("copy.throughput",),
        ),
    ]
    return {t.nodeid: t for t in tests}


def test_a_check_resting_on_a_broken_clause_is_not_judged() -> None:
    results = throughput_run(event_fails=True)
    found = statuses(results)
    assert found["copy.event"] == FAIL
    assert found["copy.throughput"] == NOT_JUDGED
    assert found["host.pinned"] == PASS  # the check's verdict on a clause not in doubt stands
    t = results["test_throughput[d2h]"]
    assert t.outcome == NOT_JUDGED
    assert t.message == "not judged: depends on copy.event, which failed (its own outcome: pass)"
    statuses_by_contract = {c.id: contract_status(tests) for c, tests in by_contract(results)}
    assert statuses_by_contract["throughput"] == NOT_JUDGED
    judge_dependencies(results)  # idempotent
    assert t.outcome == NOT_JUDGED and t.message.count("not judged") == 1


def test_a_check_whose_dependencies_hold_is_judged() -> None:
    results = throughput_run(event_fails=False)
    assert statuses(results)["copy.throughput"] == PASS
    assert results["test_throughput[d2h]"].outcome == PASS


def test_a_failure_of_a_check_not_judged_breaks_no_clause() -> None:
    """A copy check failing on a cache whose layout is wrong: copy.data is not judged, not failed;
    and a clause broken only by a check not judged does not leave others not judged."""
    tests = [
        result("test_views", "layouts", FAIL, ("alloc.layout",), "[alloc.layout] views not as labelled"),
        result(
            "test_mapping",
            "copies",
            FAIL,
            ("copy.data",),
            "[copy.data] dst block 3 is not src block 5's data",
            depends=("alloc.layout",),
        ),
        result("test_later", "throughput", PASS, ("copy.throughput",), depends=("copy.data",)),
    ]
    results = {t.nodeid: t for t in tests}
    found = statuses(results)
    assert found["alloc.layout"] == FAIL
    assert found["copy.data"] == NOT_JUDGED
    assert found["copy.throughput"] == PASS
    assert results["test_mapping"].message.startswith("not judged: depends on alloc.layout, which failed")


def minimal_report(contracts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "suite": {"name": "kvhal-conformance", "version": "0"},
        "date": "today",
        "verdict": FAIL,
        "plugin": {"name": "x", "distribution": None, "version": None, "bound": False, "error": "gone"},
        "device": None,
        "environment": {"torch": "t", "kvhal": "k", "python": "p", "platform": "q"},
        "run": {"sizes": "tiny", "seed": 1, "throughput_floor": 0},
        "contracts": contracts,
        "clauses": [],
        "throughput": {},
    }


def test_a_failure_repeated_by_many_checks_is_listed_once_with_the_count() -> None:
    tests = [{"name": f"test_{i}", "outcome": FAIL, "message": "same reason"} for i in range(5)]
    contract = {
        "id": "copies",
        "title": "Copies",
        "checks": "",
        "status": FAIL,
        "counts": {PASS: 0, FAIL: 5, "skip": 0, NOT_JUDGED: 0},
        "tests": tests,
    }
    text = report.to_markdown(minimal_report([contract]))
    assert text.count("same reason") == 1
    assert "5 checks (`test_0`, `test_1`" in text


def test_an_unbound_plugin_says_why_once_and_counts_the_checks() -> None:
    target = Target.__new__(Target)
    target.device, target.error, target.unbound_failures = None, "kvhal_probe raised", 0
    target.info = type("Info", (), {"name": "x", "distribution": None})()
    messages = []
    for _ in range(3):
        with pytest.raises(pytest.fail.Exception) as failed:
            target.require_device()
        messages.append(failed.value.msg)
    assert "kvhal_probe raised" in messages[0]
    assert all("kvhal_probe raised" not in m and "given once" in m for m in messages[1:])
    assert target.unbound_summary() == "3 checks failed: plugin 'x' could not be bound: kvhal_probe raised"


def test_the_pytest_plugin_loads_neither_the_suites_classes_nor_vllm() -> None:
    """Every pytest run where the suite is installed loads its plugin (entry point ``pytest11``),
    most with no device to test: the report names the checks' metric keys instead of importing
    them (the worker path's replay imports vLLM: 6-11 s a process on 2 cores)."""
    import subprocess
    import sys

    from kvhal_conformance.base import device_faults, worker_path

    assert (report.FAULTS_METRIC, report.WORKER_METRIC) == (device_faults.METRIC, worker_path.METRIC)
    heavy = "{'vllm', 'kvhal_conformance.base'}"
    code = f"import sys, kvhal_conformance.plugin; print(sorted({heavy} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
