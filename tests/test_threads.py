"""kvhal.threads: kvhal's threads carry their names for the kernel (Linux), and so do the native
threads a library starts from them."""

from __future__ import annotations

import sys
import threading

import pytest

from kvhal.threads import kernel_name, named_pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kernel thread names: Linux")


def comm(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


def test_a_named_pool_names_its_threads_for_the_kernel():
    pool = named_pool(1, "kvhal-remote")
    try:
        tid = pool.submit(threading.get_native_id).result(5)
        assert comm(tid) == "kvhal-remote_0"
    finally:
        pool.shutdown()


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="Python 3.14 names every thread it starts itself")
def test_a_thread_started_under_a_kernel_name_keeps_it_and_the_caller_gets_its_own_back():
    me = threading.get_native_id()
    own = comm(me)
    started, release = threading.Event(), threading.Event()
    box: dict[str, int] = {}

    def child() -> None:
        box["tid"] = threading.get_native_id()
        started.set()
        release.wait(5)

    with kernel_name("kvhal-store"):
        assert comm(me) == "kvhal-store"
        thread = threading.Thread(target=child)
        thread.start()
        started.wait(5)
    try:
        assert comm(me) == own, "the caller's own name is back"
        assert comm(box["tid"]) == "kvhal-store", "the thread started meanwhile keeps the name"
    finally:
        release.set()
        thread.join()
