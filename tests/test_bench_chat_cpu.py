"""``kvhal bench chat``'s CPU accounting (kvhal.bench.chat.cpu): thread groups, and cores busy in
rounds >= 2."""

from __future__ import annotations

import pytest

from kvhal.bench.chat.cpu import by_group, cores_busy_later


def test_threads_are_grouped_by_what_runs_them():
    seconds = {
        "main:MainThread": 2.0,  # the engine's thread: the forward
        "workers:python3": 1.5,  # native threads the main thread started unnamed: torch's
        "kvhal-remote_0": 0.25,
        "kvhal-copy": 0.05,
        "native:Valkey-GLIDE ba": 0.125,  # glide names its own
        "native:kvhal-remote_1": 0.5,  # a store client's, started from kvhal's remote tier
        "native:kvhal-store": 0.25,  # a store client's, started while kvhal opened it
        "gloo_tcp_loop": 0.0625,
        "kvhal-s3": 0.5,  # the S3 store's event loop
        "native:tokio-rt-worker": 0.25,  # obstore's runtime
    }
    assert by_group(seconds) == {"engine": 3.5, "kvhal": 0.3, "store client": 1.625, "other": 0.0625}


def rnd(seconds: float, threads: dict[str, float], **store: float) -> dict:
    return {"seconds": seconds, "thread_cpu_s": threads, **store}


def test_cores_busy_are_cpu_seconds_over_wall_seconds_of_rounds_two_and_later():
    first = rnd(10.0, {"main:p": 10.0, "kvhal-x": 5.0}, store_cpu_s=9.0, store_wall_s=9.0)  # not counted
    store = {"store_cpu_s": 0.3, "store_wall_s": 3.0}
    runs = [
        {"rounds": [first, rnd(2.0, {"main:p": 2.0, "workers:p": 1.0, "kvhal-x": 0.5}, **store)]},
        {"rounds": [first, rnd(2.0, {"main:p": 2.0, "workers:p": 1.0, "kvhal-x": 0.3}, **store)]},
    ]
    busy = cores_busy_later(runs)
    assert busy == pytest.approx(
        {"engine": 1.5, "kvhal": 0.2, "store client": 0.0, "other": 0.0, "store server": 0.1}
    )
    # without a store, no store row
    alone = cores_busy_later([{"rounds": [first, rnd(4.0, {"main:p": 4.0})]}])
    assert alone is not None and "store server" not in alone and alone["engine"] == 1.0


def test_runs_without_thread_times_have_no_cores_busy():
    assert cores_busy_later([{"rounds": [rnd(1.0, {}), rnd(1.0, {})]}]) is None
    assert cores_busy_later([{"rounds": [rnd(1.0, {"main:p": 1.0})]}]) is None  # one round: none later


def test_decode_steps_are_those_of_rounds_two_and_later_with_no_first_token():
    from kvhal.bench.chat.checks import decode_steps_ms

    def step(ms: float, tokens: int, first: list[int] | None = None) -> dict:
        return {"seconds": ms / 1000, "scheduled_tokens": tokens, "first_tokens": first or []}

    first_round = {"steps": [step(50.0, 3)]}  # round 1: not counted
    later = {"steps": [step(8.0, 3), step(10.0, 3), step(90.0, 3, [4]), step(12.0, 2), step(9.0, 3)]}
    found = decode_steps_ms({"rounds": [first_round, later]}, 3)
    assert found is not None and found["n"] == 3 and found["median"] == pytest.approx(9.0)
    # a shared run's round holds one trace per engine
    shared = {"steps": [[step(8.0, 3)], [step(12.0, 3)]]}
    assert decode_steps_ms({"rounds": [first_round, shared]}, 3)["median"] == pytest.approx(10.0)
    assert decode_steps_ms({"rounds": [first_round, {"steps": None}]}, 3) is None  # no trace
    assert decode_steps_ms({"rounds": [first_round, {"steps": [None, None]}]}, 3) is None  # shared, no trace
