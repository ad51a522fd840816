"""EIO and ENOSPC at every I/O call the disk tier makes, one call at a time.

A clean run of a tier's life (open the scheduler's and a worker's tier, write, read, recover,
close, reopen, read) counts the operating-system calls the disk tier's modules make. Then the
run is repeated once per call, that call failing. Whatever fails:

- nothing wrong is served: a read that says OK holds the bytes written;
- nothing but kvhal's own errors escapes (a clear error at start naming the path, never a raw
  ``OSError``), and reads and writes report failures per slot, never raise;
- once the fault is gone, the tier opens and serves: what it offers is right, and it stores again.

The control: the clean run serves every block it wrote.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import pkgutil
import threading
from types import SimpleNamespace

import pytest

from kvhal.errors import KVHALError
from kvhal.tiers import disk
from kvhal.tiers.backend import OK
from kvhal.tiers.disk import DiskTier, io, tier
from tests.test_disk_tier import keys_for, load, make_spec, store

#: The calls of ``os`` that touch the file system (the rest pass through).
IO_CALLS = [
    "open",
    "pread",
    "pwrite",
    "preadv",
    "pwritev",
    "write",
    "fsync",
    "fdatasync",
    "posix_fallocate",
    "ftruncate",
    "replace",
    "listdir",
    "unlink",
    "mkdir",
    "rmdir",
    "rename",
    "stat",
    "lstat",
    "fstat",
    "makedirs",
]
SLOTS = [0, 1, 2, 5, 6]
#: Every module of the disk tier that calls ``os``: a call moved to a new module stays swept.
OS_MODULES = [
    module
    for info in pkgutil.iter_modules(disk.__path__)
    if hasattr(module := importlib.import_module(f"{disk.__name__}.{info.name}"), "os")
]


class FaultyOS(SimpleNamespace):
    """``os`` whose I/O calls are counted, the ``fail_at``-th failing with ``error``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.fail_at = -1
        self.error = errno.EIO
        self.failed: str | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name):
        real = getattr(os, name)
        if name not in IO_CALLS:
            return real

        def call(*args, **kwargs):
            with self._lock:
                n = self.calls
                self.calls += 1
            if n == self.fail_at:
                self.failed = name
                raise OSError(self.error, os.strerror(self.error))
            return real(*args, **kwargs)

        return call


@pytest.fixture
def faulty(monkeypatch):
    fake = FaultyOS()
    for module in OS_MODULES:
        monkeypatch.setattr(module, "os", fake)
    return fake


def life(path) -> dict[int, bytes]:
    """A tier's life; the contents of the slots whose writes were reported done."""
    index = DiskTier(make_spec(path, role="index"))
    try:
        worker = DiskTier(make_spec(path))
        try:
            written = _write(worker)
            _check(worker, written)
            index.recover()
        finally:
            worker.close()
    finally:
        index.close()
    index = DiskTier(make_spec(path, role="index"))
    try:
        slots, keys = index.recover()
        assert all(k == keys_for([s])[0] for s, k in zip(slots, keys, strict=True))
        worker = DiskTier(make_spec(path))
        try:
            _check(worker, written)
        finally:
            worker.close()
    finally:
        index.close()
    return written


def _write(worker: DiskTier) -> dict[int, bytes]:
    from tests.test_disk_tier import aligned, fill

    buffers = aligned(len(SLOTS), worker.geometry.slot_bytes)
    contents = fill(buffers, 7)
    done = worker.write(SLOTS, keys_for(SLOTS), buffers).result(timeout=30)
    return {s: c for s, c, ok in zip(SLOTS, contents, done, strict=True) if ok}


def _check(worker: DiskTier, written: dict[int, bytes]) -> None:
    outcomes, got = load(worker, SLOTS)
    for slot, outcome, data in zip(SLOTS, outcomes, got, strict=True):
        if outcome == OK:
            assert slot in written and data == written[slot], f"slot {slot} served bytes never written"


def test_the_clean_run_serves_everything_it_wrote(tmp_path, faulty):
    written = life(tmp_path / "d")
    assert sorted(written) == SLOTS
    worker = DiskTier(make_spec(tmp_path / "d"))
    assert load(worker, SLOTS) == ([OK] * len(SLOTS), [written[s] for s in SLOTS])
    worker.close()
    assert faulty.calls > 50, faulty.calls  # the sweep below has something to sweep


def _calls_of_a_clean_run(tmp_path, faulty) -> int:
    life(tmp_path / "clean")
    return faulty.calls


@pytest.mark.parametrize("error", [errno.EIO, errno.ENOSPC])
def test_every_io_call_failing_once_never_serves_wrong_kv_and_the_tier_serves_after(tmp_path, faulty, error):
    total = _calls_of_a_clean_run(tmp_path, faulty)
    failed_at: dict[str, int] = {}
    for n in range(total):
        path = tmp_path / f"run{n}"
        faulty.calls, faulty.fail_at, faulty.error, faulty.failed = 0, n, error, None
        try:
            life(path)
        except KVHALError as exc:  # a clear error at start (or at recovery), naming the tier's path
            assert str(path) in str(exc), f"call {n} ({faulty.failed}): {exc}"
        except OSError as exc:
            pytest.fail(f"call {n} ({faulty.failed}) failing escaped as a raw OSError: {exc!r}")
        if faulty.failed:
            failed_at.setdefault(faulty.failed, n)
        faulty.fail_at = -1
        # the fault is gone: the tier opens, offers only right blocks, and stores again
        index = DiskTier(make_spec(path, role="index"))
        index.recover()
        worker = DiskTier(make_spec(path))
        fresh = store(worker, [9], seed=n)
        assert load(worker, [9]) == ([OK], fresh), (
            f"after call {n} ({faulty.failed}) failed, the tier stopped serving"
        )
        worker.close()
        index.close()
    # the sweep reached every kind of call the disk tier makes to the file system
    print(f"{total} calls failed one at a time; the first of each kind: {failed_at}")
    assert {"open", "pwritev", "preadv", "fdatasync", "posix_fallocate", "write", "replace"} <= set(failed_at)


def test_the_sweep_catches_a_tier_that_serves_a_failed_read(tmp_path, faulty, monkeypatch):
    """The negative control: a tier that swallows a failed read and checks no crc serves
    bytes it never read, and the sweep's check says so."""

    def lying_preadv(self, fd, buffers, offset):
        with contextlib.suppress(OSError):
            io.preadv_all(fd, buffers, offset)

    monkeypatch.setattr(DiskTier, "_preadv", lying_preadv)
    monkeypatch.setattr(tier, "crc32c", SimpleNamespace(crc32c=lambda data: 0))
    total = _calls_of_a_clean_run(tmp_path, faulty)
    caught = []
    for n in range(total):
        faulty.calls, faulty.fail_at, faulty.failed = 0, n, None
        try:
            life(tmp_path / f"run{n}")
        except AssertionError as exc:
            caught.append((n, faulty.failed, str(exc)))
        except (KVHALError, OSError):
            pass
    assert any("served bytes never written" in why for _, _, why in caught), caught
