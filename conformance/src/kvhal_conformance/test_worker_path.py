"""Contract ``worker_path``: :class:`~kvhal_conformance.base.WorkerPathContract` against the plugin
named by ``--kvhal-device`` (``kvhal conformance --device NAME``)."""

from kvhal_conformance.base import WorkerPathContract
from kvhal_conformance.fixtures import CommandLineFixtures


class TestWorkerPath(CommandLineFixtures, WorkerPathContract):
    pass
