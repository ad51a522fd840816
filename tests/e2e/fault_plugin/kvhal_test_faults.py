"""A kvhal plugin for the end-to-end tests: makes host-tier stores or loads fail.

Installed through a real ``kvhal.plugins`` entry point (the dist-info beside
this file, put on the engine's PYTHONPATH). ``KVHAL_TEST_FAULTS`` says what
fails: ``store``, ``load`` or ``store,load``. A failing copy still runs, then
its destination blocks are overwritten with noise and its event raises
TransferError: if kvhal or vLLM used those blocks anyway, outputs would change.
``corrupt_load`` is the negative control that works across processes: loads
succeed, but their destination blocks are overwritten with noise first.
"""

from __future__ import annotations

import ctypes
import os

from kvhal.cpu.streams import CPUEvent, _Marker
from kvhal.errors import TransferError
from kvhal.hookspecs import hookimpl


def failed_event() -> CPUEvent:
    """A completed CPU-plugin event whose copy failed (the e2e tests run on the CPU plugin)."""
    marker = _Marker(error=TransferError("injected by kvhal_test_faults"))
    marker.done.set()
    event = CPUEvent()
    event._marker = marker
    return event


class FaultInjector:
    def __init__(self) -> None:
        self.modes = {m.strip() for m in os.environ.get("KVHAL_TEST_FAULTS", "").split(",") if m.strip()}
        self.host_buffers: list[tuple[int, int]] = []

    def _in_host_tier(self, cache) -> bool:
        ptr = cache.storage[0].data_ptr() if cache.storage else cache.layers[0][0].data_ptr()
        return any(start <= ptr < start + size for start, size in self.host_buffers)

    @hookimpl(wrapper=True)
    def kvhal_allocate_host_buffer(self, nbytes):
        buffer = yield
        self.host_buffers.append((buffer.data_ptr(), buffer.numel()))
        return buffer

    @hookimpl(wrapper=True)
    def kvhal_copy_blocks(self, plan, stream):
        event = yield
        kind = "store" if self._in_host_tier(plan.dst) else "load" if self._in_host_tier(plan.src) else None
        corrupt = kind == "load" and "corrupt_load" in self.modes
        if kind not in self.modes and not corrupt:
            return event
        event.synchronize()
        _, dst, sizes = plan.descriptors
        for address, size in zip(dst.tolist(), sizes.tolist(), strict=True):
            ctypes.memset(address, 0x7F, size)
        return event if corrupt else failed_event()
