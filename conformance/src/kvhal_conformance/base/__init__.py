"""kvhal's conformance suite as base classes: run it from your own test suite.

Subclass a contract class and supply the plugin under test (``kvhal_target``) as a
fixture, the way pandas' extension tests and fsspec's abstract tests are reused::

    import pytest
    from kvhal_conformance.base import ContractFixtures, CopiesContract, Target

    class MyDeviceFixtures(ContractFixtures):
        @pytest.fixture(scope="class")
        def kvhal_target(self) -> Target:
            return Target.find("mydevice")

    class TestCopies(CopiesContract, MyDeviceFixtures):
        pass

:class:`ContractFixtures` lists the fixtures (required and optional); each contract class
lists those it uses and its hooks (methods and attributes meant to be overridden). The checks
are final: a subclass redefining one is refused with TypeError. ``kvhal conformance --device
NAME`` runs these same classes, bound to the command line's options.
"""

from kvhal_conformance.base.allocation import AllocationContract
from kvhal_conformance.base.bad_input import BadInputContract
from kvhal_conformance.base.copies import CopiesContract
from kvhal_conformance.base.device_faults import DeviceFaultsContract
from kvhal_conformance.base.fixtures import (
    CANDIDATE_DTYPES,
    DEFAULT_SEED,
    ContractFixtures,
    HostCache,
    final,
)
from kvhal_conformance.base.host_memory import HostMemoryContract
from kvhal_conformance.base.layouts import LayoutsContract
from kvhal_conformance.base.probe import ProbeContract
from kvhal_conformance.base.streams_events import StreamsEventsContract
from kvhal_conformance.base.throughput import ThroughputContract
from kvhal_conformance.base.worker_path import WorkerPathContract
from kvhal_conformance.settings import FULL, QUICK, TINY, Sizes
from kvhal_conformance.target import Target

#: Every contract class, in the report's order (that of :data:`kvhal_conformance.contracts.CONTRACTS`).
CONTRACT_CLASSES: tuple[type[ContractFixtures], ...] = (
    ProbeContract,
    LayoutsContract,
    AllocationContract,
    HostMemoryContract,
    StreamsEventsContract,
    CopiesContract,
    BadInputContract,
    DeviceFaultsContract,
    ThroughputContract,
    WorkerPathContract,
)

__all__ = [
    "CANDIDATE_DTYPES",
    "CONTRACT_CLASSES",
    "DEFAULT_SEED",
    "FULL",
    "QUICK",
    "TINY",
    "AllocationContract",
    "BadInputContract",
    "ContractFixtures",
    "CopiesContract",
    "DeviceFaultsContract",
    "HostCache",
    "HostMemoryContract",
    "LayoutsContract",
    "ProbeContract",
    "Sizes",
    "StreamsEventsContract",
    "Target",
    "ThroughputContract",
    "WorkerPathContract",
    "final",
]
