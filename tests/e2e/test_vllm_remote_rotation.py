"""Trust under a fleet's real life (issue 38, items 1 and 2), on real vLLM engines and Redis.

One test, two engine starts (about 60-80 s here): engine A signs with the old secret S1; engine
B, rotated (current S2, previous S1), serves A's values and counts them. Then a writer with a
third secret overwrites every value in the store: B refuses them (neither of its secrets),
recomputes once, and its own values replace the planted ones, so the prefix is served again.
The negative controls are below the engine: tests/test_remote_refused_names.py (a name nobody
refused keeps the plant; a reader without the previous secret refuses S1's values).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhal.bench.counters import kvhal_counters
from kvhal.tiers.remote import format as remote_format
from tests.e2e.common import prompts
from tests.e2e.test_vllm_connector import LENGTH, SERVED, baseline, loaded, tokens
from tests.e2e.test_vllm_remote_tier import BLOCKS_PER_PROMPT, RESET, SETTLE, engine, handshake, remote


def metrics(step: dict) -> dict:
    """The Redis tier's counters at a ``metrics`` step, by family."""
    return kvhal_counters(step["metrics"], "redis")


def populate(model: str, url: str, batch: list[list[int]], env: dict) -> None:
    """Engine A serves ``batch`` (its blocks are written to the store), then exits."""
    steps = engine(model, remote(url), [{"op": "generate", "prompts": batch}, *SETTLE], env)
    assert tokens(steps[0]) == baseline(model, batch)
    assert metrics(steps[-1])["tier_written_blocks"] == len(batch) * BLOCKS_PER_PROMPT


@pytest.fixture
def own_redis() -> Iterator:
    from kvhal.testing.redis_servers import RedisServer

    with RedisServer() as server:
        yield server


def resign_everything(url_server, secret: bytes) -> int:
    """A writer holding another secret: every value in the store, signed again with ``secret``."""
    client = url_server.client()
    count = 0
    for name in client.scan_iter(match="kvhal/*"):
        value = client.get(name)
        header = bytearray(value[: remote_format.HEADER_BYTES])
        payload = memoryview(value[remote_format.HEADER_BYTES :])
        namespace = bytes(header[32:40])  # the header's namespace field
        remote_format.write_header(memoryview(header), payload, namespace, name.decode(), secret)
        client.set(name, bytes(header) + bytes(payload))
        count += 1
    return count


def test_a_rotated_fleet_keeps_its_hits_and_a_planted_prefix_is_served_again(
    model, own_redis, tmp_path: Path
):
    batch = prompts(2, LENGTH, seed=381)
    populate(model, own_redis.url, batch, {"KVHAL_REMOTE_SECRET": "S1"})  # engine A, before the rotation
    planted: list[int] = []

    def plant() -> None:
        signal, go = tmp_path / "signal-0", tmp_path / "go-0"
        while not signal.exists():
            threading.Event().wait(0.05)
        try:
            planted.append(resign_everything(own_redis, b"S3"))
        finally:
            go.touch()

    helper = threading.Thread(target=plant, daemon=True)
    helper.start()
    steps = [
        {"op": "generate", "prompts": batch},  # A's values, signed with the previous secret
        {"op": "metrics"},
        handshake(tmp_path, 0),  # a writer with a third secret overwrites every value
        RESET,
        {"op": "generate", "prompts": batch},  # refused, recomputed, written over the plants
        {"op": "settle"},
        RESET,
        {"op": "generate", "prompts": batch},  # served from the store again
        {"op": "metrics"},
    ]
    env = {"KVHAL_REMOTE_SECRET": "S2", "KVHAL_REMOTE_PREVIOUS_SECRETS": "S1"}
    result = engine(model, remote(own_redis.url), steps, env)
    helper.join(timeout=60)
    blocks = len(batch) * BLOCKS_PER_PROMPT
    assert planted == [blocks], f"the plant found {planted} values"
    assert tokens(result[0]) == baseline(model, batch)
    assert loaded(result[0]) == [SERVED] * 2, "the rotated engine did not serve the old secret's values"
    first = metrics(result[1])
    assert first["tier_previous_secret_blocks"] == blocks, first
    assert tokens(result[4]) == baseline(model, batch)
    assert loaded(result[4]) == [0, 0], "a value signed with neither secret was served"
    assert tokens(result[7]) == baseline(model, batch)
    assert loaded(result[7]) == [SERVED] * 2, "the planted names still block the prefix"
    last = metrics(result[8])
    assert last["tier_unauthenticated_blocks"] >= 2, last
    assert last["tier_previous_secret_blocks"] == blocks, "the engine's own values are signed with S2"
