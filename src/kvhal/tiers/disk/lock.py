"""A model's ``LOCK`` on a disk path: held by its engine's scheduler, waited for by the next one.

A rolling update starts the new engine on the same volume while the old one drains; the old
one's ``flock`` is released when it closes its tier or its process ends. The new engine waits
up to ``lock_wait_s`` for it (polling: ``flock`` cannot time out), then fails naming the
holder's pid, so a second engine configured on the same path by mistake still gets a clear
error. :class:`LockWaiter` waits on a thread of its own instead, for a caller that serves
without the tier meanwhile (a tier opened with ``TierSpec.defer``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable

from kvhal.errors import TierError
from kvhal.tiers.disk.directory import open_file

__all__ = ["LOCK_POLL_S", "LockWaiter", "busy_error", "try_lock", "wait_lock"]

log = logging.getLogger(__name__)

#: How often a waiting engine tries the lock again (seconds).
LOCK_POLL_S = 0.05


def try_lock(dir_fd: int, where: str) -> tuple[int, str | None]:
    """Open ``LOCK`` in ``dir_fd`` (a model's namespace at ``where``) and try to hold it:
    ``(fd, None)`` once held (this pid written in it), ``(fd, holder's pid)`` if another holds it.
    The caller closes ``fd`` either way (closing it releases the lock)."""
    fd = open_file(dir_fd, "LOCK", os.O_RDWR | os.O_CREAT, where)
    try:
        holder = _try(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd, holder


def _try(fd: int) -> str | None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return None


def busy_error(path: str, holder: str, waited_s: float) -> TierError:
    """The error of a lock another engine still holds after ``waited_s`` seconds."""
    waited = f" for {waited_s:.0f} s (lock_wait_s)" if waited_s > 0 else ""
    return TierError(
        "disk",
        path,
        f"in use by another engine of this model (pid {holder}){waited}; stop it or give this "
        "engine another path, or raise lock_wait_s if it is an engine being replaced that drains longer",
    )


def wait_lock(fd: int, holder: str, path: str, wait_s: float) -> None:
    """Hold ``fd``'s lock, which ``holder`` held at the first try, waiting at most ``wait_s``.

    :raises TierError: still held at the deadline (``fd`` is left to the caller to close).
    """
    if wait_s > 0:
        log.warning(
            "kvhal: disk tier at %s: held by another engine of this model (pid %s); waiting up to "
            "%.0f s for it to release it (lock_wait_s: an engine being replaced drains first)",
            path,
            holder,
            wait_s,
        )
    started = time.monotonic()
    while holder is not None:
        if time.monotonic() - started >= wait_s:
            raise busy_error(path, holder, wait_s)
        time.sleep(LOCK_POLL_S)
        holder = _try(fd)
    if wait_s > 0:  # a warning, as the wait's start: the engine's start was that much later
        log.warning("kvhal: disk tier at %s: lock taken after %.1f s", path, time.monotonic() - started)


class LockWaiter:
    """Waits on a thread for ``fd``'s lock (held by ``holder`` at the first try), then calls
    ``on_taken()``; :attr:`error` says why it gave up (the deadline, or ``on_taken`` failing).

    :meth:`cancel` stops the wait (the tier is closing) and waits for the thread to end.
    """

    def __init__(self, fd: int, holder: str, path: str, wait_s: float, on_taken: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._fd, self._holder, self._path, self._wait_s = fd, holder, path, wait_s
        self._on_taken = on_taken
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvhal-disk-lock", daemon=True)
        log.warning(
            "kvhal: disk tier at %s: held by another engine of this model (pid %s); this engine "
            "serves without it meanwhile, and waits up to %.0f s (lock_wait_s) for it",
            path,
            holder,
            wait_s,
        )
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        holder: str | None = self._holder
        try:
            while holder is not None:
                if time.monotonic() - started >= self._wait_s:
                    raise busy_error(self._path, holder, self._wait_s)
                if self._cancelled.wait(LOCK_POLL_S):
                    return
                holder = _try(self._fd)
            self._on_taken()
            log.warning(
                "kvhal: disk tier at %s: lock taken after %.1f s; the tier serves from now on",
                self._path,
                time.monotonic() - started,
            )
        except BaseException as exc:  # on a thread: kept for the tier's owner, and said once
            self.error = exc
            log.error("kvhal: disk tier at %s: this engine runs without it: %s", self._path, exc)
        finally:
            self.done.set()

    def cancel(self) -> None:
        """Stop waiting and wait for the thread (idempotent)."""
        self._cancelled.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join()
