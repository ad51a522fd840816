"""The conformance suite's worker-path contract: kept traces replayed on the plugin under test, a
trace given with ``--kvhal-trace`` among them; a trace the device cannot allocate reads "not
tested" with its reason; a plugin with a planted defect (``--kvhal-plugin``) fails naming the
step and block; a replay resting on copies another check found broken reads "not judged".
(Every kept trace passing on the CPU plugin: tests/test_replay.py and the self-test's CLI run;
the worker-path mutants: the mutation run, tests/test_conformance_selftest.py.) About 1 min."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvhal.vllm.trace import load, save
from kvhal_conformance import report
from kvhal_conformance.base.worker_path import METRIC
from kvhal_conformance.contracts import BY_ID
from kvhal_conformance.results import FAIL, NOT_JUDGED, PASS, by_clause
from kvhal_conformance.results import TestResult as Outcome
from kvhal_conformance.target import Target
from kvhal_conformance.traces import KEPT
from tests.test_conformance_selftest import contract, suite

MODULE = "kvhal_conformance.test_worker_path"


def test_a_trace_the_device_cannot_allocate_reads_not_tested(tmp_path: Path) -> None:
    trace = load(KEPT["chat-host-sync"])
    trace["caches"]["storages"] = [1 << 60]  # an exabyte of KV cache
    huge = tmp_path / "huge.json.gz"
    save(huge, trace)
    got = suite("cpu", tmp_path / "r", "--kvhal-trace", str(huge), "-k", "huge", module=MODULE)
    row = got["worker_path"]["huge"]
    assert row["status"] == "not tested" and "cannot be allocated" in row["reason"], row
    [test] = contract(got, "worker_path")["tests"]
    assert test["outcome"] == "skip" and "trace huge not tested" in test["message"]
    assert "| `huge` | not tested: the KV cache's" in (tmp_path / "r" / "cpu.md").read_text()


def test_a_planted_defect_fails_naming_step_and_block(tmp_path: Path) -> None:
    spec = "kvhal_conformance.mutants:SwapsBlocksInEngineLoads"
    got = suite("swaps", tmp_path, "--kvhal-plugin", spec, "-k", "chat-host-sync]", module=MODULE)
    worker = contract(got, "worker_path")
    assert worker["status"] == "fail" and got["returncode"] != 0
    [test] = worker["tests"]
    message = test["message"]
    assert message.startswith("[worker.path] trace chat-host-sync replayed on plugin 'swaps'"), message
    assert "step " in message and "load job" in message and "device block" in message
    clause = next(c for c in got["clauses"] if c["id"] == "worker.path")
    assert clause["status"] == "fail"
    assert got["worker_path"]["chat-host-sync"]["status"] == "failed"
    assert "**failed**" in (tmp_path / "swaps.md").read_text()


def _result(name: str, contract_id: str, outcome: str, clauses: tuple[str, ...], **kw: Any) -> Outcome:
    return Outcome(name, name, BY_ID[contract_id], "", outcome, kw.pop("message", ""), clauses=clauses, **kw)


def test_a_replay_resting_on_broken_copies_is_not_judged() -> None:
    copies = _result(
        "test_mapping",
        "copies",
        FAIL,
        ("copy.data",),
        message="[copy.data] dst block 1",
        broken=("copy.data",),
    )
    replayed = _result(
        "test_trace_replays[chat-host-sync]",
        "worker_path",
        FAIL,
        ("worker.path",),
        message="[worker.path] trace chat-host-sync ...",
        broken=("worker.path",),
        depends=("copy.data",),
        doubtful=("worker.path",),
    )
    results = {t.nodeid: t for t in (copies, replayed)}
    status = {clause.id: s for clause, s, _ in by_clause(results)}
    assert status["worker.path"] == NOT_JUDGED and status["copy.data"] == FAIL
    target = Target.__new__(Target)
    target.metrics = {METRIC: {"chat-host-sync": {"status": "failed"}}}
    rows = report.worker_path_rows(target, results)
    assert rows["chat-host-sync"]["status"] == "not judged: depends on copy.data, which failed"
    # with the copies sound, the replay's failure stands
    copies.outcome, copies.message, copies.broken = PASS, "", ()
    assert {c.id: s for c, s, _ in by_clause(results)}["worker.path"] == FAIL
