"""Ascend host buffers: exact-size memory page-locked through AscendCL calls (fakes here, by construction)."""

from __future__ import annotations

import ctypes
import gc
import logging
import threading

import pytest

from kvhal.testing.accel import FakeStreamModule
from kvhal_npu.facts import NpuFacts
from kvhal_npu.host_memory import (
    MALLOC_HOST,
    PAGE,
    REGISTER,
    AclHost,
    PinnedHostBuffers,
    choose_pin_routes,
    kernel_registers_pageable,
    load_acl,
)
from kvhal_npu.plugin import NPUPlugin

NEW_KERNEL, OLD_KERNEL = "6.6.0-28.0.0.34.oe2403.aarch64", "5.10.0-60.18.0.50.oe2203.aarch64"


class FakeAcl:
    """AscendCL's host-memory calls over ctypes buffers; every call is logged in ``events``."""

    def __init__(self, register_code: int = 0, malloc_code: int = 0, garbage: int = 0x5A) -> None:
        self.register_code, self.malloc_code, self.garbage = register_code, malloc_code, garbage
        self.events: list[tuple] = []
        self.threads: list[threading.Thread] = []
        self.memory: dict[int, ctypes.Array] = {}

    def register_pinned(self, ptr: int, size: int) -> int:
        self.events.append(("register", ptr, size))
        self.threads.append(threading.current_thread())
        return self.register_code

    def unregister(self, ptr: int) -> int:
        self.events.append(("unregister", ptr))
        return 0

    def malloc_host(self, size: int) -> tuple[int, int]:
        self.events.append(("malloc", size))
        if self.malloc_code:
            return self.malloc_code, 0
        block = (ctypes.c_uint8 * (size + 128))()
        ctypes.memset(block, self.garbage, size + 128)  # the runtime does not zero it
        ptr = ctypes.addressof(block) + (-ctypes.addressof(block)) % 64  # 64-byte aligned only
        if ptr % PAGE == 0:
            ptr += 64
        self.memory[ptr] = block
        return 0, ptr

    def free_host(self, ptr: int) -> int:
        self.events.append(("free_host", ptr))
        return 0

    def host(self, v2: bool = True, malloc: bool = True) -> AclHost:
        return AclHost(
            register_pinned=self.register_pinned if v2 else None,
            unregister=self.unregister if v2 else None,
            malloc_host=self.malloc_host if malloc else None,
            free_host=self.free_host if malloc else None,
            missing="" if v2 else "libascendcl.so has no aclrtHostRegisterV2",
        )


def buffers(acl: FakeAcl, kernel: str = NEW_KERNEL, **kw) -> tuple[PinnedHostBuffers, list]:
    log: list = []

    def drain() -> None:
        log.append("drain")
        acl.events.append(("drain",))

    return PinnedHostBuffers(drain=drain, acl=acl.host(**kw), kernel_release=kernel), log


@pytest.mark.parametrize(
    ("release", "allowed"),
    [(NEW_KERNEL, True), ("5.11.0", True), (OLD_KERNEL, False), ("4.19.90-vhulk", False), ("weird", False)],
)
def test_pageable_registration_needs_a_kernel_newer_than_5_10(release, allowed):
    assert kernel_registers_pageable(release) is allowed


def test_routes_follow_the_calls_present_and_the_kernel():
    acl = FakeAcl()
    both = choose_pin_routes(acl.host(), NEW_KERNEL)
    assert both == ((MALLOC_HOST, REGISTER), f"{MALLOC_HOST}, then {REGISTER}")
    routes, note = choose_pin_routes(acl.host(), OLD_KERNEL)
    assert routes == (MALLOC_HOST,) and f"{REGISTER} not used: kernel {OLD_KERNEL} is 5.10 or older" in note
    routes, note = choose_pin_routes(acl.host(malloc=False), NEW_KERNEL)
    assert routes == (REGISTER,)
    routes, note = choose_pin_routes(acl.host(v2=False), NEW_KERNEL)
    assert routes == (MALLOC_HOST,) and "no aclrtHostRegisterV2" in note
    routes, note = choose_pin_routes(AclHost(missing="libascendcl.so could not be loaded"), NEW_KERNEL)
    assert routes == () and note == "no AscendCL pinning call (libascendcl.so could not be loaded)"


def test_a_registered_buffer_is_kernel_zeroed_exact_size_and_registered_before_returning():
    acl = FakeAcl()
    host, _ = buffers(acl, malloc=False)
    nbytes = 100 * PAGE + 1  # torch_npu's caching allocator would pin 128 pages
    buffer = host.allocate(nbytes)
    assert buffer.numel() == nbytes and buffer.data_ptr() % PAGE == 0 and not buffer.any()
    assert acl.events == [("register", buffer.data_ptr(), 101 * PAGE)]
    assert acl.threads == [threading.current_thread()], "registration runs on the calling thread"
    assert host.is_pinned(buffer) is True
    buffer[-1] = 7  # the whole size is usable memory
    assert int(buffer[-1]) == 7


def test_free_drains_before_unregistering():
    acl = FakeAcl()
    host, _ = buffers(acl, malloc=False)
    buffer = host.allocate(5000)
    ptr = buffer.data_ptr()
    host.free(buffer)
    assert acl.events[1:] == [("drain",), ("unregister", ptr)]


def test_when_every_route_fails_the_buffer_is_pageable_and_each_call_is_named(caplog):
    acl = FakeAcl(malloc_code=207001, register_code=107000)
    host, drained = buffers(acl)
    with caplog.at_level(logging.WARNING, logger="kvhal_npu.host_memory"):
        buffer = host.allocate(5000)
    assert "aclrtMallocHost(9096 bytes) failed: aclError 207001 (ACL_ERROR_RT_MEMORY_ALLOC" in caplog.text
    assert "aclrtHostRegisterV2(8192 bytes, ACL_HOST_REG_PINNED) failed: aclError 107000" in caplog.text
    assert "left pageable" in caplog.text
    assert host.is_pinned(buffer) is False and not buffer.any() and buffer.data_ptr() % PAGE == 0
    host.free(buffer)
    assert drained == ["drain"], "free drains whatever the pin state"
    assert not any(e[0] in ("unregister", "free_host") for e in acl.events), "nothing pinned, nothing to undo"


def test_a_failed_malloc_host_falls_back_to_registering_mmap_memory(caplog):
    acl = FakeAcl(malloc_code=207001)
    host, _ = buffers(acl)
    with caplog.at_level(logging.WARNING, logger="kvhal_npu.host_memory"):
        buffer = host.allocate(5000)
    assert [e[0] for e in acl.events] == ["malloc", "register"] and "aclrtMallocHost" in caplog.text
    assert host.is_pinned(buffer) is True and "left pageable" not in caplog.text
    host.free(buffer)
    assert acl.events[-2:] == [("drain",), ("unregister", buffer.data_ptr())]


def test_malloc_host_memory_is_zeroed_aligned_and_freed_after_the_last_view():
    acl = FakeAcl()
    host, _ = buffers(acl)
    buffer = host.allocate(5000)
    ((_, asked),) = acl.events
    assert asked == 5000 + PAGE, "exact size plus one page to align, no power-of-two rounding"
    (ptr,) = acl.memory
    raw = bytes(acl.memory[ptr])
    assert buffer.data_ptr() % PAGE == 0 and ptr <= buffer.data_ptr() < ptr + PAGE
    assert not buffer.any(), "aclrtMallocHost memory is not initialised: the plugin zeroes it"
    assert raw.count(0) >= 5000 + PAGE - 64 and raw[-1] == acl.garbage, "it wrote inside the allocation only"
    assert host.is_pinned(buffer) is True
    view = buffer[100:200]
    host.free(buffer)
    del buffer
    gc.collect()
    assert acl.events[-1] == ("drain",), "a live view keeps the memory"
    del view
    gc.collect()
    assert acl.events[-1] == ("free_host", ptr)


def test_the_garbage_check_can_fail():
    """Negative control: memory from the fake is not zero until the plugin zeroes it."""
    acl = FakeAcl()
    _, ptr = acl.malloc_host(64)
    assert bytes(acl.memory[ptr])[:64] == bytes([acl.garbage]) * 64


def test_on_an_old_kernel_a_failed_malloc_host_is_not_followed_by_registration():
    acl = FakeAcl(malloc_code=207001)
    host, _ = buffers(acl, kernel=OLD_KERNEL)
    buffer = host.allocate(5000)
    assert [e[0] for e in acl.events] == ["malloc"] and host.is_pinned(buffer) is False


def test_without_ascendcl_buffers_are_pageable_with_one_warning(caplog):
    absent = AclHost(missing="libascendcl.so could not be loaded")
    host = PinnedHostBuffers(acl=absent, kernel_release=NEW_KERNEL)
    with caplog.at_level(logging.WARNING, logger="kvhal_npu.host_memory"):
        first, second = host.allocate(10), host.allocate(10)
    assert caplog.text.count("stay pageable") == 1 and "libascendcl.so" in caplog.text
    assert not host.is_pinned(first) and not host.is_pinned(second)


def test_pinning_off_calls_nothing():
    acl = FakeAcl()
    host = PinnedHostBuffers(pin=False, acl=acl.host(), kernel_release=NEW_KERNEL)
    buffer = host.allocate(5000)
    assert acl.events == [] and host.is_pinned(buffer) is False and buffer.data_ptr() % PAGE == 0


def test_this_machine_has_no_ascendcl():
    acl = load_acl()
    assert acl.register_pinned is None and acl.malloc_host is None and "libascendcl.so" in acl.missing


def test_a_library_without_the_calls_reports_each_missing_symbol():
    acl = load_acl("libc.so.6")
    assert (acl.register_pinned, acl.unregister, acl.malloc_host, acl.free_host) == (None,) * 4
    for name in ("aclrtHostRegisterV2", "aclrtHostUnregister", "aclrtMallocHost", "aclrtFreeHost"):
        assert name in acl.missing


def test_the_plugin_hooks_pin_through_the_given_calls_and_drain_on_free(monkeypatch):
    monkeypatch.setenv("KVHAL_PIN_HOST", "sync")
    acl, module = FakeAcl(), FakeStreamModule()
    facts = NpuFacts("2.10.0", True, "2.10.0.post4", device_count=1, ascend_op=True, pin_routes=(REGISTER,))
    plugin = NPUPlugin(facts=facts, stream_module=module, acl=acl.host(malloc=False))
    plugin.host_buffers()._kernel = NEW_KERNEL  # the route is chosen at the first allocation
    buffer = plugin.kvhal_allocate_host_buffer(nbytes=3 * PAGE)
    assert plugin.kvhal_host_buffer_is_pinned(buffer=buffer) is True
    assert acl.events == [("register", buffer.data_ptr(), 3 * PAGE)]
    plugin.kvhal_free_host_buffer(buffer=buffer)
    assert module.log[-1][0] == "device_synchronize" and acl.events[-1] == ("unregister", buffer.data_ptr())
