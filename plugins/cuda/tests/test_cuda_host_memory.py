"""Host buffers registered off the critical path: truthful pinned state, correct frees."""

from __future__ import annotations

import threading

import pytest
import torch

from kvhal.accel.host_buffers import PinMode, pin_mode
from kvhal_cuda.host_memory import PAGE, HostRegistrar, map_zeroed


@pytest.mark.parametrize(
    "value, mode",
    [(None, PinMode.ASYNC), ("", PinMode.ASYNC), ("SYNC", PinMode.SYNC), (" off ", PinMode.OFF)],
)
def test_pin_mode_from_the_environment(value, mode):
    assert pin_mode(value) is mode


def test_an_unknown_pin_mode_is_an_error():
    with pytest.raises(ValueError, match="KVHAL_PIN_HOST='later'"):
        pin_mode("later")


@pytest.mark.parametrize("nbytes", [1, PAGE, 3 * PAGE + 17])
def test_mapped_buffers_are_zeroed_page_aligned_and_exact(nbytes):
    buffer = map_zeroed(nbytes)
    assert buffer.numel() == nbytes and buffer.dtype == torch.int8
    assert buffer.data_ptr() % PAGE == 0
    assert int(buffer.abs().sum()) == 0
    buffer.fill_(7)  # writable
    assert int(buffer[-1]) == 7


class FakeDriver:
    def __init__(self, result: int = 0, gate: threading.Event | None = None) -> None:
        self.result, self.gate = result, gate
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.drained = 0
        self.calls: list[str] = []
        self.entered = threading.Event()

    def register(self, address: int, nbytes: int) -> int:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(120), "the test never opened the gate"
        self.registered.append((address, nbytes))
        self.calls.append("register")
        return self.result

    def unregister(self, address: int) -> int:
        self.unregistered.append(address)
        self.calls.append("unregister")
        return 0

    def drain(self) -> None:
        self.drained += 1
        self.calls.append("drain")


def registrar(driver: FakeDriver, mode: PinMode) -> HostRegistrar:
    return HostRegistrar(driver.register, driver.unregister, mode, before_unregister=driver.drain)


def test_async_registration_reports_unpinned_until_it_has_finished():
    gate = threading.Event()
    driver = FakeDriver(gate=gate)
    host = registrar(driver, PinMode.ASYNC)
    buffer = host.allocate(10_000)
    assert host.owns(buffer) and host.is_pinned(buffer) is False
    gate.set()
    assert host.wait(buffer) is True and host.is_pinned(buffer) is True
    assert driver.registered == [(buffer.data_ptr(), 3 * PAGE)]


def test_sync_registration_is_done_on_return():
    driver = FakeDriver()
    host = registrar(driver, PinMode.SYNC)
    assert host.is_pinned(host.allocate(PAGE)) is True


def test_a_failed_registration_leaves_the_buffer_pageable_and_usable():
    driver = FakeDriver(result=2)  # cudaErrorMemoryAllocation
    host = registrar(driver, PinMode.SYNC)
    buffer = host.allocate(PAGE)
    assert host.is_pinned(buffer) is False
    buffer.fill_(1)
    host.free(buffer)
    assert driver.unregistered == [] and driver.drained == 0


def test_off_never_registers():
    driver = FakeDriver()
    host = registrar(driver, PinMode.OFF)
    buffer = host.allocate(PAGE)
    assert host.is_pinned(buffer) is False and driver.registered == []


def test_free_waits_for_a_running_registration_then_drains_and_unregisters_once():
    gate = threading.Event()
    driver = FakeDriver(gate=gate)
    host = registrar(driver, PinMode.ASYNC)
    buffer = host.allocate(PAGE)
    assert driver.entered.wait(120), "registration never started"
    freer = threading.Thread(target=host.free, args=(buffer,))
    freer.start()
    gate.set()
    freer.join(120)
    assert not freer.is_alive()
    assert driver.calls == ["register", "drain", "unregister"]
    assert driver.unregistered == [buffer.data_ptr()]
    host.free(buffer)  # a second free is a no-op
    assert driver.unregistered == [buffer.data_ptr()]
    assert not host.owns(buffer)


def test_free_before_registration_starts_cancels_it():
    blocker, driver = threading.Event(), FakeDriver()
    host = registrar(driver, PinMode.ASYNC)
    # Occupy the registration thread so the next registration is still queued when freed.
    busy = host.allocate(PAGE)
    host._executor().submit(blocker.wait, 120)
    queued = host.allocate(PAGE)
    host.free(queued)
    blocker.set()
    assert host.wait(busy) is True
    assert (queued.data_ptr(), PAGE) not in driver.registered and driver.unregistered == []
    assert not host.owns(queued)


def test_a_buffer_it_did_not_allocate_is_not_its_own():
    host = registrar(FakeDriver(), PinMode.SYNC)
    other = torch.zeros(16, dtype=torch.int8)
    assert not host.owns(other) and host.is_pinned(other) is False
