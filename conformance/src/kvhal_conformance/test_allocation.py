"""Contract ``allocation``: :class:`~kvhal_conformance.base.AllocationContract` against the plugin named by
``--kvhal-device`` (``kvhal conformance --device NAME``)."""

from kvhal_conformance.base import AllocationContract
from kvhal_conformance.fixtures import CommandLineFixtures


class TestAllocation(CommandLineFixtures, AllocationContract):
    pass
