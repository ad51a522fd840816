"""Host buffers: registered before they are returned, in bounded chunks, rolled back on failure,
drained before release whatever their pin state."""

from __future__ import annotations

import gc

import pytest
import torch

from kvhal.accel.host_buffers import PinMode, pin_mode
from kvhal_cuda.host_memory import MAX_REGISTER_CHUNK, PAGE, HostRegistrar, map_zeroed, registration_chunks

GiB = 1 << 30


@pytest.mark.parametrize(
    "value, mode",
    [(None, PinMode.SYNC), ("", PinMode.SYNC), ("SYNC", PinMode.SYNC), (" off ", PinMode.OFF)],
)
def test_pin_mode_from_the_environment(value, mode):
    assert pin_mode(value) is mode


def test_async_is_a_deprecated_alias_of_sync():
    with pytest.warns(FutureWarning, match="KVHAL_PIN_HOST=async is deprecated and means sync"):
        assert pin_mode(" Async ") is PinMode.SYNC


def test_there_is_no_background_mode():
    assert {m.value for m in PinMode} == {"sync", "off"}


def test_an_unknown_pin_mode_is_an_error():
    with pytest.raises(ValueError, match="KVHAL_PIN_HOST='later' is not one of async, sync, off"):
        pin_mode("later")


@pytest.mark.parametrize("nbytes", [1, PAGE, 3 * PAGE + 17])
def test_mapped_buffers_are_zeroed_page_aligned_and_exact(nbytes):
    buffer = map_zeroed(nbytes)
    assert buffer.numel() == nbytes and buffer.dtype == torch.int8
    assert buffer.data_ptr() % PAGE == 0
    assert int(buffer.abs().sum()) == 0
    buffer.fill_(7)  # writable
    assert int(buffer[-1]) == 7


# -- chunk boundaries (a pure function) ------------------------------------------------


def check_cover(chunks, nbytes, granule, cap):
    """The chunks tile [0, nbytes) in order; each but the last ends on a page and a granule
    boundary and stays within the cap (unless one granule alone exceeds it)."""
    offset = 0
    for start, size in chunks:
        assert start == offset and size > 0
        offset += size
    assert offset == nbytes
    for start, size in chunks[:-1]:
        end = start + size
        assert end % PAGE == 0 and end % granule == 0
        assert size <= max(cap, granule * PAGE)


def test_a_buffer_under_the_cap_is_one_registration():
    assert registration_chunks(3 * PAGE) == [(0, 3 * PAGE)]
    assert registration_chunks(MAX_REGISTER_CHUNK) == [(0, MAX_REGISTER_CHUNK)]


def test_large_buffers_are_cut_at_64_gib():
    assert 64 * GiB == MAX_REGISTER_CHUNK
    chunks = registration_chunks(130 * GiB + 5 * PAGE)
    assert chunks == [(0, 64 * GiB), (64 * GiB, 64 * GiB), (128 * GiB, 2 * GiB + 5 * PAGE)]
    check_cover(chunks, 130 * GiB + 5 * PAGE, PAGE, MAX_REGISTER_CHUNK)


def test_600_gb_is_registered_in_chunks_all_under_512_gib():
    # vLLM #51080: one registration of >= 512 GiB fails on recent drivers.
    chunks = registration_chunks(600_000_000_000)
    assert len(chunks) == 9 and max(size for _, size in chunks) == 64 * GiB
    check_cover(chunks, 600_000_000_000, PAGE, MAX_REGISTER_CHUNK)


@pytest.mark.parametrize("slot", [6000, 64 << 10, 40 * 2 * 16 * 8 * 3])
def test_chunks_end_on_slot_and_page_boundaries(slot):
    nbytes = 200 * GiB + 12_345
    chunks = registration_chunks(nbytes, granule=slot)
    assert len(chunks) == 4
    check_cover(chunks, nbytes, slot, MAX_REGISTER_CHUNK)


def test_a_slot_larger_than_the_cap_is_registered_whole():
    assert registration_chunks(7 * PAGE, granule=3 * PAGE, max_chunk=2 * PAGE) == [
        (0, 3 * PAGE),
        (3 * PAGE, 3 * PAGE),
        (6 * PAGE, PAGE),
    ]


@pytest.mark.parametrize("args", [(0,), (PAGE, 0), (PAGE, PAGE, 0), (-1,)])
def test_chunking_refuses_non_positive_sizes(args):
    with pytest.raises(ValueError, match="must be positive"):
        registration_chunks(*args)


# -- the registrar ------------------------------------------------------------------------


class FakeDriver:
    """Records register/unregister/drain in order; fails the registrations listed in ``fail_calls``."""

    def __init__(self, fail_calls: frozenset[int] = frozenset(), code: int = 2) -> None:
        self.fail_calls, self.code = fail_calls, code
        self.calls: list[tuple] = []

    def register(self, address: int, nbytes: int) -> int:
        call = sum(1 for c in self.calls if c[0] == "register")
        self.calls.append(("register", address, nbytes))
        return self.code if call in self.fail_calls else 0

    def unregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        return 0

    def drain(self) -> None:
        self.calls.append(("drain",))


def registrar(driver: FakeDriver, mode: PinMode = PinMode.SYNC, max_chunk: int = 4 * PAGE) -> HostRegistrar:
    return HostRegistrar(driver.register, driver.unregister, mode, driver.drain, max_chunk=max_chunk)


def test_registration_is_done_on_return_in_chunks():
    driver = FakeDriver()
    host = registrar(driver)
    buffer = host.allocate(10 * PAGE - 100)
    base = buffer.data_ptr()
    assert host.is_pinned(buffer) is True and host.wait(buffer) is True
    assert driver.calls == [
        ("register", base, 4 * PAGE),
        ("register", base + 4 * PAGE, 4 * PAGE),
        ("register", base + 8 * PAGE, 2 * PAGE),
    ]
    assert host.boundaries().tolist() == [base + 4 * PAGE, base + 8 * PAGE]


def test_a_failing_chunk_rolls_back_the_chunks_before_it_and_leaves_the_buffer_pageable():
    driver = FakeDriver(fail_calls=frozenset({2}))
    host = registrar(driver)
    buffer = host.allocate(12 * PAGE)
    base = buffer.data_ptr()
    assert host.is_pinned(buffer) is False
    assert driver.calls == [
        ("register", base, 4 * PAGE),
        ("register", base + 4 * PAGE, 4 * PAGE),
        ("register", base + 8 * PAGE, 4 * PAGE),
        ("unregister", base + 4 * PAGE),  # newest first
        ("unregister", base),
    ]
    assert host.boundaries().tolist() == []
    buffer.fill_(1)  # still usable memory
    driver.calls.clear()
    host.free(buffer)
    assert driver.calls == [("drain",)], "nothing left registered to undo"


def test_a_buffer_whose_only_chunk_fails_is_pageable():
    driver = FakeDriver(fail_calls=frozenset({0}))
    host = registrar(driver, max_chunk=64 * PAGE)
    buffer = host.allocate(PAGE)
    assert host.is_pinned(buffer) is False
    assert [c[0] for c in driver.calls] == ["register"]


def test_off_never_registers():
    driver = FakeDriver()
    host = registrar(driver, PinMode.OFF)
    buffer = host.allocate(PAGE)
    assert host.is_pinned(buffer) is False and driver.calls == []


@pytest.mark.parametrize(
    "mode, fail_calls, unregistered",
    [
        (PinMode.SYNC, frozenset(), 3),  # pinned
        (PinMode.SYNC, frozenset({1}), 0),  # registration failed (rolled back)
        (PinMode.OFF, frozenset(), 0),  # never pinned
    ],
    ids=["pinned", "registration-failed", "off"],
)
def test_free_drains_before_anything_else_whatever_the_pin_state(mode, fail_calls, unregistered):
    driver = FakeDriver(fail_calls=fail_calls)
    host = registrar(driver, mode)
    buffer = host.allocate(9 * PAGE)
    driver.calls.clear()
    host.free(buffer)
    assert driver.calls[0] == ("drain",), "copies that may read the buffer are drained first"
    assert [c[0] for c in driver.calls[1:]] == ["unregister"] * unregistered
    assert not host.owns(buffer) and host.boundaries().tolist() == []


def test_every_chunk_is_unregistered_at_its_own_address():
    driver = FakeDriver()
    host = registrar(driver)
    buffer = host.allocate(9 * PAGE)
    base = buffer.data_ptr()
    driver.calls.clear()
    host.free(buffer)
    assert driver.calls == [
        ("drain",),
        ("unregister", base),
        ("unregister", base + 4 * PAGE),
        ("unregister", base + 8 * PAGE),
    ]


def test_a_second_free_and_a_foreign_buffer_are_left_alone():
    driver = FakeDriver()
    host = registrar(driver)
    buffer = host.allocate(PAGE)
    host.free(buffer)
    calls = list(driver.calls)
    host.free(buffer)
    other = torch.zeros(16, dtype=torch.int8)
    host.free(other)
    assert driver.calls == calls
    assert not host.owns(other) and host.is_pinned(other) is False


def test_boundaries_cover_only_live_multi_chunk_buffers():
    host = registrar(FakeDriver())
    small = host.allocate(2 * PAGE)
    big = host.allocate(8 * PAGE)
    other = host.allocate(5 * PAGE)
    assert host.boundaries().tolist() == sorted([big.data_ptr() + 4 * PAGE, other.data_ptr() + 4 * PAGE])
    host.free(big)
    assert host.boundaries().tolist() == [other.data_ptr() + 4 * PAGE]
    host.free(small)
    host.free(other)
    assert host.boundaries().tolist() == []


def test_buffers_never_freed_are_unregistered_when_the_registrar_goes():
    """A dropped plugin unmaps its buffers; each registration is undone first (drained
    first too), or the next mapping at that address cannot be registered (error 712)."""
    driver = FakeDriver()
    host = registrar(driver)
    kept = host.allocate(6 * PAGE)
    freed = host.allocate(PAGE)
    base = kept.data_ptr()
    host.free(freed)
    driver.calls.clear()
    del host
    gc.collect()
    assert driver.calls == [("drain",), ("unregister", base), ("unregister", base + 4 * PAGE)]
    kept.fill_(1)  # the caller's view still holds the mapping


def test_a_registrar_with_nothing_registered_leaves_the_driver_alone():
    driver = FakeDriver()
    host = registrar(driver, PinMode.OFF)
    host.allocate(PAGE)
    del host
    gc.collect()
    assert driver.calls == []
