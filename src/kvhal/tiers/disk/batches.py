"""A disk tier batch: its arguments checked, its tasks on a thread pool, one future for it.

A batch (a :meth:`~kvhal.tiers.disk.DiskTier.write` or ``read`` call) is cut into tasks
(runs of contiguous slots, :func:`~kvhal.tiers.disk.io.plan_tasks`); each task records
its slots' outcomes in a shared list, and the batch's future completes with that list
once every task has ended. Failures are per slot, never raised from the future, and
logged once per batch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvhal.errors import ValidationError, check_int
from kvhal.tiers.disk.format import MAX_KEY_BYTES
from kvhal.tiers.disk.io import byte_views

log = logging.getLogger(__name__)

#: A task's work: ``(task, slots, keys, views, results, errors)``; it sets the outcomes of
#: the slots it did in ``results`` and appends each ``OSError`` it met to ``errors``.
Work = Callable[
    [list[list[int]], list[int], list[bytes], list[memoryview], list[Any], list[BaseException]], None
]


def check_batch(
    call: str,
    slots: Sequence[int],
    keys: Sequence[bytes],
    buffers: Sequence[memoryview],
    num_slots: int,
    slot_bytes: int,
) -> tuple[list[int], list[bytes], list[memoryview]]:
    """``slots``, ``keys`` and ``buffers`` as lists (keys as bytes, buffers as byte views).

    :raises ValidationError: not one key and one buffer per slot, a slot out of range or
        repeated, a key longer than :data:`MAX_KEY_BYTES`, a buffer of another size than
        ``slot_bytes`` (or read-only, for a ``"read"``).
    """
    n = len(slots)
    if len(keys) != n or len(buffers) != n:
        raise ValidationError(
            "keys", f"{n} slots, {len(keys)} keys and {len(buffers)} buffers: one each per slot"
        )
    slots = [check_int("slots", s, minimum=0, below=num_slots) for s in slots]
    if len(set(slots)) != n:
        seen: set[int] = set()
        for slot in slots:
            if slot in seen:
                raise ValidationError("slots", f"slot {slot} appears twice in one {call}")
            seen.add(slot)
    keys = [bytes(k) for k in keys]
    for key in keys:
        if len(key) > MAX_KEY_BYTES:
            raise ValidationError(
                "keys",
                f"key {key[:8].hex()}... has {len(key)} bytes; the disk tier takes at most {MAX_KEY_BYTES}",
            )
    views = byte_views(buffers, slot_bytes, writable=call == "read")
    return slots, keys, views


def submit_batch(
    pool: ThreadPoolExecutor,
    work: Work,
    tasks: list[list[list[int]]],
    slots: list[int],
    keys: list[bytes],
    views: list[memoryview],
    failed: Any,
    what: str,
    path: str,
) -> Future[Any]:
    """Run ``work`` on each of ``tasks`` in ``pool``; the future's result is each slot's
    outcome, ``failed`` where no task set another.

    :param what: ``"write"`` or ``"read"``, and ``path`` the tier's: for the log.
    """
    results = [failed] * len(slots)  # a slot's outcome stays a failure unless its work succeeds
    outer: Future[Any] = Future()
    outer.set_running_or_notify_cancel()
    if not slots:
        outer.set_result(results)
        return outer
    errors: list[BaseException] = []
    remaining = [len(tasks)]
    lock = threading.Lock()

    def finished(future: Future[None]) -> None:
        exc = future.exception()
        if exc is not None:  # a bug, not the medium: keep its slots failed and say so
            log.error("disk tier at %s: a %s task failed", path, what, exc_info=exc)
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            if errors:
                bad = sum(r is failed for r in results)
                more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
                log.warning(
                    "disk tier at %s: %d of %d slots failed to %s: %s%s",
                    path,
                    bad,
                    len(results),
                    what,
                    errors[0],
                    more,
                )
            outer.set_result(results)

    for task in tasks:
        try:
            future = pool.submit(work, task, slots, keys, views, results, errors)
        except RuntimeError:
            # The interpreter is exiting (concurrent.futures takes no new work once its
            # atexit hook ran, before vLLM shuts the connector down): do it here, so an
            # engine's last stores still reach the disk.
            future = Future()
            future.set_running_or_notify_cancel()
            try:
                work(task, slots, keys, views, results, errors)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(None)
        future.add_done_callback(finished)
    return outer
