"""Contract ``streams_events``: :class:`~kvhal_conformance.base.StreamsEventsContract` against the
plugin named by ``--kvhal-device`` (``kvhal conformance --device NAME``)."""

from kvhal_conformance.base import StreamsEventsContract
from kvhal_conformance.fixtures import CommandLineFixtures


class TestStreamsEvents(CommandLineFixtures, StreamsEventsContract):
    pass
