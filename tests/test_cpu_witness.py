"""The mlock witness: the kernel's smaps, not the CPU plugin's bookkeeping, says what is locked."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch

from kvhal.cpu import memory, witness
from kvhal.cpu.plugin import CPUPlugin
from kvhal.cpu.witness import Mapping, MlockWitness, judge, read_mappings
from kvhal.witness import Witnessed

MiB = 1 << 20
KB = 1024
LOCKABLE = memory.lock_policy()


def locked(start: int, end: int) -> Mapping:
    return Mapping(start, end, end - start, True)


@pytest.mark.parametrize(
    ("mappings", "pinned", "unpinned_at"),
    [
        ([locked(0x1000, 0x5000)], True, None),
        # mlock splits a mapping at the range's ends; adjacent locked mappings cover it
        ([locked(0x0, 0x2000), locked(0x2000, 0x6000)], True, None),
        ([], False, 0),  # nothing mapped
        ([locked(0x1000, 0x3000)], False, 0x2000),  # the mapping ends inside the range
        ([locked(0x1000, 0x2000), locked(0x3000, 0x5000)], False, 0x1000),  # a hole
        ([Mapping(0x1000, 0x5000, 0, False)], False, 0),  # pageable
        ([Mapping(0x1000, 0x5000, 0x1000, True)], False, 0),  # VM_LOCKED, pages not all resident
    ],
)
def test_judge_locks_a_range_only_when_locked_mappings_cover_every_byte(mappings, pinned, unpinned_at):
    seen = judge(0x1000, 0x4000, mappings)
    assert (seen.pinned, seen.unpinned_at) == (pinned, unpinned_at)


def test_smaps_is_parsed_for_the_mappings_overlapping_the_range(tmp_path: Path):
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000002000 rw-p 00000000 00:00 0 \n"
        "Size:                  8 kB\nLocked:                8 kB\nVmFlags: rd wr mr mw me lo ac \n"
        "7f0000002000-7f0000004000 rw-p 00000000 00:00 0 \n"
        "Size:                  8 kB\nLocked:                0 kB\nVmFlags: rd wr mr mw me ac \n"
        "7f0000010000-7f0000011000 r--p 00000000 08:01 42 /usr/lib/libc.so.6\n"
        "Size:                  4 kB\nLocked:                0 kB\nVmFlags: rd mr mw me \n"
    )
    found = read_mappings(0x7F0000001000, 0x2000, str(smaps))
    assert found == [
        Mapping(0x7F0000000000, 0x7F0000002000, 8 * KB, True),
        Mapping(0x7F0000002000, 0x7F0000004000, 0, False),
    ]
    seen = MlockWitness(str(smaps)).witness(0x7F0000001000, 0x2000)
    assert seen == Witnessed(
        False,
        0x1000,
        f"{witness.SMAPS}: the byte at offset 4096 is in a mapping with no VmFlags lo, Locked 0 kB of 8 kB",
    )


def test_unavailable_without_smaps(tmp_path: Path):
    assert MlockWitness().unavailable() is None
    reason = MlockWitness(str(tmp_path / "missing")).unavailable()
    assert reason is not None and "cannot be read" in reason


@pytest.mark.skipif(not LOCKABLE.lock, reason=f"this process cannot lock host tiers: {LOCKABLE.reason}")
def test_the_kernel_sees_what_the_cpu_plugin_locks_and_not_what_it_merely_books():
    seer = MlockWitness()
    buffer = memory.allocate(3 * MiB + 5, LOCKABLE)
    assert seer.witness(buffer.data_ptr(), buffer.numel()).pinned
    memory.release(buffer)  # munlock: the kernel sees it at once
    assert not seer.witness(buffer.data_ptr(), buffer.numel()).pinned
    # The negative control: booked as locked, never locked. The plugin says pinned; the kernel not.
    # 64 MiB: above glibc's largest mmap threshold, so fresh pages, never heap memory that an
    # earlier test's buffer, dropped without release(), left locked (a CI run reused such memory)
    plain = memory.allocate(64 * MiB + 5, memory.LockPolicy(False, "not locked"))
    with memory._lock:
        memory._locked[plain.data_ptr()] = (plain.numel(), memory.StorageWeakRef(plain.untyped_storage()))
    assert memory.is_locked(plain)
    seen = seer.witness(plain.data_ptr(), plain.numel())
    assert not seen.pinned and seen.unpinned_at == 0
    memory.release(plain)


def test_a_plain_tensor_is_not_locked():
    plain = torch.zeros(MiB, dtype=torch.uint8)
    assert not MlockWitness().witness(plain.data_ptr(), MiB).pinned


@pytest.mark.parametrize(
    ("limit", "cap", "expected"),
    [(8 * MiB, False, 8 * MiB), (8 * MiB, True, None), (resource.RLIM_INFINITY, False, None)],
)
def test_the_witness_states_the_memlock_limit(monkeypatch, limit, cap, expected):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limit, limit))
    monkeypatch.setattr(witness, "_has_cap_ipc_lock", lambda: cap)
    assert MlockWitness().size_limit() == expected


def test_the_cpu_plugin_offers_the_mlock_witness_for_cpu():
    (offered,) = CPUPlugin().kvhal_pinning_witnesses()
    assert isinstance(offered, MlockWitness) and offered.device_type == "cpu"


def test_a_witnessed_range_names_its_first_unpinned_byte_or_none():
    with pytest.raises(ValueError, match="names the offset of its first unpinned byte"):
        Witnessed(False, None, "")
    with pytest.raises(ValueError):
        Witnessed(True, 0, "")
