"""The chat bench's step clock: each part's own time, a call timed inside another counted once."""

from __future__ import annotations

import time

from kvhal.vllm.testing.step_clock import StepClock


class Engine:
    def step(self) -> None:
        time.sleep(0.02)
        self.hook()
        self.hook()

    def hook(self) -> None:
        time.sleep(0.01)


def test_a_call_inside_another_counts_for_its_own_part_only():
    engine, clock = Engine(), StepClock()
    clock.wrap(engine, "hook", "kvhal", detail=True)
    clock.wrap(engine, "step", "execute")
    start = time.perf_counter()
    engine.step()
    wall = time.perf_counter() - start
    parts = clock.take()
    assert parts["execute"] >= 0.02 and parts["kvhal"] >= 0.02 and parts["hook:hook"] == parts["kvhal"], parts
    # the hooks' time is not counted in execute's too: the parts add up to the wall time
    assert abs(parts["execute"] + parts["kvhal"] - wall) < 0.01, (parts, wall)
    assert clock.take() == {}, "take() starts the next step afresh"


def test_wrapping_twice_times_once():
    engine, clock = Engine(), StepClock()
    clock.wrap(engine, "hook", "kvhal")
    clock.wrap(engine, "hook", "kvhal")
    start = time.perf_counter()
    engine.hook()
    wall = time.perf_counter() - start
    assert 0.01 <= clock.take()["kvhal"] <= wall + 1e-6  # one wrapper's time, not two
