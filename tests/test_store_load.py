"""``kvhal bench store-load``'s short form: each store (Redis, a 3-master Redis Cluster, Mooncake)
under 2 client processes running kvhal's remote tier, with faults mid-run, and no value served
wrong, no host slot leaked, no batch hung, every fault followed by work done, within a deadline.

Cost: 71-92 s here, on 2 cores busy with others' work (load 10-24), 44 CPU-seconds: 5
client processes each importing kvhal once (2 clients, and a spare and a check for each kill,
kept by one pool across the three runs), a Redis server, a Redis Cluster and a Mooncake master
and node started, 5-8 s of load a store, then the read-back. ``kvhal bench store-load`` is the
long form (BENCHMARKS.md). The byte check's negative control: a value kvhal accepts (framed and
signed right) whose bytes are another block's is counted wrong.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvhal.bench.store_load.blocks import Content, key
from kvhal.bench.store_load.client import open_tier
from kvhal.bench.store_load.figures import failures
from kvhal.bench.store_load.fleet import ClientPool, LoadConfig, run_store
from kvhal.bench.store_load.verify import BlockReader
from kvhal.cli import main
from kvhal.errors import ValidationError
from kvhal.testing.mooncake_servers import MooncakeCluster
from kvhal.testing.redis_servers import RedisServer, redis_server_binary

pytestmark = [
    pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed"),
    pytest.mark.timeout(600),
]

#: seconds one store's short run may take, start to read-back (its own deadlines are shorter)
DEADLINE_S = 180.0
SHORT = {
    "clients": 2,
    "own_blocks": 1024,  # not wrapped by the kill (the first fault): its last batch is of fresh names
    "shared_blocks": 64,
    "pause_s": 0.6,
    "stall_s": 0.6,
    "window_s": 0.8,  # a fault no sooner than 1.6 s after the last ended: work is seen between
    "op_deadline_s": 20.0,
    "drain_s": 20.0,
    "blocked_wait_s": 20.0,
    "mooncake_discard_s": 1,  # a killed writer's names held 1 s, not Mooncake's 30
}
#: per store: its faults (every kind dealt at least once) and seconds of load
RUNS = {
    "redis": (("kill", "pause", "stall", "restart"), 8.0),
    "cluster": (("stall", "restart"), 5.0),
    "mooncake": (("kill", "restart"), 6.0),
}


@pytest.fixture(scope="module")
def pool() -> Iterator[ClientPool]:
    with ClientPool() as p:
        yield p


@pytest.mark.parametrize("store", list(RUNS))
def test_a_store_under_load_with_faults_serves_nothing_wrong_and_leaks_nothing(store, pool):
    if store == "mooncake" and not MooncakeCluster.available():
        pytest.skip(MooncakeCluster.missing())
    faults, duration = RUNS[store]
    config = LoadConfig(**SHORT, faults=faults, duration_s=duration)
    began = time.monotonic()
    row = run_store(store, config, pool)
    took = time.monotonic() - began
    assert failures(row) == []
    assert row["errors"] == []
    assert row["wrong"] == 0 and row["leaked_slots"] == 0
    assert row["hung_ops"] == 0 and row["unclosed_tiers"] == 0
    assert row["lost_unexplained"] == 0
    assert row["blocks_done"] > 0 and row["read_batches"] > 0
    assert [e["fault"] for e in row["events"]] == list(faults)
    for event in row["events"]:
        assert event["done_after"] > 0, f"nothing done after {event}"
    if "kill" in faults:
        (kill,) = (e for e in row["events"] if e["fault"] == "kill")
        assert kill["writing"], "the client was killed with a batch write in flight"
        assert row["killed_left"] > 0 and row["killed_left_never"] == 0
    if store in ("redis", "mooncake"):  # every value of the restarted server is gone: found gone
        assert row["lost_to_restart"] > 0
    assert took < DEADLINE_S, f"{store}: {took:.0f} s"


def test_a_value_kvhal_accepts_whose_bytes_are_another_blocks_is_counted_wrong(tmp_path):
    """The negative control of ``wrong``: under block B's name, block A's bytes, framed and
    signed with the fleet's secret (a genuine value for kvhal: OK), and the check says wrong."""
    with RedisServer() as server:
        job = {
            "url": server.url,
            "secret": bytes(range(32)).hex(),
            "nonce": bytes(8).hex(),
            "block_bytes": 4096,
            "batch": 4,
            "slots": 8,
            "op_deadline_s": 10.0,
            "drain_s": 10.0,
        }
        nonce = bytes.fromhex(job["nonce"])
        host, tier = open_tier(job, [])
        try:
            content = Content(job["block_bytes"])
            words = np.frombuffer(host.slot_memory(0), dtype=np.uint64)
            content.fill(words, key(nonce, 1, 0))  # block (1, 0)'s bytes ...
            assert tier.write([key(nonce, 1, 1)], [0]).result(10) == [True]  # ... as block (1, 1)
            content.fill(words, key(nonce, 1, 2))
            assert tier.write([key(nonce, 1, 2)], [0]).result(10) == [True]  # and a right one
        finally:
            tier.close()
            host.close()
        reader = BlockReader(job)
        try:
            found = dict(reader.read([(1, 1), (1, 2), (1, 3)]))
        finally:
            reader.close()
    assert found == {(1, 1): "wrong", (1, 2): "ok", (1, 3): "missing"}


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        ({"clients": 0}, "clients"),
        ({"block_bytes": 100}, "block_bytes"),
        ({"faults": ("kill", "flood")}, "faults"),
        ({"duration_s": 2.0}, "duration_s"),
        ({"write_fraction": 1.5}, "write_fraction"),
        ({"own_blocks": 4}, "own_blocks"),
    ],
)
def test_a_bad_argument_is_refused_naming_it_before_anything_starts(change, argument):
    with pytest.raises(ValidationError, match=f"^{argument}:"):
        LoadConfig(**change).check()


def test_the_command_names_a_bad_flag_as_typed_and_starts_nothing(capsys):
    assert main(["bench", "store-load", "--duration", "3", "--out", "unused"]) == 2
    out = capsys.readouterr().out
    assert "--duration: 3 s leaves 0.6 s between 4 faults" in out
    assert main(["bench", "store-load", "--block", "100", "--out", "unused"]) == 2
    assert "--block: must be a multiple of 32" in capsys.readouterr().out
