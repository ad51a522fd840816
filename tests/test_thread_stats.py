"""Per-thread page faults and CPU time (the runner's ``threads`` op, ``kvhal bench e2e``'s
thread groups): the numbers come from /proc and move when a thread works."""

from __future__ import annotations

import threading

import numpy as np

from kvhal.bench.e2e import thread_groups
from kvhal.vllm.testing.steps import threads as _threads


def test_a_thread_that_touches_new_pages_is_charged_with_their_faults():
    touched, finish = threading.Event(), threading.Event()

    def work() -> None:
        block = np.empty(64 << 20, dtype=np.uint8)  # fresh pages: faulted on first touch
        block[::4096] = 1
        touched.set()
        finish.wait()  # an ended thread leaves /proc/self/task: stay until read

    before = _threads()
    worker = threading.Thread(target=work, name="kvhal-test-touch")
    worker.start()
    try:
        assert touched.wait(30)
        after = _threads()
    finally:
        finish.set()
        worker.join()
    assert "kvhal-test-touch" not in before["threads"]
    mine = after["threads"]["kvhal-test-touch"]
    # one fault per page, 4 KiB or, with transparent huge pages, 2 MiB
    assert mine["minflt"] >= (64 << 20) // (2 << 20), mine
    assert mine["count"] == 1
    assert any(name.startswith("main:") for name in after["threads"]), after


def test_thread_groups_split_main_kvhal_and_the_rest():
    before = {"threads": {"main:python": {"minflt": 10, "utime_s": 1.0, "stime_s": 0.5}}}
    after = {
        "threads": {
            "main:python": {"minflt": 110, "utime_s": 3.0, "stime_s": 0.5},
            "kvhal-cpu-stream": {"minflt": 7, "utime_s": 0.25, "stime_s": 0.0},
            "kvhal-remote_0": {"minflt": 3, "utime_s": 0.0, "stime_s": 0.25},
            "python": {"minflt": 5, "utime_s": 0.5, "stime_s": 0.0},
        }
    }
    groups = thread_groups(before, after)
    assert groups == {
        "main": {"minflt": 100, "cpu_s": 2.0},
        "kvhal": {"minflt": 10, "cpu_s": 0.5},
        "other": {"minflt": 5, "cpu_s": 0.5},
    }
