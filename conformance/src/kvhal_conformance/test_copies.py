"""Contract ``copies``: :class:`~kvhal_conformance.base.CopiesContract` against the plugin named by
``--kvhal-device`` (``kvhal conformance --device NAME``)."""

from kvhal_conformance.base import CopiesContract
from kvhal_conformance.fixtures import CommandLineFixtures


class TestCopies(CommandLineFixtures, CopiesContract):
    pass
