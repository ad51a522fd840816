"""A lookup's search for where a store's held part of a run of blocks ends
(:mod:`kvhal.tiers.remote.run_search`), and how long a lookup waits for a store whose lookups
take longer (:mod:`kvhal.vllm.store_lookup`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvhal.tiers.remote.run_search import ROUND, first_round, held_prefix


def search(count: int, held: set[int]) -> tuple[int, list[list[int]]]:
    """``held_prefix`` over a store holding the indices ``held``: its answer and its rounds."""
    rounds: list[list[int]] = []

    def ask(indices: list[int]) -> list[bool]:
        rounds.append(indices)
        return [i in held for i in indices]

    return held_prefix(count, ask), rounds


def test_every_prefix_of_every_run_is_found_in_few_requests():
    for count in range(130):
        for prefix in range(count + 1):
            found, rounds = search(count, set(range(prefix)))
            assert found == prefix, (count, prefix)
            most = max(ROUND, len(first_round(count)))
            assert all(len(set(r)) == len(r) <= most for r in rounds)
            assert len(rounds) <= 4, (count, prefix, rounds)
            assert sum(map(len, rounds)) <= min(count, 30), (count, prefix, rounds)


def test_a_returning_turn_and_a_new_conversation_take_one_round():
    # a returning conversation: all but the new turn's last few blocks held
    for new in range(5):
        assert search(64, set(range(64 - new))) == (64 - new, [first_round(64)])
    assert search(64, set()) == (0, [first_round(64)])  # a new one
    assert len(first_round(64)) == 13 and len(first_round(2048)) <= 24
    assert search(6, {0, 1, 2}) == (3, [[0, 1, 2, 3, 4, 5]]), "a short run is asked whole"


def test_a_hole_asked_ends_the_prefix_and_one_not_asked_is_taken_as_held():
    assert search(64, set(range(64)) - {61})[0] == 61  # asked in the first round
    assert search(64, set(range(64)) - {0})[0] == 0
    # a hole no round asks: taken as held (its read fails; recomputed and written again)
    assert search(64, set(range(64)) - {30})[0] == 64
    assert search(0, set()) == (0, [])


def test_a_store_whose_lookups_take_longer_is_waited_for_up_to_a_bound():
    pytest.importorskip("vllm")
    from kvhal.vllm.store_lookup import STORE_LOOKUP_MAX_WAIT_S, STORE_LOOKUP_WAIT_S, _wait_for

    def wait(expected: float | None) -> float:
        return _wait_for(SimpleNamespace(store=SimpleNamespace(expected_lookup_s=expected)))

    assert wait(None) == STORE_LOOKUP_WAIT_S  # nothing measured yet
    assert wait(0.0005) == STORE_LOOKUP_WAIT_S  # Redis, Mooncake
    assert wait(0.008) == pytest.approx(0.012)  # a local object store's HEADs
    assert wait(STORE_LOOKUP_MAX_WAIT_S / 1.5) == pytest.approx(STORE_LOOKUP_MAX_WAIT_S)
    assert wait(0.03) == STORE_LOOKUP_WAIT_S, "a store slower than the bound is not waited for"


def test_a_lookup_waiting_whole_waits_as_long_as_the_stores_lookups_take_within_its_timeout():
    pytest.importorskip("vllm")
    from kvhal.vllm.store_lookup import STORE_LOOKUP_MAX_WAIT_S, WHOLE_WAIT_LOOKUPS, _wait_for

    def wait(expected: float | None, timeout: float = 0.2) -> float:
        store = SimpleNamespace(expected_lookup_s=expected)
        return _wait_for(SimpleNamespace(store=store, lookup_timeout_s=timeout), whole=True)

    assert wait(None) == STORE_LOOKUP_MAX_WAIT_S  # nothing measured yet
    assert wait(0.002) == STORE_LOOKUP_MAX_WAIT_S
    assert wait(0.03) == pytest.approx(WHOLE_WAIT_LOOKUPS * 0.03), "a remote S3's HEADs are waited for"
    assert wait(0.1) == 0.2, "never past the lookup timeout"
    assert wait(0.03, timeout=0.05) == 0.05


def test_only_an_in_process_worker_computing_on_the_host_makes_lookups_wait_whole(cpu):
    pytest.importorskip("vllm")
    from kvhal.vllm.local import waits_whole

    assert cpu.computes_on_host, "the CPU plugin's device computes on the host's cores"

    def worker(device_type: str | None) -> SimpleNamespace:
        device = None if device_type is None else SimpleNamespace(computes_on_host=device_type == "cpu")
        return SimpleNamespace(device=device)

    assert waits_whole(worker("cpu"))
    assert not waits_whole(worker("cuda")), "a GPU's forward leaves the host's cores to the read"
    assert not waits_whole(worker(None)), "no caches registered yet"
    assert not waits_whole(None), "workers in other processes: their reads are their jobs"
