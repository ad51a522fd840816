"""Mutation testing of the suite: run it against every mutant and judge what it found.

``python -m kvhal_conformance.mutation [--out DIR] [--jobs N] [NAME ...]`` runs the
suite (size preset ``tiny``, a fixed seed) against each mutant of
:mod:`kvhal_conformance.mutants`, several runs per process (``pytest.main`` in
process, so the interpreter starts once per job), and prints per mutant whether
the suite reported exactly the clauses its defect breaks: every clause in
``breaks`` broken (else the suite *missed* the defect), none outside ``breaks``
and ``also`` (else a check fired on a defect it is not about). It ends with the
clauses no mutant reaches. Exit status 0 when every mutant was judged right. The worker-path
contract (trace replays, seconds each) runs only for the mutants whose defect is its to find
(:func:`about_worker_path`). The costly contracts (:data:`COSTLY`: streams and events, copies,
device faults; two thirds of a run's time) run against a mutant whose clauses they check, and
against every :data:`SAMPLE_EVERY`-th mutant whatever it breaks; ``--every-contract`` runs every
contract (but the worker path) against every mutant.

``--plugin NAME=MODULE:ATTR`` adds other broken plugins to the same runs (their
reports are written, not judged here).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvhal_conformance.base import CONTRACT_CLASSES
from kvhal_conformance.clauses import clauses_of, hook_clauses
from kvhal_conformance.mutants import EVERY_CLAUSE, MUTANTS, Mutant, reached

PACKAGE_DIR = Path(__file__).resolve().parent
SEED = 20261122
#: A plugin that does not pin may not keep the runs waiting for background pinning.
PIN_TIMEOUT_S = 2.0
#: Slow mutants first, so that parallel jobs end together.
SLOW_FIRST = ("PinsOnlyUnder2GiB", "IdleRecordNeedsSync", "NeverPins", "SlowLargeCopies", "ThreadPoolStream")
#: The suite's classes that take most of a run (tiny sizes, idle machine: 4.5, 1.8 and 0.9 s of
#: a 10 s run); the others (probe, layouts, allocation, host memory, bad input, throughput: 2 s
#: together) run against every mutant.
COSTLY = ("TestStreamsEvents", "TestCopies", "TestDeviceFaults")
#: Every this-many-th mutant (in the order of MUTANTS) runs the costly contracts whatever its
#: defect: a fixed sample on which they must stay silent about defects not theirs.
SAMPLE_EVERY = 3


@dataclass(frozen=True)
class Job:
    """One run of the suite: the plugin's name, its ``MODULE:ATTR``, its throughput floor, the
    size preset when not the run's, and the suite's classes left out (``TestWorkerPath`` ...)."""

    name: str
    spec: str
    floor: float = 0.0
    sizes: str = ""
    skip: tuple[str, ...] = ("TestWorkerPath",)


def about_worker_path(m: Mutant) -> bool:
    """Whether a mutant's defect is the worker path's to find: only those runs replay the traces
    (seconds each, a minute or two over every mutant; the others' defects break a clause the
    worker path depends on, where it would read "not judged" anyway)."""
    return any(c.startswith("worker.") for c in (*m.breaks, *m.also, *m.not_judged))


def test_classes(m: Mutant) -> set[str]:
    """The suite's classes holding a check of a clause the mutant breaks, may break, or must leave
    not judged (every class for a plugin that cannot be bound)."""
    clauses = {*m.breaks, *m.also, *m.not_judged}
    every = EVERY_CLAUSE in clauses
    return {
        "Test" + cls.__name__.removesuffix("Contract")  # AllocationContract: TestAllocation
        for cls in CONTRACT_CLASSES
        for name, func in inspect.getmembers(cls, inspect.isfunction)
        if name.startswith("test_") and (every or clauses & set(clauses_of(func)))
    }


def skipped(m: Mutant, every_contract: bool = False) -> tuple[str, ...]:
    """The suite's classes a mutant's run leaves out: the worker path unless its defect is the
    worker path's to find; the costly ones none of its clauses concern, unless it is in the sample."""
    skip = () if about_worker_path(m) else ("TestWorkerPath",)
    if every_contract or list(MUTANTS).index(m.name) % SAMPLE_EVERY == 0:
        return skip
    mine = test_classes(m)
    return (*skip, *(c for c in COSTLY if c not in mine))


def mutant_jobs(names: Sequence[str] = (), every_contract: bool = False) -> list[Job]:
    chosen = [MUTANTS[n] for n in names] if names else list(MUTANTS.values())
    chosen.sort(key=lambda m: (m.name not in SLOW_FIRST, list(MUTANTS).index(m.name)))
    spec = f"{__package__}.mutants:{{}}"
    return [
        Job(m.name, spec.format(m.name), m.floor or 0.0, m.sizes or "", skipped(m, every_contract))
        for m in chosen
    ]


def suite_args(job: Job, out: Path, sizes: str, seed: int) -> list[str]:
    """The pytest command line of one run (the suite's own configuration)."""
    args = ["-c", str(PACKAGE_DIR / "conformance.ini"), "--rootdir", str(PACKAGE_DIR), "-q", "--tb=no"]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        args += ["-p", "kvhal_conformance.plugin"]
    return [
        *args,
        "--pyargs", __package__,
        "--kvhal-device", job.name,
        "--kvhal-plugin", job.spec,
        "--kvhal-sizes", job.sizes or sizes,
        "--kvhal-seed", str(seed),
        "--kvhal-report", str(out),
        "--kvhal-throughput-floor", str(job.floor),
        "--kvhal-pin-timeout", str(PIN_TIMEOUT_S),
        *(("-k", " and ".join(f"not {c}" for c in job.skip)) if job.skip else ()),
    ]  # fmt: skip


def run_here(jobs: Sequence[Job], out: Path, sizes: str, seed: int) -> None:
    """Run each job in this process; its output goes to ``out/NAME.log``, its report to
    ``out/NAME.json`` (plus ``returncode`` and ``seconds``).

    What the process holds before the runs (torch, kvhal, the suite: about 600,000 objects) is
    kept out of the garbage collector's passes while they run (:func:`gc.freeze`): pytest ends
    each run with two full collections, 0.3-0.4 s each over that heap, and tens of thousands of
    objects over what the runs made."""
    out.mkdir(parents=True, exist_ok=True)
    gc.freeze()
    try:
        _run_here(jobs, out, sizes, seed)
    finally:
        gc.unfreeze()


def _run_here(jobs: Sequence[Job], out: Path, sizes: str, seed: int) -> None:
    for job in jobs:
        start = time.perf_counter()
        with (
            open(out / f"{job.name}.log", "w") as log,
            contextlib.redirect_stdout(log),
            contextlib.redirect_stderr(log),
        ):
            code = int(pytest.main(suite_args(job, out, sizes, seed)))
        path = out / f"{job.name}.json"
        if path.exists():
            report = json.loads(path.read_text())
            report["returncode"], report["seconds"] = code, round(time.perf_counter() - start, 2)
            path.write_text(json.dumps(report, indent=2) + "\n")


def run_jobs(
    jobs: Sequence[Job], out: Path, sizes: str, seed: int, processes: int, timeout: float = 1500
) -> None:
    """Run ``jobs`` in ``processes`` worker processes (each several runs in process)."""
    if processes <= 1:
        run_here(jobs, out, sizes, seed)
        return
    shares = [jobs[i::processes] for i in range(processes)]
    workers = []
    for share in shares:
        if not share:
            continue
        specs = [f"{j.name}={j.spec}@{j.floor}@{j.sizes}@{','.join(j.skip)}" for j in share]
        command = [
            sys.executable,
            "-m",
            f"{__package__}.mutation",
            "--worker",
            "--out",
            str(out),
            "--sizes",
            sizes,
        ]
        workers.append(subprocess.Popen([*command, "--seed", str(seed), *specs]))
    deadline = time.monotonic() + timeout
    for worker in workers:
        try:
            worker.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.kill()


@dataclass
class Verdict:
    """What the suite reported for one mutant, against what its defect breaks."""

    name: str
    defect: str
    breaks: tuple[str, ...]
    broken: tuple[str, ...] = ()
    missed: tuple[str, ...] = ()
    stray: tuple[str, ...] = ()
    #: clauses (or ``throughput DIRECTION`` rows) that had to read "not judged" and did not
    judged: tuple[str, ...] = ()
    seconds: float = 0.0
    error: str = ""
    messages: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.missed or self.stray or self.judged or self.error)


#: Extra runs of a mutant whose breakage the suite missed (see :func:`main`).
RETRIES = 2


def judge(m: Mutant, report: dict[str, Any] | None) -> Verdict:
    """Compare a run's report with what mutant ``m`` breaks."""
    verdict = Verdict(m.name, m.defect, m.breaks)
    if report is None:
        verdict.error = "no report (the run crashed or timed out)"
        return verdict
    clauses = report.get("clauses", [])
    verdict.broken = tuple(c["id"] for c in clauses if c["status"] == "fail")
    verdict.messages = {c["id"]: (c["failures"] or [""])[0][:300] for c in clauses if c["status"] == "fail"}
    verdict.missed = tuple(c for c in m.breaks if c not in verdict.broken)
    allowed = set(m.breaks) | set(m.also)
    if EVERY_CLAUSE not in allowed:
        verdict.stray = tuple(c for c in verdict.broken if c not in allowed)
    status = {c["id"]: c["status"] for c in clauses}
    judged = [c for c in m.not_judged if status.get(c) != "not judged"]
    if "copy.throughput" in m.not_judged:
        rows = report.get("throughput", {})
        judged += [] if rows else ["throughput (no measurement)"]
        judged += [
            f"throughput {d}" for d, row in rows.items() if not str(row["status"]).startswith("not judged")
        ]
    verdict.judged = tuple(judged)
    verdict.seconds = float(report.get("seconds", 0.0))
    return verdict


def unreached(verdicts: Sequence[Verdict]) -> list[str]:
    """Clauses of the map that no mutant was found breaking."""
    caught = {c for v in verdicts if not v.error for c in v.breaks if c not in v.missed}
    return [c.id for c in hook_clauses() if c.id not in caught]


def read_report(out: Path, name: str) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def summary(verdicts: Sequence[Verdict]) -> str:
    lines = [f"{'mutant':<30} {'seconds':>7}  verdict"]
    for v in verdicts:
        if v.error:
            state = f"ERROR: {v.error}"
        elif v.ok:
            state = f"caught: {', '.join(v.breaks)}"
        else:
            state = "; ".join(
                part
                for part in (
                    f"MISSED {', '.join(v.missed)}" if v.missed else "",
                    f"ALSO BROKE {', '.join(v.stray)}" if v.stray else "",
                    f"JUDGED {', '.join(v.judged)} (must read not judged)" if v.judged else "",
                )
                if part
            )
        lines.append(f"{v.name:<30} {v.seconds:>7.1f}  {state}")
    missing = unreached(verdicts)
    lines.append(f"clauses no mutant reaches: {', '.join(missing) if missing else 'none'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvhal_conformance.mutation", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--out", default="mutation-results", help="folder for the reports and logs")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--sizes", default="tiny", help="size preset of the runs (default tiny)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="NAME=MODULE:ATTR",
        help="also run the suite against this plugin (report written, not judged)",
    )
    parser.add_argument(
        "--every-contract",
        action="store_true",
        help="run every contract (but the worker path) against every mutant, not the costly ones "
        "only against the mutants they concern and a sample",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    if args.worker:  # NAME=SPEC@FLOOR@SIZES@SKIP,... from a parent process
        jobs = []
        for item in args.names:
            name, rest = item.split("=", 1)
            spec, floor, sizes, skip = rest.rsplit("@", 3)
            jobs.append(Job(name, spec, float(floor), sizes, tuple(filter(None, skip.split(",")))))
        run_here(jobs, out, args.sizes, args.seed)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    jobs = mutant_jobs(args.names, args.every_contract)
    for item in args.plugin:
        name, spec = item.split("=", 1)
        jobs.append(Job(name, spec))
    run_jobs(jobs, out, args.sizes, args.seed, args.jobs)
    chosen = [MUTANTS[j.name] for j in jobs if j.name in MUTANTS]
    verdicts = [judge(m, read_report(out, m.name)) for m in chosen]
    # A race (work overtaking work) shows only when threads interleave badly, which a busy
    # machine can make rarer: a mutant whose clause was missed runs again, alone, up to
    # RETRIES times; only a miss every time is the suite's.
    for _ in range(RETRIES):
        missed = {v.name for v in verdicts if v.missed and not v.error}
        if not missed:
            break
        run_jobs([j for j in jobs if j.name in missed], out, args.sizes, args.seed, 1)
        verdicts = [
            judge(m, read_report(out, m.name)) if m.name in missed else v
            for m, v in zip(chosen, verdicts, strict=True)
        ]
    (out / "mutation.json").write_text(
        json.dumps(
            {
                "verdicts": [{**asdict(v), "ok": v.ok} for v in verdicts],
                "unreached": unreached(verdicts),
                "reached": reached(MUTANTS),
            },
            indent=2,
        )
        + "\n"
    )
    print(summary(verdicts))
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
