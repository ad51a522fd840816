"""The pytest plugin (entry point ``pytest11``): options, the plugin under test, the report.

It is loaded by every pytest run in an environment where kvhal-conformance is
installed, so it does nothing unless ``--kvhal-device`` is given: the suite's
own tests then skip, saying how to run them, and no other test is touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvhal.descriptor import dtype_capability
from kvhal.device import REQUIRED_DTYPES
from kvhal_conformance import report as report_module
from kvhal_conformance import timing
from kvhal_conformance.contracts import Contract, contract_of_module
from kvhal_conformance.results import (
    FAIL,
    NOT_JUDGED,
    TestResult,
    by_clause,
    by_contract,
    contract_status,
    not_judged_message,
    record,
    unjudged_by,
)
from kvhal_conformance.settings import Settings, add_options
from kvhal_conformance.target import Target

NO_DEVICE_REASON = (
    "kvhal conformance suite: name the device plugin to test with --kvhal-device NAME "
    "(or run `kvhal conformance --device NAME`)"
)


@dataclass
class State:
    """The run's settings, the plugin under test (found on first use), and outcomes."""

    settings: Settings
    results: dict[str, TestResult] = field(default_factory=dict)
    report_paths: tuple[Path, ...] = ()
    _target: Target | None = None

    def target(self) -> Target:
        if self._target is None:
            assert self.settings.device is not None
            self._target = Target.find(self.settings.device, self.settings.plugins)
        return self._target

    @property
    def found(self) -> Target | None:
        return self._target


STATE = pytest.StashKey[State]()


def state_of(config: pytest.Config) -> State:
    return config.stash[STATE]


def contract_of(item: pytest.Item) -> Contract | None:
    module = getattr(item, "module", None)
    return contract_of_module(module.__name__) if module is not None else None


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    settings = Settings.from_config(config)
    config.stash[STATE] = State(settings)
    timing.set_pin_timeout(settings.pin_timeout)
    timing.set_progress_reporter(lambda message: show_progress(config, message))


def show_progress(config: pytest.Config, message: str) -> None:
    """Write a long wait's progress on the terminal while a test runs (past output capturing)."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if terminal is None:
        timing.print_progress(message)
        return
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        terminal.ensure_newline()
        terminal.write_line(f"kvhal conformance: {message}", yellow=True)


#: What the ``dtype`` of a suite check runs over without a plugin to ask (the checks then skip).
DEFAULT_DTYPES = (*REQUIRED_DTYPES, torch.float8_e4m3fn)


def dtypes_of(target: Target | None) -> list[torch.dtype]:
    """Every dtype a plugin must copy, and every ``dtype.*`` it declares (resolved in torch)."""
    if target is None or target.descriptor is None:
        return list(DEFAULT_DTYPES)
    found = list(REQUIRED_DTYPES)
    for capability in sorted(target.descriptor.capabilities):
        dtype = (
            getattr(torch, capability.removeprefix("dtype."), None)
            if capability.startswith("dtype.")
            else None
        )
        if isinstance(dtype, torch.dtype) and dtype not in found and dtype_capability(dtype) == capability:
            found.append(dtype)
    return found


def pytest_report_header(config: pytest.Config) -> list[str]:
    settings = state_of(config).settings
    if settings.device is None:
        return []
    sizes = settings.size_preset
    return [
        f"kvhal conformance: device plugin {settings.device!r}, {sizes} sizes, seed {settings.seed}, "
        f"throughput floor {settings.throughput_floor}"
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if contract_of(item) is not None]
    if not ours:
        return
    state = state_of(config)
    if state.settings.device is None:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=NO_DEVICE_REASON))
        return
    state.target()  # an unknown plugin name is a usage error, before any test runs


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    contract = contract_of(item)
    state = state_of(item.config)
    if contract is not None and state.settings.device is not None:
        record(state.results, item, contract, call, report)
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    state = state_of(session.config)
    folder = state.settings.report_dir
    if folder is None or not state.results:
        return
    built = report_module.build(state.settings, state.found, state.results)
    state.report_paths = report_module.write(built, Path(folder))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    state = state_of(config)
    if not state.results:
        return
    write = terminalreporter.write_line
    terminalreporter.section(f"kvhal conformance: plugin {state.settings.device!r}")
    for contract, tests in by_contract(state.results):
        status = contract_status(tests)
        failed = [t for t in tests if t.outcome == FAIL]
        write(
            f"{contract.title:<20} {status:<8} ({len(tests)} tests)",
            red=status == FAIL,
            green=status == "pass",
        )
        for test in failed[:3]:
            write(f"    {test.name}: {test.message.splitlines()[0] if test.message else ''}"[:400])
    clauses = by_clause(state.results)
    broken = [clause.id for clause, status, _ in clauses if status == FAIL]
    if broken:
        write(f"clauses broken: {', '.join(broken)}", red=True)
    for clause, status, tests in clauses:
        if status == NOT_JUDGED:
            write(f"clause {clause.id}: {not_judged_message(unjudged_by(tests, clause.id))}", yellow=True)
    target = state.found
    if target is not None:
        if target.unbound_summary():
            write(str(target.unbound_summary()), red=True)
        faults = report_module.faults_summary(target)
        if faults:
            write(faults, yellow="not tested" in faults)
        for trace, r in report_module.worker_path_rows(target, state.results).items():
            why = f": {r['reason']}" if r["status"] == "not tested" else ""
            write(
                f"worker path {trace}: {r['status']}{why} ({r['steps']} steps, {r['blocks_loaded']} "
                f"blocks loaded, {r['blocks_stored']} stored)",
                red=r["status"] == "failed",
                yellow=r["status"] not in ("passed", "failed"),
            )
        throughput = report_module.throughput_rows(target, state.results)
        for direction, m in throughput.items():
            status = "" if m["status"] in ("pass", "fail") else f": {m['status']}"
            write(
                f"throughput {direction}: plugin {m['plugin_gib_s']:.2f} GiB/s, torch {m['torch_gib_s']:.2f} "
                f"GiB/s, ratio {m['ratio']:.2f} (floor {m['floor']}){status}"
            )
    for path in state.report_paths:
        write(f"report: {path}")
