"""Aligned, vectored file I/O for the ``disk`` tier.

``preadv``/``pwritev`` move a run of contiguous slots in one request even when
the caller's buffers are scattered in memory; these helpers finish short
transfers and respect ``IOV_MAX``. With ``O_DIRECT`` every buffer's address and
length, and the offset, must be multiples of :data:`~kvhal.tiers.disk.format.ALIGN`.
Also the pure parts of a batch: its buffers checked (:func:`byte_views`) and cut into
tasks for the I/O threads (:func:`plan_tasks`).
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence

import numpy as np

from kvhal.errors import ValidationError
from kvhal.tiers.disk.format import ALIGN, Geometry

IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


def aligned_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of page-aligned anonymous memory (what O_DIRECT needs for a bounce buffer)."""
    return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


def address(buffer: memoryview) -> int:
    """The address of ``buffer``'s first byte (read-only buffers included)."""
    return np.frombuffer(buffer, np.uint8).__array_interface__["data"][0]


def is_aligned(buffer: memoryview) -> bool:
    return buffer.nbytes % ALIGN == 0 and address(buffer) % ALIGN == 0


def _advance(buffers: list[memoryview], done: int) -> list[memoryview]:
    """``buffers`` without their first ``done`` bytes."""
    while done:
        head = buffers[0]
        if done >= head.nbytes:
            done -= head.nbytes
            buffers = buffers[1:]
        else:
            buffers = [head[done:], *buffers[1:]]
            done = 0
    return buffers


def pwritev_all(fd: int, buffers: Sequence[memoryview], offset: int) -> None:
    """Write ``buffers`` back to back at ``offset``, all of them, or raise OSError."""
    pending = list(buffers)
    while pending:
        batch = pending[:IOV_MAX]
        want = sum(b.nbytes for b in batch)
        done = os.pwritev(fd, batch, offset)
        if done == 0 and want:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += done
        pending = _advance(pending, done)


def preadv_all(fd: int, buffers: Sequence[memoryview], offset: int) -> None:
    """Fill ``buffers`` back to back from ``offset``, all of them, or raise OSError (EIO at end of file)."""
    pending = list(buffers)
    while pending:
        batch = pending[:IOV_MAX]
        want = sum(b.nbytes for b in batch)
        done = os.preadv(fd, batch, offset)
        if done == 0 and want:
            raise OSError(errno.EIO, f"end of file at offset {offset}: the file is shorter than its slots")
        offset += done
        pending = _advance(pending, done)


def plan_tasks(slots: list[int], geometry: Geometry, threads: int, chunk_bytes: int) -> list[list[list[int]]]:
    """Tasks for a pool of ``threads``: each a list of runs, each run batch positions of ascending
    contiguous slots in one file. Tasks are at most ``chunk_bytes`` and, for small batches,
    smaller, so that every thread gets a share."""
    stride, per_file = geometry.stride, geometry.slots_per_file
    share = -(-len(slots) * stride // threads)
    limit = max(1, min(chunk_bytes, share) // stride)  # slots per task
    runs: list[list[int]] = []
    run: list[int] = []
    previous = -2
    for position in sorted(range(len(slots)), key=slots.__getitem__):
        slot = slots[position]
        if run and slot == previous + 1 and slot % per_file and len(run) < limit:
            run.append(position)
        else:
            if run:
                runs.append(run)
            run = [position]
        previous = slot
    runs.append(run)
    tasks: list[list[list[int]]] = []
    task: list[list[int]] = []
    size = 0
    for run in runs:
        if task and size + len(run) > limit:
            tasks.append(task)
            task, size = [], 0
        task.append(run)
        size += len(run)
    tasks.append(task)
    return tasks


def byte_views(buffers: Sequence[memoryview], slot_bytes: int, *, writable: bool) -> list[memoryview]:
    """Each buffer as a flat byte view of exactly ``slot_bytes`` (and writable, for a read).

    :raises ValidationError: (``buffers``) one is not contiguous, of another size, or read-only.
    """
    views = []
    for i, buffer in enumerate(buffers):
        try:
            view = memoryview(buffer).cast("B")
        except (TypeError, ValueError) as exc:
            raise ValidationError("buffers", f"buffer {i} is not a contiguous buffer: {exc}") from exc
        if view.nbytes != slot_bytes:
            raise ValidationError("buffers", f"buffer {i} has {view.nbytes} bytes; slots have {slot_bytes}")
        if writable and view.readonly:
            raise ValidationError("buffers", f"buffer {i} is read-only; a read fills it")
        views.append(view)
    return views
