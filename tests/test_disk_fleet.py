"""The disk tier where a fleet runs it: a world-writable mount point (an emptyDir, a fresh volume),
and a rolling update's second engine on the same path while the first drains (its ``LOCK``)."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from kvhal.errors import TierError, ValidationError
from kvhal.tiers.backend import TierSpec
from kvhal.tiers.disk import DiskTier
from kvhal.tiers.disk.format import TREE
from kvhal.tiers.disk.namespaces import namespace_name
from tests.test_disk_tier import FP, SLOT, keys_for, make_spec, store


def world_writable(tmp_path: Path) -> Path:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    return shared


def private(shared: Path) -> Path:
    return shared / f"kvhal-{os.geteuid()}"


# ---------------------------------------------------------------- a world-writable path


def test_the_private_directory_is_reused_and_keeps_the_blocks(tmp_path):
    shared = world_writable(tmp_path)
    t = DiskTier(make_spec(shared))
    store(t, [3])
    t.close()
    index = DiskTier(make_spec(shared, role="index"))
    assert index.recover() == ([3], keys_for([3]))
    assert index.path == str(private(shared))
    index.close()


def test_a_link_in_place_of_the_private_directory_is_refused(tmp_path):
    shared = world_writable(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    private(shared).symlink_to(elsewhere)
    with pytest.raises(TierError, match="symbolic link"):
        DiskTier(make_spec(shared))
    assert list(elsewhere.iterdir()) == [], "kvhal wrote through the link"


def test_an_opened_up_private_directory_is_refused(tmp_path):
    shared = world_writable(tmp_path)
    private(shared).mkdir(mode=0o700)
    private(shared).chmod(0o755)  # not made by kvhal as it is: its content cannot be trusted
    with pytest.raises(TierError, match=r"is not kvhal's private directory \(.*mode 755"):
        DiskTier(make_spec(shared))
    private(shared).chmod(0o700)  # control
    DiskTier(make_spec(shared)).close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_another_user_s_private_directory_is_refused(tmp_path):
    shared = world_writable(tmp_path)
    private(shared).mkdir(mode=0o700)
    os.chown(private(shared), 4321, 4321)
    with pytest.raises(TierError, match=r"is not kvhal's private directory \(uid 4321"):
        DiskTier(make_spec(shared))


# ---------------------------------------------------------------- the lock, waited for


def index_spec(path: Path, defer: bool = False, **options) -> TierSpec:
    """The scheduler's spec (``defer``: as vLLM's scheduler side opens it, serving meanwhile)."""
    return dataclasses.replace(make_spec(path, role="index", options=options), defer=defer)


def test_a_second_engine_waits_for_the_first_to_release_the_lock(tmp_path):
    path = tmp_path / "d"
    first = DiskTier(index_spec(path))
    opened: list[DiskTier] = []
    started = time.monotonic()
    second = threading.Thread(target=lambda: opened.append(DiskTier(index_spec(path, lock_wait_s=30))))
    second.start()
    time.sleep(0.5)
    assert not opened, "the second engine did not wait for the lock"
    first.close()  # the first engine drained
    second.join(10)
    assert opened and time.monotonic() - started >= 0.5
    assert (path / TREE / namespace_name(index_spec(path)) / "LOCK").read_text().strip() == str(os.getpid())
    opened[0].close()


def test_the_wait_ends_at_lock_wait_s_with_the_holder_named(tmp_path):
    path = tmp_path / "d"
    first = DiskTier(index_spec(path))
    started = time.monotonic()
    with pytest.raises(TierError, match=rf"\(pid {os.getpid()}\) for 1 s \(lock_wait_s\)"):
        DiskTier(index_spec(path, lock_wait_s=1))
    assert 1 <= time.monotonic() - started < 5
    first.close()
    DiskTier(index_spec(path, lock_wait_s=0)).close()  # the refusal kept nothing locked


@pytest.mark.parametrize(
    ("option", "value"), [("lock_wait_s", -1), ("lock_wait_s", 1.5), ("lock_wait_s", True)]
)
def test_bad_lock_options_name_the_option(tmp_path, option, value):
    with pytest.raises(ValidationError) as info:
        DiskTier(index_spec(tmp_path / "d", **{option: value}))
    assert info.value.argument == option


# ---------------------------------------------------------------- waited for on a thread


def test_a_deferred_tier_opens_at_once_and_is_ready_when_the_lock_comes(tmp_path):
    """The rolling update's engine serves without the disk tier (its chain polls ready) until
    the first engine releases the lock; then it finds the first engine's blocks."""
    path = tmp_path / "d"
    first = DiskTier(index_spec(path))
    worker = DiskTier(make_spec(path))
    store(worker, [5, 6])
    worker.close()
    started = time.monotonic()
    second = DiskTier(index_spec(path, lock_wait_s=30, defer=True))
    assert time.monotonic() - started < 5, "a deferred tier waited at open"
    assert not second.ready and second.ready_error is None, "waiting: not ready, no error"
    assert second.num_slots == first.num_slots, "the slot count is known before the lock"
    with pytest.raises(TierError, match="before the tier is ready"):
        second.recover()
    first.close()
    assert second.lock_waiter is not None and second.lock_waiter.done.wait(10)
    assert second.ready and second.lock_waiter.error is None and second.ready_error is None
    assert second._recovered is not None, "the index is read on the waiter's thread, before ready"
    assert second.recover() == ([5, 6], keys_for([5, 6]))
    assert second.recover() == ([5, 6], keys_for([5, 6])), "read again from the disk: the same"
    second.close()


class FailingNamespace(DiskTier):
    """A deferred tier whose namespace cannot be opened once the lock comes (EIO)."""

    def _open_namespace(self, ranks) -> None:
        if not self.ready:
            raise OSError(5, "Input/output error")
        super()._open_namespace(ranks)


def test_a_deferred_tier_that_fails_once_the_lock_comes_lets_it_go(tmp_path):
    path = tmp_path / "d"
    first = DiskTier(index_spec(path))
    second = FailingNamespace(index_spec(path, lock_wait_s=30, defer=True))
    first.close()
    assert second.lock_waiter is not None and second.lock_waiter.done.wait(10)
    assert not second.ready and isinstance(second.ready_error, OSError)
    DiskTier(index_spec(path, lock_wait_s=0)).close()  # the lock is free: the next engine takes it
    second.close()


def test_a_deferred_tier_past_its_deadline_stays_unready_and_says_why(tmp_path):
    path = tmp_path / "d"
    first = DiskTier(index_spec(path))
    second = DiskTier(index_spec(path, lock_wait_s=1, defer=True))
    assert second.lock_waiter is not None and second.lock_waiter.done.wait(10)
    assert not second.ready
    assert isinstance(second.lock_waiter.error, TierError) and second.ready_error is second.lock_waiter.error
    assert "lock_wait_s" in str(second.lock_waiter.error)
    first.close()
    time.sleep(0.2)
    assert not second.ready, "it took the lock after giving up"
    second.close()
    DiskTier(index_spec(path, lock_wait_s=0)).close()


def test_closing_a_deferred_tier_stops_its_wait(tmp_path):
    path = tmp_path / "d"
    first = DiskTier(index_spec(path))
    second = DiskTier(index_spec(path, lock_wait_s=60, defer=True))
    started = time.monotonic()
    second.close()
    assert time.monotonic() - started < 5
    assert second.lock_waiter is not None and second.lock_waiter.done.is_set()
    first.close()
    DiskTier(index_spec(path, lock_wait_s=0)).close()  # the closed waiter holds nothing


def test_a_deferred_tier_without_a_recorded_size_waits_at_open(tmp_path):
    """An engine holding the lock of a namespace it has not sized yet: the slot count is not
    known, so the deferred tier waits at open as an undeferred one does."""
    path = tmp_path / "d"
    namespace = path / TREE / namespace_name(index_spec(path))
    namespace.mkdir(parents=True, mode=0o700)
    for p in (path, path / TREE):
        p.chmod(0o700)
    fd = os.open(namespace / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(TierError, match="for 1 s"):
            DiskTier(index_spec(path, lock_wait_s=1, defer=True))
    finally:
        os.close(fd)
    tier = DiskTier(TierSpec({"path": str(path), "bytes_to_use": 1 << 20}, SLOT, FP, "index"))
    assert tier.ready
    tier.close()
