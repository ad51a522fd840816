"""Contract ``bad_input``: :class:`~kvhal_conformance.base.BadInputContract` against the plugin named by
``--kvhal-device`` (``kvhal conformance --device NAME``)."""

from kvhal_conformance.base import BadInputContract
from kvhal_conformance.fixtures import CommandLineFixtures


class TestBadInput(CommandLineFixtures, BadInputContract):
    pass
