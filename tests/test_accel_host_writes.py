"""Loads may let their source be read early only when no unfinished store writes it (vLLM #39306)."""

from __future__ import annotations

import pytest

from kvhal.accel.descriptors import Descriptors
from kvhal.accel.host_writes import PendingHostWrites, source_may_be_read_early
from kvhal.copyplan import Direction


def store_into(host_start: int, nbytes: int) -> Descriptors:
    return Descriptors.from_lists([10**9], [host_start], [nbytes])


def load_from(host_start: int, nbytes: int) -> Descriptors:
    return Descriptors.from_lists([host_start], [10**9], [nbytes])


def test_stores_and_device_copies_never_read_early():
    pending = PendingHostWrites()
    for direction in (Direction.D2H, Direction.D2D, Direction.H2H):
        assert not source_may_be_read_early(direction, load_from(0, 64), pending)


def test_a_load_reads_early_only_when_no_unfinished_store_writes_its_source():
    pending = PendingHostWrites()
    done = {"flag": False}
    pending.add(store_into(4096, 4096), lambda: done["flag"])
    assert not source_may_be_read_early(Direction.H2D, load_from(6000, 100), pending)
    assert source_may_be_read_early(Direction.H2D, load_from(8192, 100), pending)  # just after it
    done["flag"] = True
    assert source_may_be_read_early(Direction.H2D, load_from(6000, 100), pending)
    assert len(pending) == 0


def test_a_store_whose_completion_cannot_be_queried_stays_pending():
    pending = PendingHostWrites()

    def broken() -> bool:
        raise RuntimeError("device error")

    pending.add(store_into(0, 10), broken)
    assert pending.may_be_written(load_from(5, 1))
    assert len(pending) == 1


@pytest.mark.parametrize("offset, expected", [(0, True), (99, True), (100, False)])
def test_overlap_is_checked_per_byte_range(offset, expected):
    pending = PendingHostWrites()
    pending.add(Descriptors.from_lists([1, 2], [0, 1000], [100, 100]), lambda: False)
    assert pending.may_be_written(load_from(offset, 1)) is expected


def test_finished_stores_are_forgotten_even_without_loads():
    """Only stores for a long time: the list of pending ranges must not grow without bound."""
    pending = PendingHostWrites()
    for start in range(100):
        pending.add(
            Descriptors.from_lists([0], [start * 64], [64]),
            lambda: True,  # every store finished at once
        )
    assert len(pending._pending) <= 1
