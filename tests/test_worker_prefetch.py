"""The worker side's prefetches: reads from the disk tier into host slots, started before the
step's forward, reported to the scheduler side only (vLLM waits for none of them); a host
hit then loads them in the step that schedules it."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

pytest.importorskip("vllm")

from kvhal.tiers.chain import TierRead
from kvhal.vllm.config import LowerTierConfig
from kvhal.vllm.metadata import ReadJob, WriteJob
from kvhal.vllm.worker_side import WorkerSide
from tests.test_worker_side import block, connector_config, kv_caches, load, same, settle, step, store

KEYS = [b"block-a" + bytes(29), b"block-b" + bytes(29)]


def disk_worker(tmp_path, wait_ms: int | None = 1000) -> tuple[WorkerSide, dict]:
    base = connector_config(slots=8)
    lower = LowerTierConfig(
        "disk", {"path": str(tmp_path / "disk"), "bytes_to_use": 1 << 20}, "through", "clock", wait_ms=wait_ms
    )
    config = dataclasses.replace(base, lower_tier=lower, fingerprint={"model": "worker-prefetch"})
    caches = kv_caches(split=False, seed=1)
    side = WorkerSide(config)
    side.register(caches)
    return side, caches


def disk_read() -> TierRead:
    """KEYS from disk slots 0 and 1 into host slots 4 and 6."""
    return TierRead("disk", KEYS, [0, 1], [4, 6])


def prefetch(job_id: int) -> ReadJob:
    return ReadJob(job_id, "s", [disk_read()])


def stored_then_stalled(worker: WorkerSide, stalled: bool) -> threading.Event:
    """KEYS stored in device blocks 3 and 5, written through to disk slots 0 and 1; then, if
    ``stalled``, every read of a data file hangs until the returned event is set (30 s at most)."""
    job = store(0, "r", [3, 5], [0, 1])
    job.writes = [WriteJob(1, "disk", KEYS, [0, 1], [0, 1])]
    step(worker, stores=[job])
    settle(worker)
    backend, release = worker.tiers["disk"].backend, threading.Event()
    read = backend._preadv

    def stalling(fd, buffers, offset):
        if stalled and fd != backend._index_fd:
            release.wait(timeout=30)
        read(fd, buffers, offset)

    backend._preadv = stalling
    return release


def test_a_prefetch_reads_the_disk_into_host_slots_and_a_sync_load_copies_them(tmp_path):
    worker, caches = disk_worker(tmp_path)
    job = store(0, "r", [3, 5], [0, 1])
    job.writes = [WriteJob(1, "disk", KEYS, [0, 1], [0, 1])]
    step(worker, stores=[job])
    settle(worker)
    # the prefetch starts at the step's beginning (handle_preemptions), before any load
    step(worker, prefetches=[prefetch(2)])
    finished, failed, _ = settle(worker)
    assert not finished and not failed  # vLLM waits for no prefetch
    assert worker.worker_meta().succeeded == {0: 1, 1: 1, 2: 1}
    assert worker.stats.data["tier_read_bytes{tier=disk}"] == 2 * worker.config.slot_bytes
    before = [block(caches, i) for i in (7, 9)]
    sync = load(3, "s", [7, 9], [4, 6])
    sync.sync = True
    step(worker, loads=[sync])
    assert worker.take_load_errors() == set()
    assert all(same(block(caches, 7), block(caches, 3))) and all(same(block(caches, 9), block(caches, 5)))
    assert not any(same(before[0], block(caches, 3))), "negative control: the blocks differed before"
    worker.shutdown()


def test_a_prefetch_of_blocks_the_disk_does_not_hold_fails_to_the_scheduler_side_only(tmp_path):
    worker, _ = disk_worker(tmp_path)
    step(worker, prefetches=[prefetch(2)])
    finished, failed, _ = settle(worker)
    assert not finished and not failed
    assert worker.worker_meta().failed == {2: 1}
    worker.shutdown()


@pytest.mark.parametrize("stalled", [True, False])
def test_an_asynchronous_load_from_a_stalled_disk_gives_up_at_its_deadline(tmp_path, stalled):
    """A load that reads the disk, then copies (no prefetch): past lower_tier_wait_ms its
    request is reported failed (vLLM recomputes it) while the read goes on holding its host
    slots, which the job releases once the read returns. The negative control: a disk that
    answers, the same load served."""
    worker, _ = disk_worker(tmp_path, wait_ms=100)
    release = stored_then_stalled(worker, stalled)
    slow = load(2, "s", [7, 9], [4, 6])
    slow.reads = [disk_read()]
    step(worker, loads=[slow])
    deadline = time.monotonic() + 20
    finished: set[str] = set()
    failed: set[str] = set()
    while "s" not in finished and time.monotonic() < deadline:
        time.sleep(0.02)
        more, more_failed, _ = worker.collect()
        finished, failed = finished | more, failed | more_failed
    assert finished == {"s"} and failed == ({"s"} if stalled else set())
    if stalled:
        assert worker.stats.data["tier_load_timeouts{tier=disk}"] == 1
        assert worker.jobs_in_flight == 1, "the read in flight still holds its slots"
        release.set()
    settle(worker)
    assert worker.worker_meta().failed == ({2: 1} if stalled else {})
    worker.shutdown()


@pytest.mark.parametrize("stalled", [True, False])
def test_shutdown_waits_for_a_stalled_read_only_until_its_deadline(tmp_path, monkeypatch, caplog, stalled):
    """A read of the disk that never returns does not hang the engine's shutdown: past
    SHUTDOWN_WAIT_S it goes on, says so, and leaves the read's host memory allocated (a late
    read must not land in freed memory). The control: a read that ends, everything closed."""
    from kvhal.vllm import worker_side

    monkeypatch.setattr(worker_side, "SHUTDOWN_WAIT_S", 0.3)
    worker, _ = disk_worker(tmp_path)
    release = stored_then_stalled(worker, stalled)
    step(worker, prefetches=[prefetch(2)])
    host = worker.host_tier
    start = time.monotonic()
    worker.shutdown()
    took = time.monotonic() - start
    stuck = [r for r in caplog.records if "did not end within" in r.getMessage()]
    if stalled:
        assert took < 5, f"shutdown waited {took:.1f} s on a stalled read"
        assert len(stuck) == 1 and host.buffer is not None, "the stalled read's host memory was freed"
        release.set()
    else:
        assert stuck == [] and host.buffer is None
