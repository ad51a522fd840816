"""The device-fault contract's "not tested" rows: a plugin without a fault hook, and one whose
hook declines a fault, are reported so in the JSON and Markdown reports, never as a silent pass.
(The contract catching a swallowed device error and a stub fault hook is the mutation run's
``SwallowsDeviceErrors`` and ``FaultHookIsAStub``, tests/test_conformance_selftest.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvhal.cpu import CPUPlugin
from kvhal.descriptor import DeviceDescriptor, Refusal
from kvhal.hookspecs import hookimpl
from tests.test_conformance_selftest import contract, suite

MODULE = "kvhal_conformance.test_device_faults"


class NoFaultHook(CPUPlugin):
    """The CPU plugin, not declaring test.faults (a plugin without a fault hook)."""

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        found = super().kvhal_probe()
        assert isinstance(found, DeviceDescriptor)
        return dataclasses.replace(found, capabilities=found.capabilities - {"test.faults"})


class CannotStall(CPUPlugin):
    """The CPU plugin, whose fault hook cannot stall a stream."""

    @hookimpl
    def kvhal_inject_device_fault(self, fault: str, stream: object, seconds: float) -> bool:
        if fault == "stream_stall":
            return False
        return super().kvhal_inject_device_fault(fault, stream, seconds)


def run(tmp_path: Path, name: str, plugin: str) -> dict:
    return suite(name, tmp_path, "--kvhal-plugin", f"tests.test_conformance_faults:{plugin}", module=MODULE)


def test_a_plugin_without_a_fault_hook_reads_not_tested(tmp_path: Path) -> None:
    report = run(tmp_path, "nofaults", "NoFaultHook")
    faults = contract(report, "device_faults")
    assert faults["status"] == "skip", faults
    row = "device faults: not tested (no fault hook: plugin 'nofaults' does not declare test.faults)"
    assert report["device_faults"]["summary"] == row
    assert {t["message"] for t in faults["tests"]} == {row}
    assert f"## Device faults\n\n{row}" in (tmp_path / "nofaults.md").read_text()


def test_a_fault_the_hook_declines_reads_not_tested_and_the_others_are_tested(tmp_path: Path) -> None:
    report = run(tmp_path, "nostall", "CannotStall")
    assert contract(report, "device_faults")["status"] == "pass"
    assert report["device_faults"]["summary"] == (
        "device faults: copy_error tested, stream_stall not tested (kvhal_inject_device_fault returned "
        "False: the plugin cannot inject it), event_error tested"
    )
    # the control, the CPU plugin testing all three: test_suite_passes_cpu_plugin_through_the_cli
