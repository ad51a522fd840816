"""The report a vendor publishes with a release: JSON for tools, Markdown for people."""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import kvhal
import kvhal_conformance
from kvhal_conformance.results import (
    FAIL,
    NOT_JUDGED,
    PASS,
    SKIP,
    TestResult,
    by_clause,
    by_contract,
    contract_status,
    not_judged_message,
    unjudged_by,
    verdict,
)
from kvhal_conformance.settings import MiB, Settings
from kvhal_conformance.target import Target


def build(settings: Settings, target: Target | None, results: dict[str, TestResult]) -> dict[str, Any]:
    groups = by_contract(results)
    d = target.descriptor if target else None
    return {
        "suite": {"name": "kvhal-conformance", "version": kvhal_conformance.__version__},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "verdict": verdict(groups),
        "plugin": {
            "name": settings.device,
            "distribution": target.info.distribution if target else None,
            "version": target.version if target else None,
            "bound": bool(target and target.device),
            "error": target.error if target else None,
        },
        "device": None
        if d is None
        else {
            "name": d.name,
            "vendor": d.vendor,
            "torch_device_type": d.torch_device_type,
            "capabilities": sorted(d.capabilities),
            "priority": d.priority,
            "device_count": d.device_count,
            "details": dict(d.details),
        },
        "environment": {
            "torch": torch.__version__,
            "kvhal": kvhal.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "run": {
            "sizes": settings.size_preset,
            "seed": settings.seed,
            "throughput_floor": settings.throughput_floor,
        },
        "contracts": [
            {
                "id": contract.id,
                "title": contract.title,
                "checks": contract.checks,
                "status": contract_status(tests),
                "counts": {o: sum(t.outcome == o for t in tests) for o in (PASS, FAIL, SKIP, NOT_JUDGED)},
                "tests": [
                    {
                        "name": t.name,
                        "checks": t.doc,
                        "outcome": t.outcome,
                        "message": t.message,
                        "duration_s": round(t.duration_s, 4),
                    }
                    for t in tests
                ],
            }
            for contract, tests in groups
        ],
        "clauses": [
            {
                "id": clause.id,
                "hook": clause.hook,
                "promise": clause.text,
                "status": status,
                "checks": sorted({t.name for t in tests}),
                "failures": [t.message for t in tests if clause.id in t.broken],
                "note": not_judged_message(unjudged_by(tests, clause.id)) if status == NOT_JUDGED else "",
            }
            for clause, status, tests in by_clause(results)
        ],
        "throughput": throughput_rows(target, results),
        "worker_path": worker_path_rows(target, results),
        "first_probe": target.metrics.get("first_probe", {}) if target else {},
        "pinning": _pinning(target),
        "device_faults": {
            "faults": dict(target.metrics.get(FAULTS_METRIC, {})) if target else {},
            "summary": faults_summary(target),
        },
    }


#: The keys of Target.metrics the device-fault and worker-path checks fill
#: (kvhal_conformance.base.device_faults.METRIC, kvhal_conformance.base.worker_path.METRIC): named
#: here, not imported, so that loading the pytest plugin (every pytest run where the suite is
#: installed, most with no device to test) imports neither the suite's classes nor vLLM, which
#: the worker path's replay imports (6-11 s a process on 2 cores).
FAULTS_METRIC, WORKER_METRIC = "device_faults", "worker_path"


def faults_summary(target: Target | None) -> str | None:
    """:func:`kvhal_conformance.base.device_faults.faults_summary` (imported when a report is made)."""
    from kvhal_conformance.base.device_faults import faults_summary as summary

    return summary(target)


def _pinning(target: Target | None) -> dict[str, Any] | None:
    """What witnessed the plugin's pinning, and at which sizes (None when no check asked)."""
    choice = target.metrics.get("pinning") if target else None
    return choice.as_report() if choice is not None else None


def throughput_rows(target: Target | None, results: dict[str, TestResult]) -> dict[str, Any]:
    """The throughput measurements; a direction whose check was not judged (it times copies by
    events that may complete early) reads "not judged: depends on X, which failed"."""
    rows = {d: dict(m) for d, m in (target.metrics.get("throughput", {}) if target else {}).items()}
    for t in results.values():
        direction = t.name.partition("[")[2].rstrip("]")
        if t.contract.id == "throughput" and t.outcome == NOT_JUDGED and direction in rows:
            rows[direction]["status"] = not_judged_message(t.unjudged_by)
    return rows


def worker_path_rows(target: Target | None, results: dict[str, TestResult]) -> dict[str, Any]:
    """Each trace's replay (:func:`kvhal_conformance.base.worker_path.row`); one whose check was
    not judged (a clause it rests on failed) reads "not judged: depends on X, which failed"."""
    rows = {name: dict(r) for name, r in (target.metrics.get(WORKER_METRIC, {}) if target else {}).items()}
    for t in results.values():
        name = t.name.partition("[")[2].rstrip("]")
        if t.contract.id == "worker_path" and t.outcome == NOT_JUDGED and name in rows:
            rows[name]["status"] = not_judged_message(t.unjudged_by)
    return rows


#: Every status a contract or clause may have, in the order summaries give them.
STATUSES = (PASS, FAIL, NOT_JUDGED, SKIP, "not run")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(report: dict[str, Any]) -> str:
    plugin, device, env, run = report["plugin"], report["device"], report["environment"], report["run"]
    counts = [c["status"] for c in report["contracts"]]
    lines = [
        f"# kvhal conformance: plugin `{plugin['name']}`",
        "",
        f"**Verdict: {report['verdict'].upper()}**: {len(counts)} contracts, "
        + ", ".join(f"{counts.count(s)} {s}" for s in STATUSES if counts.count(s)),
        "",
        "| | |",
        "|---|---|",
        f"| Plugin | `{plugin['name']}`, distribution {plugin['distribution'] or 'unknown'}, "
        f"version {plugin['version'] or 'unknown'} |",
    ]
    if device:
        lines += [
            f"| Device | {device['name']} (vendor {device['vendor']}, torch device type "
            f"`{device['torch_device_type']}`, {device['device_count']} visible, "
            f"priority {device['priority']}) |",
            f"| Capabilities | {', '.join(f'`{c}`' for c in device['capabilities']) or 'none'} |",
        ]
    lines += [
        f"| torch | {env['torch']} |",
        f"| kvhal | {env['kvhal']} (suite {report['suite']['name']} {report['suite']['version']}) |",
        f"| Python, platform | {env['python']}, {env['platform']} |",
        f"| Date | {report['date']} |",
        f"| Run | {run['sizes']} sizes, seed {run['seed']}, throughput floor {run['throughput_floor']} |",
        "",
    ]
    if plugin["error"]:
        lines += [f"The plugin could not be bound: {_cell(plugin['error'])}", ""]
    lines += [
        "## Contracts",
        "",
        "| Contract | Status | Pass | Fail | Skip | Not judged | Checks |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in report["contracts"]:
        n = c["counts"]
        lines.append(
            f"| {c['title']} | **{c['status']}** | {n['pass']} | {n['fail']} | {n['skip']} "
            f"| {n.get(NOT_JUDGED, 0)} | {_cell(c['checks'])} |"
        )
    lines += _clause_lines(report.get("clauses", []))
    lines += _throughput_lines(report["throughput"])
    lines += _worker_path_lines(report.get("worker_path") or {})
    lines += _pinning_lines(report.get("pinning"))
    faults = (report.get("device_faults") or {}).get("summary")
    if faults:
        lines += ["", "## Device faults", "", _cell(faults)]
    probe = report.get("first_probe") or {}
    if probe:
        lines += [
            "",
            "## First probe",
            "",
            f"What the plugin's first probe kept (measured right before and after it): threads "
            f"{', '.join(probe['threads_kept']) or 'none'}; host memory {probe['host_memory']}; device "
            f"memory {probe['device_memory']} ({_cell(probe['device_memory_measured_by'])}).",
        ]
    failures: dict[tuple[str, str], list[str]] = {}  # a message repeated by many checks, said once
    for c in report["contracts"]:
        for t in c["tests"]:
            if t["outcome"] == FAIL:
                failures.setdefault((c["title"], t["message"]), []).append(f"`{t['name']}`")
    if failures:
        lines += ["", "## Failures", ""]
        for (title, message), names in failures.items():
            which = names[0] if len(names) == 1 else f"{len(names)} checks ({', '.join(names)})"
            lines += [f"- **{title}** {which}: {_cell(message)}"]
    unjudged = [(c, t) for c in report["contracts"] for t in c["tests"] if t["outcome"] == NOT_JUDGED]
    if unjudged:
        lines += ["", "## Not judged", ""]
        lines += [f"- **{c['title']}** `{t['name']}`: {_cell(t['message'])}" for c, t in unjudged]
    skips: dict[str, list[str]] = {}
    for c in report["contracts"]:
        for t in c["tests"]:
            if t["outcome"] == SKIP:
                skips.setdefault(t["message"], []).append(f"`{t['name']}`")
    if skips:
        lines += ["", "## Skipped", ""]
        lines += [f"- {_cell(reason)}: {', '.join(names)}" for reason, names in skips.items()]
    if device and device["details"]:
        lines += ["", "## Device details", ""]
        lines += [f"- {key}: {_cell(value)}" for key, value in device["details"].items()]
    return "\n".join(lines) + "\n"


def _clause_lines(clauses: list[dict[str, Any]]) -> list[str]:
    if not clauses:
        return []
    statuses = [c["status"] for c in clauses]
    lines = [
        "",
        "## Clauses",
        "",
        f"Every promise of every device hook (`kvhal.hookspecs`), and of the hooks together on a "
        f"vLLM worker's path (`worker.path`), by id: {len(clauses)} clauses, "
        + ", ".join(f"{statuses.count(s)} {s}" for s in STATUSES if statuses.count(s))
        + ".",
        "",
        "| Clause | Hook | Status | Checks |",
        "|---|---|---|---|",
    ]
    for c in clauses:
        status = c.get("note") or c["status"]
        lines.append(f"| `{c['id']}` | `{c['hook']}` | {_cell(status)} | {len(c['checks'])} |")
    return lines


def _throughput_lines(throughput: dict[str, Any]) -> list[str]:
    if not throughput:
        return []
    lines = [
        "",
        "## Throughput",
        "",
        "Fastest of several block copies through kvhal (validation, the plugin's copy, its event) "
        "against a plain torch copy of the same bytes between a device tensor and a host buffer, "
        "measured alternately in the same run.",
        "",
        "| Direction | Layout | Host memory | Copied | Descriptors | Plugin GiB/s | torch GiB/s | Ratio "
        "| Floor | Status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for direction, m in throughput.items():
        lines.append(
            f"| {direction} | {m['layout']} | {m.get('host_memory', 'pinned')} | "
            f"{m['bytes'] / MiB:.0f} MiB in {m['blocks']} blocks | "
            f"{m['descriptors']} | {m['plugin_gib_s']:.2f} | "
            f"{m['torch_gib_s']:.2f} | {m['ratio']:.2f} | {m['floor']} | {m['status']} |"
        )
    return lines


def _worker_path_lines(rows: dict[str, Any]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        "## Worker path",
        "",
        "Recorded vLLM worker traces replayed on the device (`kvhal replay`, docs/replay.md): the "
        "worker side's calls in the recorded order, every loaded block compared byte for byte with "
        "what was stored, every store with what it was given, every job's end with the recording's. "
        "The last columns: the engine thread's time in kvhal's calls a step (no forward).",
        "",
        "| Trace | Status | Steps | Jobs | Blocks loaded | Blocks stored | Step median us | Step p90 us "
        "| Wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        status = r["status"]
        if r["status"] == "not tested" and r["reason"]:
            status = f"not tested: {r['reason']}"
        elif r["status"] == "failed":
            status = f"**failed**: {r['failures']} wrong, the first: {r['first_failure']}"
        lines.append(
            f"| `{name}` | {_cell(status)} | {r['steps']} | {r['jobs']} | {r['blocks_loaded']} "
            f"| {r['blocks_stored']} | {_num(r['step_median_us'])} | {_num(r['step_p90_us'])} "
            f"| {r['wall_s']} |"
        )
    return lines


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def _pinning_lines(pinning: dict[str, Any] | None) -> list[str]:
    if not pinning:
        return []
    lines = ["", "## Pinning", "", _cell(pinning["summary"])]
    if pinning["checked"]:
        lines += ["", "| Bytes | Witnessed pinned | What the witness read | Bounded |", "|---|---|---|---|"]
        lines += [
            f"| {c['bytes']} | {'yes' if c['pinned'] else '**no**'} | {_cell(c['how'])} "
            f"| {_cell(c['bounded'] or '')} |"
            for c in pinning["checked"]
        ]
    return lines


def write(report: dict[str, Any], folder: Path) -> tuple[Path, Path]:
    """Write ``NAME.json`` and ``NAME.md`` (NAME: the plugin's) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    name = str(report["plugin"]["name"])
    json_path, md_path = folder / f"{name}.json", folder / f"{name}.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(to_markdown(report))
    return json_path, md_path
