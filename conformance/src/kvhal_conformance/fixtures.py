"""The fixtures that bind the suite's own test modules to the command line: the plugin named by
``--kvhal-device`` (``kvhal conformance --device``), the sizes, seed and floor asked for."""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch

from kvhal_conformance.base.fixtures import ContractFixtures
from kvhal_conformance.base.worker_path import trace_name
from kvhal_conformance.plugin import dtypes_of, state_of
from kvhal_conformance.settings import Sizes
from kvhal_conformance.target import Target


class CommandLineFixtures(ContractFixtures):
    """Every contract's fixtures from the run's options (see :mod:`kvhal_conformance.plugin`)."""

    def dtypes_to_check(self, config: pytest.Config) -> Sequence[torch.dtype]:
        """The required dtypes and every ``dtype.*`` the plugin under test declares."""
        state = state_of(config)
        return dtypes_of(state.target() if state.settings.device is not None else None)

    def backends_to_check(self, config: pytest.Config) -> Sequence[str | None]:
        """The class's names, then ``--kvhal-backends``, then the plugin's ``ATTENTION_BACKENDS``."""
        state = state_of(config)
        names = [*super().backends_to_check(config), *state.settings.backends]
        if state.settings.device is not None:
            with contextlib.suppress(ValueError):  # malformed: test_backend_layouts_are_offered says so
                names += state.target().declared_backends()
        return tuple(dict.fromkeys(names))

    def traces_to_replay(self, config: pytest.Config) -> Mapping[str, Path]:
        """The kept traces, then those of ``--kvhal-trace`` (``kvhal conformance --trace``)."""
        extra = {trace_name(p): p for p in state_of(config).settings.traces}
        return {**super().traces_to_replay(config), **extra}

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_backends(cls, pytestconfig: pytest.Config) -> tuple[str, ...]:
        return state_of(pytestconfig).settings.backends

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_target(cls, pytestconfig: pytest.Config) -> Target:
        return state_of(pytestconfig).target()  # one per run: the report reads its measurements

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_sizes(cls, pytestconfig: pytest.Config) -> Sizes:
        return state_of(pytestconfig).settings.sizes

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_run_seed(cls, pytestconfig: pytest.Config) -> int:
        return state_of(pytestconfig).settings.seed

    @pytest.fixture
    def kvhal_seed(self, kvhal_run_seed: int, request: pytest.FixtureRequest) -> int:
        """The run's seed mixed with the test's id without its class (``--kvhal-seed`` N gives the
        mappings it gave when the checks were module functions)."""
        nodeid = request.node.nodeid.replace(f"::{request.cls.__name__}::", "::")
        return (kvhal_run_seed ^ zlib.crc32(nodeid.encode())) & 0x7FFFFFFF

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_throughput_floor(cls, pytestconfig: pytest.Config) -> float:
        return state_of(pytestconfig).settings.throughput_floor
