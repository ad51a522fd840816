"""An object store as the fleet's shared tier, below the engine: kvhal's real scheduler and
worker sides (one worker in the scheduler's process, the CPU plugin) over the session's
SeaweedFS S3 gateway. Engine B's lookup reads what engine A stored into host slots and loads
it in its step, counted under ``tier="s3"``; objects damaged in the bucket are refused and
counted by kind, recomputed, and replaced there by the recomputed blocks, which a third engine
then loads. About 6 s here beside the server's start (vLLM imported: 10 s more, once)."""

from __future__ import annotations

import time
import uuid

import pytest

pytest.importorskip("vllm")
pytest.importorskip("obstore")

import obstore

from kvhal.testing.seaweedfs_servers import SeaweedS3
from kvhal.tiers.remote.format import HEADER_BYTES
from kvhal.vllm.keys import offload_key
from tests.test_local_read import loaded_in_its_step, run
from tests.test_remote_local_read import engine, lookup
from tests.test_scheduler_side import output, prefill, request
from tests.test_store_s3 import use_credentials

TIER = "s3"
KINDS = ("corrupt", "foreign")


@pytest.fixture(autouse=True)
def _credentials(monkeypatch: pytest.MonkeyPatch, seaweedfs: SeaweedS3) -> None:
    use_credentials(monkeypatch, seaweedfs.credentials)


def written(scheduler, worker, blocks: int) -> None:
    """Steps until ``blocks`` blocks were written to the store."""
    deadline = time.monotonic() + 10
    while scheduler.stats.data.get(f"tier_written_blocks{{tier={TIER}}}", 0) < blocks:
        assert time.monotonic() < deadline, "the store write never ended"
        run(scheduler, worker, scheduler.build_meta(output()))
        time.sleep(0.01)


def computed(url: str, engine_id: str, seed: int) -> dict:
    """Engine ``engine_id`` computes request "a" into device blocks 1-3 and writes it to the store."""
    scheduler, worker, caches = engine(url, engine_id, seed=seed)
    req = request(engine_id)
    scheduler.track(req)
    lookup(scheduler, req)  # the store's answer (a miss, or blocks refused)
    run(scheduler, worker, prefill(scheduler, req, [1, 2, 3]))
    run(scheduler, worker, scheduler.build_meta(output()))
    written(scheduler, worker, 3)
    worker.shutdown()
    scheduler.close()
    return caches


def test_a_store_hit_is_read_by_the_lookup_and_loaded_in_its_step(seaweedfs):
    url = seaweedfs.url(prefix=f"engine-{uuid.uuid4().hex[:8]}")
    caches_a = computed(url, "a", seed=1)
    scheduler, worker, caches = engine(url, "b", seed=2)
    b = request("b")
    scheduler.track(b)
    answer, _ = lookup(scheduler, b)
    assert answer == (8, False), "a host hit, loaded in the step that schedules it"
    assert scheduler.stats.data[f"tier_loaded_blocks{{tier={TIER}}}"] == 2
    loaded_in_its_step(scheduler, worker, caches, b, source=caches_a)
    assert scheduler.stats.data[f"tier_hit_tokens{{tier={TIER}}}"] == 8
    worker.shutdown()
    scheduler.close()


def test_damaged_objects_are_counted_recomputed_and_replaced_by_the_recomputed_blocks(seaweedfs):
    prefix = f"engine-{uuid.uuid4().hex[:8]}"
    url = seaweedfs.url(prefix=prefix)
    computed(url, "a", seed=1)
    objects = seaweedfs.objects()
    stored = [meta["path"] for batch in obstore.list(objects, prefix=prefix) for meta in batch]
    # the objects of the prompt's blocks, in order (a name ends with its block's key)
    hexes = [offload_key(h, 0).hex() for h in request("a").block_hashes[:3]]
    keys = [next(path for path in stored if path.endswith(x)) for x in hexes]
    first = bytearray(obstore.get(objects, keys[0]).bytes())
    first[HEADER_BYTES + 7] ^= 0x01  # a flipped byte of the first block
    obstore.put(objects, keys[0], bytes(first))
    obstore.put(objects, keys[1], bytes(obstore.get(objects, keys[2]).bytes()))  # replayed

    scheduler, worker, caches_b = engine(url, "b", seed=2)
    b = request("b")
    scheduler.track(b)
    answer, _ = lookup(scheduler, b)
    assert answer == (0, False), "a damaged block was offered"
    counted = {kind: scheduler.stats.data.get(f"tier_{kind}_blocks{{tier={TIER}}}", 0) for kind in KINDS}
    assert counted == {"corrupt": 1, "foreign": 1}, counted
    assert scheduler.stats.data[f"tier_failed_loads{{tier={TIER}}}"] == 1
    # B recomputes the prompt, and its blocks go to the store over the refused objects
    run(scheduler, worker, prefill(scheduler, b, [1, 2, 3]))
    run(scheduler, worker, scheduler.build_meta(output()))
    written(scheduler, worker, 3)
    worker.shutdown()
    scheduler.close()

    scheduler, worker, caches_c = engine(url, "c", seed=3)
    c = request("c")
    scheduler.track(c)
    answer, _ = lookup(scheduler, c)
    assert answer == (8, False), "the replaced objects are served"
    loaded_in_its_step(scheduler, worker, caches_c, c, source=caches_b)
    worker.shutdown()
    scheduler.close()
