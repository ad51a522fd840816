"""Contract ``throughput``: :class:`~kvhal_conformance.base.ThroughputContract` against the plugin named by
``--kvhal-device`` (``kvhal conformance --device NAME``)."""

from kvhal_conformance.base import ThroughputContract
from kvhal_conformance.fixtures import CommandLineFixtures


class TestThroughput(CommandLineFixtures, ThroughputContract):
    pass
