"""What the conformance suite found in the reference CPU plugin, kept fixed."""

from __future__ import annotations

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from kvhal.cpu import memory


def test_memory_at_the_address_of_a_dropped_buffer_is_not_pinned(monkeypatch) -> None:
    """pinned.truthful: a locked buffer dropped without kvhal_free_host_buffer leaves its entry
    behind; a plain tensor later placed at that address must not read as pinned."""
    plain = torch.zeros(1 << 16, dtype=torch.int8)
    ghost = torch.zeros(1 << 16, dtype=torch.int8)
    stale = StorageWeakRef(ghost.untyped_storage())
    del ghost
    gc.collect()
    assert stale.expired()
    monkeypatch.setitem(
        memory._locked, plain.data_ptr(), (plain.numel(), stale)
    )  # what a dropped buffer leaves
    assert not memory.is_locked(plain)
    memory.release(plain)  # and it is not unlocked on the plain tensor's behalf
    assert memory._locked.get(plain.data_ptr()) is not None


def test_a_locked_buffer_reads_locked_until_released() -> None:
    policy = memory.LockPolicy(True, "test")
    try:
        buffer = memory.allocate(1 << 16, policy)
    except OSError:  # this machine cannot lock 64 KiB: nothing to check here
        return
    assert memory.is_locked(buffer)
    assert not memory.is_locked(torch.zeros(1 << 16, dtype=torch.int8))
    memory.release(buffer)
    assert not memory.is_locked(buffer)
