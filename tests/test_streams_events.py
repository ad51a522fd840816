"""Event and stream semantics of the CPU plugin, through the device facade."""

from __future__ import annotations

import threading

import pytest
import torch

import kvhal
from kvhal.cpu.copy_engine import CopyEngine
from kvhal.errors import TransferError
from kvhal.geometry import KVGeometry
from kvhal.layouts import BLHNC
from tests.helpers import block_bytes, fill_random_bytes


def gate(device, stream):
    """Hold ``stream`` until the returned threading.Event is set (CPU streams run Python tasks)."""
    opened = threading.Event()
    stream.submit(lambda: opened.wait(120))  # a bound, so a broken test cannot hang CI
    return opened


def small(cpu):
    g = KVGeometry(2, 8, 4, 2, 8, torch.float32)
    cache = cpu.allocate_kv_cache(g, BLHNC)
    fill_random_bytes(cache, seed=11)
    return cache, cpu.allocate_host_cache(g, BLHNC, 8)


def test_unrecorded_event_is_complete(cpu):
    event = cpu.create_event()
    assert cpu.query_event(event) is True
    cpu.synchronize_event(event)


def test_event_not_complete_before_its_work(cpu):
    cache, host = small(cpu)
    stream = cpu.create_stream()
    opened = gate(cpu, stream)
    done = cpu.copy_blocks(cache, host, [(3, 0)], stream)
    assert cpu.query_event(done) is False
    assert block_bytes(kvhal.get_kv_from_block(host, 0)) != block_bytes(kvhal.get_kv_from_block(cache, 3))
    opened.set()
    cpu.synchronize_event(done)
    assert cpu.query_event(done) is True
    assert block_bytes(kvhal.get_kv_from_block(host, 0)) == block_bytes(kvhal.get_kv_from_block(cache, 3))


def test_work_on_one_stream_stays_ordered(cpu):
    """Device -> host -> second device cache on one stream: the second copy reads what the first wrote."""
    cache, host = small(cpu)
    target = cpu.allocate_kv_cache(cache.geometry, BLHNC)
    stream = cpu.create_stream()
    opened = gate(cpu, stream)
    cpu.copy_blocks(cache, host, [(5, 2)], stream)
    last = cpu.copy_blocks(host, target, [(2, 6)], stream)
    opened.set()
    cpu.synchronize_event(last)
    assert block_bytes(kvhal.get_kv_from_block(target, 6)) == block_bytes(kvhal.get_kv_from_block(cache, 5))


def test_stream_waits_on_another_streams_event(cpu):
    cache, host = small(cpu)
    first, second = cpu.create_stream(), cpu.create_stream()
    opened = gate(cpu, first)
    marker = cpu.create_event()
    cpu.record_event(marker, first)
    cpu.stream_wait_event(second, marker)
    seen = []
    second.submit(lambda: seen.append(opened.is_set()))
    done = cpu.copy_blocks(cache, host, [(1, 1)], second, after_compute=False)
    # Give a stream that ignored the wait time to run ahead; a correct one cannot, however long.
    threading.Event().wait(0.3)
    opened.set()
    cpu.synchronize_event(done)
    assert seen == [True], "second stream ran ahead of the event it waits on"
    assert cpu.query_event(marker)


def test_compute_stream_waits_for_a_load(cpu):
    """The engine waits for a load by making its (inline) compute stream wait on the load's event."""
    cache, host = small(cpu)
    stream = cpu.create_stream()
    opened = gate(cpu, stream)
    done = cpu.copy_blocks(host, cache, [(0, 7)], stream)
    threading.Timer(0.05, opened.set).start()
    cpu.stream_wait_event(cpu.current_stream(), done)  # blocks the caller, like compute would
    assert cpu.query_event(done)


def test_failed_copy_surfaces_on_its_event_only(cpu):
    cache, host = small(cpu)
    stream = cpu.create_stream()

    def explode():
        raise OSError("simulated DMA fault")

    stream.submit(explode)
    failed = cpu.create_event()
    cpu.record_event(failed, stream)
    with pytest.raises(TransferError, match="simulated DMA fault"):
        cpu.synchronize_event(failed)
    with pytest.raises(TransferError):
        cpu.query_event(failed)
    later = cpu.copy_blocks(cache, host, [(2, 2)], stream)
    cpu.synchronize_event(later)  # the stream keeps working; the error was reported once
    assert block_bytes(kvhal.get_kv_from_block(host, 2)) == block_bytes(kvhal.get_kv_from_block(cache, 2))


def test_copy_runs_off_the_callers_thread(cpu, monkeypatch):
    threads = []
    cache, host = small(cpu)
    stream = cpu.create_stream()
    run = CopyEngine.run

    def recording_run(self, *descriptors):
        threads.append(threading.current_thread())
        return run(self, *descriptors)

    monkeypatch.setattr(CopyEngine, "run", recording_run)
    cpu.synchronize_event(cpu.copy_blocks(cache, host, [(0, 0)], stream))
    assert threads and threading.current_thread() not in threads


# -- faults the CPU plugin arms in its own engine (kvhal_inject_device_fault) ------------------


def _inject(cpu, fault: str, stream, seconds: float) -> bool:
    return cpu._pm.hook.kvhal_inject_device_fault(fault=fault, stream=stream, seconds=seconds)


def test_a_copy_error_writes_part_of_the_copy_then_fails_its_event_naming_plugin_and_hook(cpu):
    cache, host = small(cpu)
    stream = cpu.create_stream()
    assert _inject(cpu, "copy_error", stream, 0.0) is True
    pairs = [(b, b) for b in range(8)]
    failed = cpu.copy_blocks(cache, host, pairs, stream)
    with pytest.raises(TransferError) as raised:
        cpu.synchronize_event(failed)
    message = str(raised.value)
    assert message.startswith("plugin 'cpu' (distribution kvhal (built-in)), hook kvhal_synchronize_event: ")
    assert "injected device fault: the copy stopped halfway (copy_error)" in message
    with pytest.raises(TransferError, match="hook kvhal_query_event: "):
        cpu.query_event(failed)
    copied = [
        block_bytes(kvhal.get_kv_from_block(host, b)) == block_bytes(kvhal.get_kv_from_block(cache, b))
        for b in range(8)
    ]
    assert not all(copied), "a copy the device failed delivered every block"
    later = cpu.copy_blocks(cache, host, pairs, stream)  # fires once: the stream works again
    cpu.synchronize_event(later)
    assert all(
        block_bytes(kvhal.get_kv_from_block(host, b)) == block_bytes(kvhal.get_kv_from_block(cache, b))
        for b in range(8)
    )


def test_a_stall_holds_back_later_work_and_an_event_error_fails_the_next_event_only(cpu):
    import time

    cache, host = small(cpu)
    stream = cpu.create_stream()
    assert _inject(cpu, "stream_stall", stream, 0.3) is True
    started = time.perf_counter()
    held = cpu.copy_blocks(cache, host, [(1, 1)], stream)
    assert cpu.query_event(held) is False
    cpu.synchronize_event(held)
    assert time.perf_counter() - started >= 0.29
    assert _inject(cpu, "event_error", stream, 0.0) is True
    failed = cpu.copy_blocks(cache, host, [(2, 2)], stream)
    with pytest.raises(TransferError, match=r"the event failed \(event_error\)"):
        cpu.synchronize_event(failed)
    cpu.synchronize_event(cpu.copy_blocks(cache, host, [(3, 3)], stream))


def test_faults_are_armed_only_where_the_cpu_plugin_can_make_them(cpu):
    stream = cpu.create_stream()
    assert _inject(cpu, "copy_error", cpu.current_stream(), 0.0) is False  # the caller's own thread
    assert _inject(cpu, "power_cut", stream, 0.0) is False
    cache, host = small(cpu)
    cpu.synchronize_event(cpu.copy_blocks(cache, host, [(1, 1)], stream))  # nothing was armed
