"""Contract ``probe``: :class:`~kvhal_conformance.base.ProbeContract` against the plugin named by
``--kvhal-device`` (``kvhal conformance --device NAME``)."""

from kvhal_conformance.base import ProbeContract
from kvhal_conformance.fixtures import CommandLineFixtures


class TestProbe(CommandLineFixtures, ProbeContract):
    pass
