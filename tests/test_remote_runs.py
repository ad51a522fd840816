"""Runs of blocks as one value (:mod:`kvhal.tiers.remote.runs`): how a call's keys split into
objects, and how a lookup finds the held prefix from runs and blocks in one round trip."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvhal.tiers.remote.run_search import ROUND
from kvhal.tiers.remote.runs import MAX_RUN_BLOCKS, held_blocks, pieces, run_blocks_for


def test_run_blocks_reach_a_mebibyte_in_powers_of_two():
    assert run_blocks_for(192 * 1024 + 96) == 8  # the chat bench's 32-token blocks
    assert run_blocks_for(512 * 1024) == 2
    assert run_blocks_for(1 << 20) == 1
    assert run_blocks_for(4 << 20) == 1
    assert run_blocks_for(100) == MAX_RUN_BLOCKS
    with pytest.raises(ValueError, match="value_bytes"):
        run_blocks_for(0)


def test_a_write_stores_whole_aligned_runs_and_the_rest_alone():
    parts = pieces(list(range(3, 22)), 4, tails=False)  # blocks 3..21
    runs = [(p.indices.start, p.indices.stop) for p in parts if p.run]
    assert runs == [(1, 5), (5, 9), (9, 13), (13, 17)]  # blocks 4-7, 8-11, 12-15, 16-19
    assert [p.indices.start for p in parts if not p.run] == [0, 17, 18]  # blocks 3, 20, 21
    assert all(p.skip == 0 for p in parts)


def test_a_read_takes_a_runs_tail_from_the_run():
    parts = pieces(list(range(3, 22)), 4, tails=True)
    assert (parts[0].indices, parts[0].run, parts[0].skip) == (range(0, 1), True, 3)  # block 3 of run 0
    assert [p.run for p in parts] == [True] * 5 + [False] * 2


def test_keys_out_of_order_or_without_positions_go_alone():
    assert not any(p.run for p in pieces([0, 1, 3, 2, 4, 5, 6, 7], 4, tails=False)[:4])
    assert not any(p.run for p in pieces([-1] * 8, 4, tails=True))
    assert [p.run for p in pieces(list(range(8)), 1, tails=True)] == [False] * 8


@given(
    start=st.integers(0, 40),
    count=st.integers(0, 40),
    k=st.sampled_from([1, 2, 4, 8]),
    tails=st.booleans(),
)
def test_pieces_cover_every_key_once_in_order(start, count, k, tails):
    positions = list(range(start, start + count))
    parts = pieces(positions, k, tails=tails)
    assert [i for p in parts for i in p.indices] == list(range(count))
    for p in parts:
        if p.run:
            last = positions[p.indices[-1]]
            assert last % k == k - 1, "a run ends at its last block"
            assert positions[p.indices[0]] == last - k + 1 + p.skip
            assert tails or p.skip == 0


def _store(held_runs: set[int], held_blocks_: set[int], positions: list[int]):
    """A store holding the runs ending at the given key indices and the given blocks alone;
    it counts its batches and requests."""
    calls: list[int] = []

    def exists(units: list[tuple[bool, int]]) -> list[bool]:
        calls.append(len(units))
        assert all(0 <= i < len(positions) for _, i in units), "a unit past the lookup's keys"
        return [(i in held_runs) if run else (i in held_blocks_) for run, i in units]

    return exists, calls


def _expected(count: int, k: int, stored_runs: set[int], stored_alone: set[int], positions: list[int]) -> int:
    """The held prefix by brute force: a block is held in a run whose last key is in the lookup
    and stored, or alone; runs then blocks alone, as :func:`held_blocks` searches."""
    held = 0
    for i in range(count):
        p = positions[i]
        end = i + (k - 1 - p % k)
        in_run = end < count and end in stored_runs
        if in_run or i in stored_alone:
            held += 1
        else:
            break
    return held


def test_a_returning_request_and_a_new_one_each_take_one_round_trip_of_a_few_names():
    k, positions = 8, list(range(0, 60))  # runs end at 7, 15, ..., 55; blocks 56-59 alone
    exists, calls = _store({7, 15, 23, 31, 39, 47, 55}, {56, 57}, positions)
    assert held_blocks(60, pieces(positions, k, tails=True), exists) == 58
    assert calls == [8], "one batch: blocks 0 and 55 and their runs, blocks 56-59"
    exists, calls = _store(set(), set(), positions)
    assert held_blocks(60, pieces(positions, k, tails=True), exists) == 0
    assert calls == [8]


def test_a_chat_turns_split_run_is_found_in_the_same_round_trip():
    # turn 1 stored blocks 0-39 as runs, its partial run (40-45) and its answer's block (46)
    # alone; turn 2's prompt reaches block 49, its last three blocks new
    k, positions = 8, list(range(0, 50))
    exists, calls = _store({7, 15, 23, 31, 39}, set(range(40, 47)), positions)
    assert held_blocks(50, pieces(positions, k, tails=True), exists) == 47
    assert calls == [8], "block 0 and its run, blocks 45-49 and the run of 40-47"


def test_a_prefill_cut_across_a_run_is_taken_as_held_between_the_names_asked():
    k, positions = 8, list(range(0, 44))  # runs end at 7, 15, 23, 31, 39; blocks 40-43 alone
    runs = {7, 15, 31, 39}  # the run of blocks 16-23 was cut by a chunk of the prefill: alone
    alone = set(range(16, 24)) | {40, 41, 42, 43}
    exists, calls = _store(runs, alone, positions)
    assert held_blocks(44, pieces(positions, k, tails=True), exists) == 44
    assert len(calls) == 1, "the blocks of the cut run are not asked"


def test_a_hole_between_the_names_asked_is_taken_as_held_and_one_asked_ends_the_hit():
    k, positions = 8, list(range(0, 50))
    runs, alone = {7, 15, 23, 31, 39}, set(range(40, 47))
    exists, _ = _store(runs - {23}, alone, positions)  # run 16-23 expired: its read fails
    assert held_blocks(50, pieces(positions, k, tails=True), exists) == 47
    exists, _ = _store(runs, alone - {45}, positions)  # block 45 asked: the hit ends there
    assert held_blocks(50, pieces(positions, k, tails=True), exists) == 45


def test_a_run_never_stored_whole_is_found_block_by_block():
    k, positions = 4, list(range(2, 30))  # the lookup starts inside run 0 (blocks 0-3)
    runs = {1, 5}  # runs ending at blocks 3 and 7 (key indices 1 and 5)
    alone = set(range(6, 20))  # blocks 8-21 alone (a chunked prefill), run 2 never whole
    exists, calls = _store(runs, alone, positions)
    held = held_blocks(28, pieces(positions, k, tails=True), exists)
    assert held == 20 == _expected(28, k, runs, alone, positions)
    assert len(calls) <= 3


@given(
    start=st.integers(0, 20),
    count=st.integers(1, 70),
    k=st.sampled_from([2, 4, 8]),
    data=st.data(),
)
def test_held_blocks_is_the_held_prefix_where_what_is_held_is_a_prefix(start, count, k, data):
    positions = list(range(start, start + count))
    parts = pieces(positions, k, tails=True)
    # as engines store: blocks up to some point held, as whole runs where written whole
    upto = data.draw(st.integers(0, count))
    as_runs = data.draw(st.booleans())
    runs = {p.indices[-1] for p in parts if p.run and p.indices.stop <= upto} if as_runs else set()
    covered = {i for p in parts if p.run and p.indices[-1] in runs for i in p.indices}
    alone = {i for i in range(upto) if i not in covered}
    exists, calls = _store(runs, alone, positions)
    assert held_blocks(count, parts, exists) == upto
    # one batch a round: the first and last five, then rounds of 8 blocks (two names each at most)
    assert len(calls) <= 4 and max(calls) <= 2 * ROUND, calls
