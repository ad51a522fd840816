"""Contract ``layouts``: :class:`~kvhal_conformance.base.LayoutsContract` against the plugin named by
``--kvhal-device`` (``kvhal conformance --device NAME``)."""

from kvhal_conformance.base import LayoutsContract
from kvhal_conformance.fixtures import CommandLineFixtures


class TestLayouts(CommandLineFixtures, LayoutsContract):
    pass
