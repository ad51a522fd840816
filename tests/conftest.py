"""Shared fixtures: a registry and device bound to the built-in CPU plugin alone; hypothesis's
profiles (``KVHAL_HYPOTHESIS=quick`` runs each property with a tenth of its examples: the inner
loop, ``bash scripts/test.sh --quick``; CI and the full run use ``full``)."""

from __future__ import annotations

import os

import pytest
from hypothesis import Phase, settings
from hypothesis.internal.conjecture import engine as hypothesis_engine

from kvhal.registry import PluginRegistry

# A failing property must be reported, blob included, well inside pytest-timeout's 300 s
# (pyproject.toml), or CI's log shows a timeout and not the example (issue 35):
# - no explain phase: with it, hypothesis runs every example after the first failure
#   under a line tracer (the shrinking too), which made one shrink outlast the timeout;
# - shrinking stops after SHRINK_SECONDS (hypothesis's own limit, 300 s, is the timeout's;
#   it documents the constant as the one to patch), reporting the smallest failure so far;
# - print_blob: the report ends with the @reproduce_failure line that replays it.
SHRINK_SECONDS = 60
hypothesis_engine.MAX_SHRINKING_SECONDS = SHRINK_SECONDS
PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)

# Loaded here, before any test module is imported: tests.helpers.examples() reads it when
# the modules' @settings decorators run, and every settings object made after this point
# (each test's @settings, the state machines' SETTINGS) inherits print_blob and the phases.
settings.register_profile("full", max_examples=100, print_blob=True, phases=PHASES)
settings.register_profile("quick", max_examples=10, print_blob=True, phases=PHASES)
settings.load_profile(os.environ.get("KVHAL_HYPOTHESIS", "full"))


#: The longest files first: with two xdist workers taking whole files (--dist loadfile), the
#: longest start first and the workers end together instead of one waiting out the other's last
#: long file. Seconds per file in CI (2 cores, bash scripts/test.sh, 2026-11-28, 2,057 s in all)
#: where measured there, "alone" where measured alone on 2 cores shared with other runs
#: (2026-11-29, ``pytest -q -p no:randomly FILE``, load 2-9; CI's run two files at a time, so
#: more); "old" figures are from before and not remeasured.
LONGEST_FIRST = (
    "test_bench_chat.py",  # 266; alone 235-247
    # TP=2 engines, two spawned workers each, both cores bound: 450 with 6 engines; alone 5
    # engines, 104 (load 2) to 132 (load 3-7)
    "test_vllm_tensor_parallel.py",
    # the mutation batch in four shards (tests/conformance_mutation.py), 150-250 each; in one
    # file it was 863, the critical path; shard 1 alone 182-190
    "test_conformance_mutants_1.py",
    "test_conformance_mutants_2.py",
    "test_conformance_mutants_3.py",
    "test_conformance_mutants_4.py",
    "test_vllm_disk_tier.py",  # alone 110 (load 6-9; 169 before its engines skipped their teardown)
    "test_vllm_connector.py",  # old: 200; alone 88 (load 2)
    "test_vllm_remote_tier.py",  # old: 160
    "test_vllm_overlap.py",  # old: 100
    "test_vllm_openai_server.py",  # old: 70
    "test_vendor_guide.py",  # 64
    # 107; alone 130 -> 52 once its child's pytest no longer imported vLLM under ASan
    "test_sanitizers.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file, and among the rest, is kept


@pytest.fixture
def registry() -> PluginRegistry:
    """A registry with only the built-in CPU plugin (entry points not loaded)."""
    return PluginRegistry(autoload=False, allow=None, block=())


@pytest.fixture
def cpu(registry):
    return registry.select("cpu")


@pytest.fixture(scope="session")
def seaweedfs():
    """SeaweedFS's S3 gateway on loopback (:class:`kvhal.testing.seaweedfs_servers.SeaweedS3`,
    about 4 s to start), once per test run (per xdist worker) for every module that asks; its
    bucket ``kvhal`` exists, its ``credentials`` sign requests (a test puts them in the AWS
    variables). A test that stops it starts it again before it ends."""
    from kvhal.testing.seaweedfs_servers import SeaweedS3

    if why := SeaweedS3.missing():
        pytest.skip(why)
    with SeaweedS3() as s3:
        yield s3
