"""Contract ``device_faults``: :class:`~kvhal_conformance.base.DeviceFaultsContract` against the
plugin named by ``--kvhal-device`` (``kvhal conformance --device NAME``)."""

from kvhal_conformance.base import DeviceFaultsContract
from kvhal_conformance.fixtures import CommandLineFixtures


class TestDeviceFaults(CommandLineFixtures, DeviceFaultsContract):
    pass
