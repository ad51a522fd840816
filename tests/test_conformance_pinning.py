"""Which witness judges a plugin's pinning, how large a buffer the machine allows, and what the
report says when no witness can judge."""

from __future__ import annotations

import dataclasses

import pytest

from kvhal.cpu.plugin import CPUPlugin
from kvhal.descriptor import Capability, DeviceDescriptor, Refusal
from kvhal.hookspecs import hookimpl
from kvhal.witness import PinningWitness, Witnessed
from kvhal_conformance import pinning, report
from kvhal_conformance.target import Target

pytest_plugins = ["pytester"]
MiB, GiB = 1 << 20, 1 << 30


class MetaPlugin(CPUPlugin):
    """The CPU plugin declaring host.pinned for torch device type ``meta``, which no plugin
    offers a witness for."""

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        descriptor = super().kvhal_probe()
        assert isinstance(descriptor, DeviceDescriptor)
        caps = descriptor.capabilities | {Capability.PINNED_HOST.value}
        return dataclasses.replace(descriptor, torch_device_type="meta", capabilities=caps)


class FakeWitness(PinningWitness):
    def __init__(self, name: str, device_type: str, why: str | None = None, limit: int | None = None):
        self.name, self.device_type, self.why, self.limit = name, device_type, why, limit

    def unavailable(self) -> str | None:
        return self.why

    def witness(self, address: int, nbytes: int) -> Witnessed:
        return Witnessed(True, None, "fake")

    def size_limit(self) -> int | None:
        return self.limit


def offering(*witnesses: PinningWitness) -> type[MetaPlugin]:
    class Offering(MetaPlugin):
        @hookimpl
        def kvhal_pinning_witnesses(self) -> tuple[PinningWitness, ...]:
            return witnesses

    return Offering


def test_another_plugins_witness_is_preferred_to_the_plugins_own():
    """A CPU plugin under test offers the mlock witness itself; the built-in one's is chosen."""
    choice = pinning.choose(Target.of_plugin(CPUPlugin(), "vendorcpu"))
    assert choice.offer is not None
    assert (choice.offer.witness.name, choice.offer.plugin) == ("mlock (/proc/self/smaps)", "cpu")
    assert choice.summary() == (
        "pinning: witnessed by 'mlock (/proc/self/smaps)' (offered by plugin 'cpu'); buffers checked: "
        "no buffer yet"
    )


def test_a_device_type_without_a_witness_is_reported_not_witnessed():
    choice = pinning.choose(Target.of_plugin(MetaPlugin(), "meta"))
    assert choice.offer is None
    assert choice.summary() == "pinning: not witnessed (no witness for device type 'meta')"
    lines = report._pinning_lines(choice.as_report())
    assert "pinning: not witnessed (no witness for device type 'meta')" in lines


def test_a_vendor_witness_for_its_own_device_type_is_used_and_an_unavailable_one_named():
    plugin = offering(FakeWitness("acme-register", "meta"))()
    choice = pinning.choose(Target.of_plugin(plugin, "meta"))
    assert choice.offer is not None and choice.offer.plugin == "meta"
    down = offering(FakeWitness("acme-register", "meta", why="libacme is not loaded"))()
    choice = pinning.choose(Target.of_plugin(down, "meta"))
    assert choice.offer is None
    assert choice.summary() == (
        "pinning: not witnessed (no witness available for device type 'meta': 'acme-register' "
        "(offered by plugin 'meta'): libacme is not loaded)"
    )


def test_an_offer_that_raises_or_is_no_witness_is_named_not_skipped_silently():
    class Raising(MetaPlugin):
        @hookimpl
        def kvhal_pinning_witnesses(self) -> tuple[PinningWitness, ...]:
            raise OSError("libacme.so: cannot open shared object file")

    choice = pinning.choose(Target.of_plugin(Raising(), "meta"))
    assert choice.summary() == (
        "pinning: not witnessed (no witness for device type 'meta' (ignored: plugin 'meta''s "
        "kvhal_pinning_witnesses raised OSError: libacme.so: cannot open shared object file))"
    )
    choice = pinning.choose(Target.of_plugin(offering("acme")(), "meta"))  # type: ignore[arg-type]
    assert "offered 'acme', not a PinningWitness" in choice.summary()


@pytest.mark.parametrize(
    ("available", "limit", "expected", "why"),
    [
        (24 * GiB, None, 4 * GiB, ""),
        (8 * GiB, None, 2 * GiB, "asked 4.00 GiB, bounded by 1/4 of MemAvailable (8.00 GiB)"),
        (
            24 * GiB,
            8 * MiB,
            8 * MiB,
            "asked 4.00 GiB, bounded by fake's limit (8.0 MiB, e.g. RLIMIT_MEMLOCK)",
        ),
        (None, None, 4 * GiB, ""),
    ],
)
def test_sizes_are_bounded_by_available_memory_and_the_witness_limit(
    monkeypatch, available, limit, expected, why
):
    monkeypatch.setattr(pinning, "memory_available", lambda: available)
    assert pinning.bounded(4 * GiB, FakeWitness("fake", "cpu", limit=limit)) == (expected, why)


def test_memory_available_is_read():
    available = pinning.memory_available()
    assert available is not None and available > 0


SUITE = """
import pytest

from kvhal_conformance.base import TINY, ContractFixtures, HostMemoryContract, Target
from kvhal_conformance.mutants import PinsNothingSaysPinned
from tests.test_conformance_pinning import MetaPlugin


class Fixtures(ContractFixtures):
    plugin = None

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_target(cls) -> Target:
        return Target.of_plugin(cls.plugin(), "vendor")

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_sizes(cls):
        return TINY


class TestNoWitness(HostMemoryContract, Fixtures):
    plugin = MetaPlugin


class TestLiar(HostMemoryContract, Fixtures):
    plugin = PinsNothingSaysPinned
"""


def test_the_check_skips_naming_the_missing_witness_and_fails_a_liar(pytester: pytest.Pytester):
    pytester.makepyfile(test_pinning_suite=SUITE)
    recorder = pytester.inline_run("-p", "no:cacheprovider", "-k", "test_pinning_is_witnessed")
    reports = [r for r in recorder.getreports("pytest_runtest_logreport") if r.when in ("setup", "call")]
    skipped = [r for r in reports if r.skipped and "TestNoWitness" in r.nodeid]
    assert len(skipped) == 3, [r.nodeid for r in reports]
    assert all(
        "pinning: not witnessed (no witness for device type 'meta')" in str(r.longrepr) for r in skipped
    )
    failed = [r for r in reports if r.failed and "TestLiar" in r.nodeid]
    assert len(failed) == 3, [(r.nodeid, r.outcome) for r in reports]
    assert all("[pinned.witness]" in str(r.longrepr) for r in failed)
    assert "sees it not pinned from byte 0 on" in str(failed[0].longrepr)
