"""A kvhal plugin for the end-to-end tests: makes host-tier stores or loads fail.

Installed through a real ``kvhal.plugins`` entry point (the dist-info beside
this file, put on the engine's PYTHONPATH). ``KVHAL_TEST_FAULTS`` says what
fails: ``store``, ``load`` or ``store,load``. A failing copy still runs, then
its destination blocks are overwritten with noise and its event raises
TransferError: if kvhal or vLLM used those blocks anyway, outputs would change.
``corrupt_load`` is the negative control that works across processes: loads
succeed, but their destination blocks are overwritten with noise first.
``slow_store`` and ``slow_load`` make copies slow, not wrong: the copy stream
sleeps ``KVHAL_TEST_FAULT_DELAY_S`` seconds (default 1) before the copy reads
its source, so a block rewritten while the copy is in flight is copied wrong.
``KVHAL_TEST_FAULT_RANKS`` (e.g. ``1``) limits every mode to those ranks of
``torch.distributed`` (a tensor-parallel engine's workers; an engine that has
not set up ``torch.distributed`` is rank 0). With ``KVHAL_TEST_FAULTS_FILE``, the
modes are that file's contents, read at every copy: a test switches them between
steps (the runner's ``write_file`` step), so that one engine shows two faults.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import torch.distributed as dist

from kvhal.cpu.streams import CPUEvent, _Marker
from kvhal.errors import TransferError
from kvhal.hookspecs import hookimpl

#: What each injected fault writes to stderr, followed by the mode and ``rank=N``.
INJECTED = "kvhal_test_faults: injected"


def failed_event() -> CPUEvent:
    """A completed CPU-plugin event whose copy failed (the e2e tests run on the CPU plugin)."""
    marker = _Marker(error=TransferError("injected by kvhal_test_faults"))
    marker.done.set()
    event = CPUEvent()
    event._marker = marker
    return event


class FaultInjector:
    def __init__(self) -> None:
        self._modes = {m.strip() for m in os.environ.get("KVHAL_TEST_FAULTS", "").split(",") if m.strip()}
        self._modes_file = os.environ.get("KVHAL_TEST_FAULTS_FILE")
        self.host_buffers: list[tuple[int, int]] = []
        ranks = os.environ.get("KVHAL_TEST_FAULT_RANKS", "")
        self.ranks = {int(r) for r in ranks.split(",") if r.strip()} or None

    @property
    def modes(self) -> set[str]:
        if self._modes_file is None:
            return self._modes
        with open(self._modes_file) as f:
            return {m.strip() for m in f.read().split(",") if m.strip()}

    @staticmethod
    def _rank() -> int:
        # read at copy time: vLLM sets up torch.distributed after plugins are loaded
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _rank_selected(self) -> bool:
        return self.ranks is None or self._rank() in self.ranks

    def _in_host_tier(self, cache) -> bool:
        ptr = cache.storage[0].data_ptr() if cache.storage else cache.layers[0][0].data_ptr()
        return any(start <= ptr < start + size for start, size in self.host_buffers)

    @hookimpl
    def kvhal_tier_backends(self):
        # offered as any third party would: the tests name them in ``tier_backend`` or ``tiers``
        return {FAULTY_DISK: _faulty_disk, RAM_TIER: _ram_tier}

    @hookimpl(wrapper=True)
    def kvhal_allocate_host_buffer(self, nbytes):
        buffer = yield
        self.host_buffers.append((buffer.data_ptr(), buffer.numel()))
        return buffer

    def _delay(self, plan, stream) -> None:
        kind = "store" if self._in_host_tier(plan.dst) else "load" if self._in_host_tier(plan.src) else None
        if kind is not None and f"slow_{kind}" in self.modes and self._rank_selected():
            delay = float(os.environ.get("KVHAL_TEST_FAULT_DELAY_S", "1"))
            stream.submit(lambda: time.sleep(delay))  # runs before the copy, on its stream

    @hookimpl(wrapper=True)
    def kvhal_copy_blocks(self, plan, stream):
        self._delay(plan, stream)
        event = yield
        kind = "store" if self._in_host_tier(plan.dst) else "load" if self._in_host_tier(plan.src) else None
        modes = self.modes
        corrupt = kind == "load" and "corrupt_load" in modes
        if (kind not in modes and not corrupt) or not self._rank_selected():
            return event
        event.synchronize()
        # tests read this line from the engine's log to see which ranks were hit
        mode = "corrupt_load" if corrupt else kind
        print(f"{INJECTED} {mode} rank={self._rank()}", file=sys.stderr, flush=True)
        _, dst, sizes = plan.descriptors
        for address, size in zip(dst.tolist(), sizes.tolist(), strict=True):
            ctypes.memset(address, 0x7F, size)
        return event if corrupt else failed_event()


# -- the tier below host memory --------------------------------------------------------------

#: ``tier_backend`` the tests name to get the disk tier with faults (``KVHAL_TEST_FAULTS``):
#: ``disk_full`` (payload writes fail with ENOSPC), ``disk_eio`` (payload reads fail with EIO),
#: ``disk_stall`` (payload reads take ``KVHAL_TEST_STALL_S`` seconds, default 2, then succeed),
#: ``torn_write`` (after ``KVHAL_TEST_TORN_AFTER`` payload writes, each writes half its bytes
#: and hangs: kill the engine then, and its slots hold torn blocks under their old records).
FAULTY_DISK = "disk-faults"


def _faulty_disk(spec):
    import errno

    from kvhal.tiers.disk import DiskTier
    from kvhal.tiers.disk.io import aligned_buffer

    modes = {m.strip() for m in os.environ.get("KVHAL_TEST_FAULTS", "").split(",")}
    torn_after = int(os.environ.get("KVHAL_TEST_TORN_AFTER", "0"))

    class FaultyDisk(DiskTier):
        writes = 0

        def _pwritev(self, fd, buffers, offset):
            if fd != self._index_fd:
                if "disk_full" in modes:
                    print(f"{INJECTED} disk_full", file=sys.stderr, flush=True)
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
                if "torn_write" in modes:
                    FaultyDisk.writes += 1
                    if FaultyDisk.writes > torn_after:
                        whole = b"".join(bytes(b) for b in buffers)
                        half = max(4096, len(whole) // 2 // 4096 * 4096)
                        piece = aligned_buffer(half)  # aligned: the file may be open with O_DIRECT
                        piece[:] = whole[:half]
                        super()._pwritev(fd, [piece], offset)
                        print(f"{INJECTED} torn_write", file=sys.stderr, flush=True)
                        time.sleep(3600)  # the test kills the engine meanwhile
            super()._pwritev(fd, buffers, offset)

        def _preadv(self, fd, buffers, offset):
            if fd != self._index_fd and "disk_stall" in modes:
                print(f"{INJECTED} disk_stall", file=sys.stderr, flush=True)
                time.sleep(float(os.environ.get("KVHAL_TEST_STALL_S", "2")))
            if fd != self._index_fd and "disk_eio" in modes:
                print(f"{INJECTED} disk_eio", file=sys.stderr, flush=True)
                raise OSError(errno.EIO, "Input/output error (injected)")
            super()._preadv(fd, buffers, offset)

    return FaultyDisk(spec)


# -- a tier of the test's own, in the engine's memory -------------------------------------------

#: ``backend`` the tests name to stack a tier that is neither the disk tier nor a store: slots
#: of ``options.bytes_to_use`` bytes in this process's memory (the engine core's, where the
#: scheduler and its one worker both run: the index and io roles share them). Its reads are
#: verified by key. ``ram_garbage`` in ``KVHAL_TEST_FAULTS`` makes every read deliver zeros and
#: say it is fine: the negative control that shows the tier's bytes are what the engine uses.
RAM_TIER = "test-ram"
_RAM: dict[bytes, dict[int, tuple[bytes, bytes]]] = {}


def _ram_tier(spec):
    from concurrent.futures import Future

    from kvhal.tiers.backend import MISSING, OK, TierBackend

    def done(result):
        future = Future()
        future.set_result(result)
        return future

    class RamTier(TierBackend):
        def __init__(self) -> None:
            self.num_slots = int(spec.options["bytes_to_use"]) // spec.slot_bytes
            self.slots = _RAM.setdefault(spec.digest(), {})
            self.garbage = "ram_garbage" in os.environ.get("KVHAL_TEST_FAULTS", "")

        def recover(self, progress=None):
            return [], []  # a new process's memory holds nothing

        def write(self, slots, keys, buffers):
            for slot, key, buffer in zip(slots, keys, buffers, strict=True):
                self.slots[slot] = (bytes(key), bytes(buffer))
            return done([True] * len(slots))

        def read(self, slots, keys, buffers):
            outcomes = []
            for slot, key, buffer in zip(slots, keys, buffers, strict=True):
                held = self.slots.get(slot)
                if held is None or held[0] != key:
                    outcomes.append(MISSING)
                    continue
                memoryview(buffer).cast("B")[:] = bytes(len(held[1])) if self.garbage else held[1]
                outcomes.append(OK)
            return done(outcomes)

        def close(self) -> None:
            pass

    return RamTier()
