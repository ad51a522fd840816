"""A vendor's test suite: kvhal's conformance checks subclassed in a plain pytest file (no
``kvhal conformance``, no ``--kvhal-*`` options) for the built-in CPU plugin, with the vendor's
fixtures and one overridden hook; the same subclasses against a broken plugin fail, and a
subclass that redefines a check is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvhal.cpu import CPUPlugin
from kvhal.device import Device

base = pytest.importorskip("kvhal_conformance.base")

pytest_plugins = ["pytester"]


class VendorFixtures(base.ContractFixtures):
    """What a vendor supplies: its plugin, the sizes its CI affords, a throughput floor, and
    its own stream factory (here one that counts the streams the checks make)."""

    plugin: type = CPUPlugin

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_target(cls) -> Any:
        return base.Target.of_plugin(cls.plugin(), "vendor")

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_sizes(cls) -> Any:
        return base.TINY

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_throughput_floor(cls) -> float:
        return 0.0  # a shared CI machine is no place for a speed target

    @pytest.fixture
    def kvhal_new_stream(self, kvhal_device: Device) -> Callable[[], Any]:
        made: list[Any] = []

        def new_stream() -> Any:
            made.append(kvhal_device.create_stream())
            return made[-1]

        new_stream.made = made  # type: ignore[attr-defined]
        return new_stream


class TestProbe(base.ProbeContract, VendorFixtures):
    pass


class TestLayouts(base.LayoutsContract, VendorFixtures):
    # A documented hook: the vendor's own attention kernels are asked about too.
    attention_backends = (*base.LayoutsContract.attention_backends, "VENDOR_ATTN")

    def test_the_vendor_backend_is_checked(self, request: pytest.FixtureRequest) -> None:
        """The overridden hook reached the parametrized check."""
        ids = [item.nodeid for item in request.session.items]
        assert any("TestLayouts::test_layouts_are_permutations[VENDOR_ATTN]" in i for i in ids), ids


class TestAllocation(base.AllocationContract, VendorFixtures):
    pass


class TestHostMemory(base.HostMemoryContract, VendorFixtures):
    pass


class TestStreamsEvents(base.StreamsEventsContract, VendorFixtures):
    def test_checks_submit_to_the_vendor_streams(self, rig: Any, kvhal_new_stream: Any) -> None:
        """A vendor's own test beside the contract's: the supplied stream factory is what a check
        submits its work to."""
        self.test_wait_for_unrecorded_event_holds_nothing_up(rig)
        assert len(kvhal_new_stream.made) == 1


class TestCopies(base.CopiesContract, VendorFixtures):
    pass


class TestBadInput(base.BadInputContract, VendorFixtures):
    pass


class TestDeviceFaults(base.DeviceFaultsContract, VendorFixtures):
    pass


class TestThroughput(base.ThroughputContract, VendorFixtures):
    pass


class TestWorkerPath(base.WorkerPathContract, VendorFixtures):
    # A documented hook: one kept trace (a vendor adds its own model's), replayed on the plugin
    # object registered as "vendor" (the target's registry, not the installed plugins).
    def traces_to_replay(self, config: pytest.Config) -> dict[str, Any]:
        return {"chat-host-sync": super().traces_to_replay(config)["chat-host-sync"]}


# -- negative controls ------------------------------------------------------------------

BROKEN_SUITE = """
import tests.test_conformance_vendor as vendor
from kvhal_conformance.base import ProbeContract
from tests.broken_plugins import CopiesWrongBlock


class TestBrokenCopies(vendor.TestCopies):
    plugin = CopiesWrongBlock


class TestNoTarget(ProbeContract):
    pass
"""


def test_the_same_subclasses_fail_a_broken_plugin(pytester: pytest.Pytester) -> None:
    """The vendor's copies class with a plugin that pairs blocks wrongly fails, naming the clause
    and the defect; a class that supplies no plugin errors, naming the fixture to supply."""
    pytester.makepyfile(test_broken_vendor=BROKEN_SUITE)
    recorder = pytester.inline_run("-p", "no:cacheprovider", "-k", "test_mapping or test_probe_returns")
    reports = recorder.getreports("pytest_runtest_logreport")
    failed = [r for r in reports if r.failed and r.when == "call" and "TestBrokenCopies" in r.nodeid]
    assert failed, [r.nodeid for r in reports]
    assert any("[copy.data" in str(r.longrepr) and "holds src block" in str(r.longrepr) for r in failed)
    passed = [r for r in reports if r.passed and r.when == "call" and "TestBrokenCopies" in r.nodeid]
    assert passed, "a one-pair or empty mapping copies right even with the pairs sorted apart"
    no_target = [r for r in reports if r.failed and r.when == "setup" and "TestNoTarget" in r.nodeid]
    assert no_target and all(
        "NotImplementedError" in str(r.longrepr)
        and "supply the plugin under test as a fixture 'kvhal_target'" in str(r.longrepr)
        for r in no_target
    )


def test_a_subclass_that_redefines_a_check_is_refused() -> None:
    with pytest.raises(TypeError, match=r"overrides test_mapping, a final check of .*CopiesContract"):

        class LaxCopies(base.CopiesContract):
            def test_mapping(self) -> None:  # type: ignore[override]
                pass

    with pytest.raises(TypeError, match=r"overrides test_throughput, a final check"):

        class Disabled(TestThroughput):
            test_throughput = None  # type: ignore[assignment]

    class Extended(base.AllocationContract):  # a documented hook is not a check: accepted
        def undeclared_requests(self, target: Any, device: Any) -> list[Any]:
            return super().undeclared_requests(target, device)


@pytest.mark.parametrize("contract", base.CONTRACT_CLASSES, ids=lambda c: c.__name__)
def test_every_check_is_final(contract: type) -> None:
    """Every check of every contract class is final; every contract of the report has its class."""
    checks = [name for name in dir(contract) if name.startswith("test_")]
    assert checks
    assert [n for n in checks if not getattr(getattr(contract, n), "__final__", False)] == []


def test_every_contract_has_a_class() -> None:
    from kvhal_conformance.contracts import CONTRACTS

    assert [c.contract_id for c in base.CONTRACT_CLASSES] == [c.id for c in CONTRACTS]
