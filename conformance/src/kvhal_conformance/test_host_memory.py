"""Contract ``host_memory``: :class:`~kvhal_conformance.base.HostMemoryContract` against the plugin named by
``--kvhal-device`` (``kvhal conformance --device NAME``)."""

from kvhal_conformance.base import HostMemoryContract
from kvhal_conformance.fixtures import CommandLineFixtures


class TestHostMemory(CommandLineFixtures, HostMemoryContract):
    pass
