"""The built-in ``disk`` tier backend: KV blocks in preallocated files on a local disk.

Options (``TierSpec.options``):

- ``path`` (str, required): a directory; created (mode 0700) if missing. An
  existing one must be a real directory (not a symbolic link) that other users
  cannot write (not world-writable).
- ``bytes_to_use`` (int, required): disk space for the whole engine; each
  tensor-parallel rank gets ``bytes_to_use // world_size``, as many whole slots
  as fit (a slot takes its size rounded up to 4 KiB plus a 64-byte record).
  Preallocated when the tier opens, so a full disk is an error at start-up
  naming the free bytes, never a failure mid-run.
- ``io_threads`` (int, default 8): requests in flight per worker.
- ``direct`` (``"auto"`` default, ``True``, ``False``): read and write the data
  files with ``O_DIRECT``, bypassing the page cache (so a read really comes from
  the disk, and stored blocks do not push the engine's memory out of the page
  cache). ``"auto"`` uses it where the file system accepts an aligned O_DIRECT
  read (ext4, xfs; tmpfs since Linux 6.6); ``True`` makes a file system without
  it an error. Buffers that are not 4 KiB-aligned go through per-thread bounce
  buffers.

What it writes, under ``<path>/kvhal-tier-v1/`` (directories 0700, files 0600,
all opened relative to directory descriptors with ``O_NOFOLLOW``; keys never
become file names):

- ``LOCK``: held with ``flock`` by the engine's scheduler (``role="index"``)
  while open, holding its pid; a second engine on the same path is refused.
  Workers (``role="io"``) do not lock: they belong to the engine holding it.
- ``rank{r}of{n}/meta.json``: the slot geometry (checked on every open: a
  directory made for another slot size or ``bytes_to_use`` is refused, never
  reinitialised, so nothing stored is lost to a configuration mistake) and, for
  people, the fingerprint of the KV it holds.
- ``rank{r}of{n}/data-{i}.bin``: the payloads, file-major (see
  :class:`~kvhal.tiers.disk.format.Geometry`): ascending slots are contiguous,
  so a run of them moves in one request.
- ``rank{r}of{n}/index.bin``: one 64-byte record per slot (key, fingerprint
  digest, payload crc32c, its own crc32c; :mod:`kvhal.tiers.disk.format`).

Durability: a write stores the payload, then its record; nothing is synced
per block (the data files are ``fdatasync``-ed on :meth:`DiskTier.close`). A
crash of the process loses nothing the kernel accepted. A crash between payload
and record leaves the old record over new bytes, whose crc then mismatches. A
power loss may lose recent blocks or leave such mismatches, but every read
verifies the record and the payload's crc, so a torn or stale block reads as
``"corrupt"`` or ``"missing"`` (the engine recomputes it), never as wrong KV.

Threading: :meth:`~DiskTier.write` and :meth:`~DiskTier.read` validate their
arguments, cut the batch into runs of contiguous slots of at most a few MiB
and hand them to a pool of ``io_threads`` threads; the returned future
completes when all are done. Failures are per slot and never raised from the
future; they are logged once per batch.

Tests inject faults by subclassing: every file access goes through
:meth:`DiskTier._pwritev`, :meth:`DiskTier._preadv`,
:meth:`DiskTier._write_records` and :meth:`DiskTier._probe_direct`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from kvhal.errors import ClosedError, TierError, ValidationError, check_int
from kvhal.tiers.backend import IO_ERROR, OK, TierBackend, TierSpec
from kvhal.tiers.disk.format import (
    ALIGN,
    MAX_KEY_BYTES,
    RECORD_BYTES,
    TREE,
    Geometry,
    check_record,
    meta_mismatches,
    meta_text,
    pack_record,
    record_keys,
    valid_records,
)
from kvhal.tiers.disk.io import aligned_buffer, is_aligned, preadv_all, pwritev_all

__all__ = ["DiskOptions", "DiskTier"]

log = logging.getLogger(__name__)

#: Largest single request: big enough for the disk's full bandwidth, small
#: enough that a batch becomes several requests in flight.
CHUNK_BYTES = 4 << 20
#: Records ``recover`` checks per step (and per ``progress`` call).
RECOVER_CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC
_OPTIONS = ("path", "bytes_to_use", "io_threads", "direct")


@dataclass(frozen=True)
class DiskOptions:
    """The ``disk`` tier's options, validated (see the module docstring)."""

    path: str
    bytes_to_use: int
    io_threads: int = 8
    direct: bool | str = "auto"

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> DiskOptions:
        """Validate ``options``; a :class:`ValidationError` names the offending option."""
        for name in options:
            if name not in _OPTIONS:
                raise ValidationError(
                    name, f"unknown disk tier option; the options are {', '.join(_OPTIONS)}"
                )
        for name in ("path", "bytes_to_use"):
            if name not in options:
                raise ValidationError(name, "the disk tier needs it")
        path = options["path"]
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValidationError("path", f"must be a directory path, got {path!r}")
        direct = options.get("direct", "auto")
        if not (isinstance(direct, bool) or direct == "auto"):
            raise ValidationError("direct", f'must be "auto", true or false, got {direct!r}')
        return cls(
            path=os.path.abspath(os.fspath(path)),
            bytes_to_use=check_int("bytes_to_use", options["bytes_to_use"]),
            io_threads=check_int("io_threads", options.get("io_threads", 8)),
            direct=direct,
        )


class DiskTier(TierBackend):
    """Slots in preallocated files under ``spec.options["path"]``.

    :raises ValidationError: an option is wrong (names it), or the disk has too
        little free space for ``bytes_to_use``.
    :raises TierError: the path is unsafe (a symbolic link, world-writable),
        another engine holds it, or it holds slots of another geometry.
    """

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.options = DiskOptions.parse(spec.options)
        self.path = self.options.path
        slot_bytes = check_int("slot_bytes", spec.slot_bytes)
        world_size = check_int("world_size", spec.world_size)
        check_int("rank", spec.rank, minimum=0, below=world_size)
        if spec.role not in ("index", "io"):
            raise ValidationError("role", f'must be "index" or "io", got {spec.role!r}')
        per_rank = self.options.bytes_to_use // world_size
        self.geometry = Geometry.plan(slot_bytes, per_rank)
        if self.geometry.num_slots < 1:
            raise ValidationError(
                "bytes_to_use",
                f"{self.options.bytes_to_use} bytes is {per_rank} per rank over {world_size} rank(s), "
                f"less than one slot ({self.geometry.stride + RECORD_BYTES} bytes on disk for "
                f"{slot_bytes}-byte slots)",
            )
        self.num_slots = self.geometry.num_slots
        #: Whether the data files are read and written with O_DIRECT (``io`` role).
        self.direct = False
        self._digest = spec.digest()
        self._closed = False
        self._root_fd = self._tree_fd = self._lock_fd = self._index_fd = -1
        self._rank_fds: dict[int, int] = {}
        self._data_fds: list[int] = []
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        try:
            self._root_fd = self._open_root()
            self._tree_fd = self._open_dir(self._root_fd, TREE, self.path)
            if spec.role == "index":
                self._lock_fd = self._take_lock()
            ranks = range(world_size) if spec.role == "index" else [spec.rank]
            self._ensure_ranks(ranks)
            if spec.role == "io":
                self._open_io()
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------------ the chain's calls

    def recover(self, progress: Callable[[int, int], None] | None = None) -> tuple[list[int], list[bytes]]:
        """The slots holding a block of this fingerprint in every rank, with the same key in each.

        Records of another fingerprint, rank or format, damaged records and
        slots whose ranks disagree are left out (the chain overwrites them).
        """
        self._check_open("recover", "index")
        total = self.num_slots
        digests = [self.spec.digest(r) for r in range(self.spec.world_size)]
        fds = [
            self._open_file(self._rank_fds[r], "index.bin", os.O_RDONLY, self._rank_dir(r))
            for r in range(self.spec.world_size)
        ]
        slots: list[int] = []
        keys: list[bytes] = []
        try:
            for start in range(0, total, RECOVER_CHUNK):
                n = min(RECOVER_CHUNK, total - start)
                first = self._read_index(fds[0], start, n)
                mask = valid_records(first, digests[0])
                for fd, digest in zip(fds[1:], digests[1:], strict=True):
                    raw = self._read_index(fd, start, n)
                    mask = valid_records(raw, digest, within=mask)
                    rows = np.flatnonzero(mask)
                    same = (raw[rows, 6:8] == first[rows, 6:8]).all(1) & (
                        raw[rows, 20 : 20 + MAX_KEY_BYTES] == first[rows, 20 : 20 + MAX_KEY_BYTES]
                    ).all(1)
                    mask[rows[~same]] = False
                rows = np.flatnonzero(mask)
                slots.extend((rows + start).tolist())
                keys.extend(record_keys(first, rows))
                if progress is not None:
                    progress(start + n, total)
        finally:
            for fd in fds:
                os.close(fd)
        return slots, keys

    def write(
        self, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> Future[list[bool]]:
        """Store each buffer as its key in its slot; the future's result says which were written.

        :raises ValidationError: a slot out of range or repeated, a key longer
            than 40 bytes, a buffer of the wrong size (nothing was written).
        :raises ClosedError: the tier was closed.
        """
        slots, keys, views = self._check_batch("write", slots, keys, buffers)
        return self._submit(self._write_task, slots, keys, views, False, "write")

    def read(
        self, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> Future[list[str | None]]:
        """Fill each buffer with its key's block from its slot; the future's result is each outcome.

        :raises ValidationError: as :meth:`write`, or a read-only buffer.
        :raises ClosedError: the tier was closed.
        """
        slots, keys, views = self._check_batch("read", slots, keys, buffers)
        return self._submit(self._read_task, slots, keys, views, IO_ERROR, "read")

    def close(self) -> None:
        """Finish the requests in flight, flush the files to disk, release the lock (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for fd in [*self._data_fds, self._index_fd]:
            if fd >= 0:
                try:
                    os.fdatasync(fd)
                except OSError as exc:
                    log.warning("disk tier at %s: flushing at close failed: %s", self.path, exc)
        self._release()

    def __repr__(self) -> str:
        return (
            f"DiskTier(path={self.path!r}, role={self.spec.role!r}, rank={self.spec.rank}, "
            f"num_slots={self.num_slots}, direct={self.direct})"
        )

    # ------------------------------------------------------------------ overridable file I/O

    def _pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> None:
        """Write ``buffers`` back to back at ``offset`` (every payload and record write)."""
        pwritev_all(fd, buffers, offset)

    def _preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> None:
        """Fill ``buffers`` back to back from ``offset`` (every payload and record read)."""
        preadv_all(fd, buffers, offset)

    def _write_records(self, first_slot: int, records: bytes) -> None:
        """Store the records of slots ``first_slot, first_slot + 1, ...`` (after their payloads)."""
        self._pwritev(self._index_fd, [memoryview(records)], first_slot * RECORD_BYTES)

    def _probe_direct(self, dir_fd: int) -> str | None:
        """``None`` if ``data-0.bin`` in ``dir_fd`` can be read with O_DIRECT, else why not."""
        try:
            fd = os.open("data-0.bin", os.O_RDONLY | os.O_DIRECT | _FILE_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            return f"opening with O_DIRECT failed: {exc.strerror}"
        try:
            os.preadv(fd, [aligned_buffer(ALIGN)], 0)
        except OSError as exc:
            return f"an aligned O_DIRECT read failed: {exc.strerror}"
        finally:
            os.close(fd)
        return None

    # ------------------------------------------------------------------ batches

    def _check_open(self, call: str, role: str) -> None:
        if self._closed:
            raise ClosedError("disk tier")
        if self.spec.role != role:
            raise ValidationError(
                "role", f"{call} needs the {role!r} role; this tier was opened as {self.spec.role!r}"
            )

    def _check_batch(
        self, call: str, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> tuple[list[int], list[bytes], list[memoryview]]:
        self._check_open(call, "io")
        n = len(slots)
        if len(keys) != n or len(buffers) != n:
            raise ValidationError(
                "keys", f"{n} slots, {len(keys)} keys and {len(buffers)} buffers: one each per slot"
            )
        slots = [check_int("slots", s, minimum=0, below=self.num_slots) for s in slots]
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
                    f"key {key[:8].hex()}... has {len(key)} bytes; "
                    f"the disk tier takes at most {MAX_KEY_BYTES}",
                )
        views = []
        for i, buffer in enumerate(buffers):
            try:
                view = memoryview(buffer).cast("B")
            except (TypeError, ValueError) as exc:
                raise ValidationError("buffers", f"buffer {i} is not a contiguous buffer: {exc}") from exc
            if view.nbytes != self.geometry.slot_bytes:
                raise ValidationError(
                    "buffers", f"buffer {i} has {view.nbytes} bytes; slots have {self.geometry.slot_bytes}"
                )
            if call == "read" and view.readonly:
                raise ValidationError("buffers", f"buffer {i} is read-only; a read fills it")
            views.append(view)
        return slots, keys, views

    def _plan(self, slots: list[int]) -> list[list[list[int]]]:
        """Tasks for the pool: each a list of runs, each run batch positions of ascending contiguous
        slots in one file. Tasks are at most ``CHUNK_BYTES`` and, for small batches, smaller, so
        that every thread gets a share."""
        stride, per_file = self.geometry.stride, self.geometry.slots_per_file
        share = -(-len(slots) * stride // self.options.io_threads)
        limit = max(1, min(CHUNK_BYTES, share) // stride)  # slots per task
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

    def _submit(
        self,
        work: Callable[..., None],
        slots: list[int],
        keys: list[bytes],
        views: list[memoryview],
        failed: Any,
        what: str,
    ) -> Future[Any]:
        results = [failed] * len(slots)  # a slot's outcome stays a failure unless its work succeeds
        outer: Future[Any] = Future()
        outer.set_running_or_notify_cancel()
        if not slots:
            outer.set_result(results)
            return outer
        tasks = self._plan(slots)
        errors: list[BaseException] = []
        remaining = [len(tasks)]
        lock = threading.Lock()

        def finished(future: Future[None]) -> None:
            exc = future.exception()
            if exc is not None:  # a bug, not the medium: keep its slots failed and say so
                log.error("disk tier at %s: a %s task failed", self.path, what, exc_info=exc)
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                if errors:
                    bad = sum(r is failed for r in results)
                    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
                    log.warning(
                        "disk tier at %s: %d of %d slots failed to %s: %s%s",
                        self.path,
                        bad,
                        len(results),
                        what,
                        errors[0],
                        more,
                    )
                outer.set_result(results)

        assert self._pool is not None
        for task in tasks:
            try:
                future = self._pool.submit(work, task, slots, keys, views, results, errors)
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

    def _write_task(
        self,
        runs: list[list[int]],
        slots: list[int],
        keys: list[bytes],
        views: list[memoryview],
        results: list[bool],
        errors: list[BaseException],
    ) -> None:
        for run in runs:
            first = slots[run[0]]
            buffers = [views[p] for p in run]
            try:
                crcs = [crc32c.crc32c(b) for b in buffers]  # from the caller's bytes, before they move
                self._move(first, buffers, write=True)
                records = b"".join(
                    pack_record(keys[p], self._digest, c) for p, c in zip(run, crcs, strict=True)
                )
                self._write_records(first, records)
            except OSError as exc:
                errors.append(exc)
                continue
            for p in run:
                results[p] = True

    def _read_task(
        self,
        runs: list[list[int]],
        slots: list[int],
        keys: list[bytes],
        views: list[memoryview],
        results: list[str | None],
        errors: list[BaseException],
    ) -> None:
        for run in runs:
            first = slots[run[0]]
            try:
                records = bytearray(len(run) * RECORD_BYTES)
                self._preadv(self._index_fd, [memoryview(records)], first * RECORD_BYTES)
                wanted: list[tuple[int, int]] = []  # (index in run, payload crc)
                for i, p in enumerate(run):
                    outcome, crc = check_record(
                        records[i * RECORD_BYTES : (i + 1) * RECORD_BYTES], keys[p], self._digest
                    )
                    if outcome is None:
                        wanted.append((i, crc))
                    else:
                        results[p] = outcome
                if not wanted:
                    continue
                lo, hi = wanted[0][0], wanted[-1][0]  # read only the span holding wanted blocks
                self._move(first + lo, [views[p] for p in run[lo : hi + 1]], write=False)
            except OSError as exc:
                errors.append(exc)
                continue
            for i, crc in wanted:
                p = run[i]
                results[p] = OK if crc32c.crc32c(views[p]) == crc else "corrupt"

    def _move(self, first: int, buffers: list[memoryview], *, write: bool) -> None:
        """Write or read the payloads of slots ``first, first + 1, ...`` in one request."""
        file, offset = self.geometry.locate(first)
        fd = self._data_fds[file]
        slot_bytes, stride = self.geometry.slot_bytes, self.geometry.stride
        transfer = self._pwritev if write else self._preadv
        if self.direct and (slot_bytes % ALIGN or not all(map(is_aligned, buffers))):
            bounce = self._bounce()
            if write:
                for i, b in enumerate(buffers):
                    bounce[i * stride : i * stride + slot_bytes] = b
            transfer(fd, [bounce[: len(buffers) * stride]], offset)
            if not write:
                for i, b in enumerate(buffers):
                    b[:] = bounce[i * stride : i * stride + slot_bytes]
        elif stride == slot_bytes:
            transfer(fd, buffers, offset)
        else:  # buffered: the padding between slots from (or into) a scratch buffer
            pad = self._pad()
            transfer(fd, [view for b in buffers for view in (b, pad)], offset)

    def _bounce(self) -> memoryview:
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            bounce = self._local.bounce = aligned_buffer(max(CHUNK_BYTES, self.geometry.stride))
        return bounce

    def _pad(self) -> memoryview:
        pad = getattr(self._local, "pad", None)
        if pad is None:
            pad = self._local.pad = memoryview(bytearray(self.geometry.stride - self.geometry.slot_bytes))
        return pad

    def _read_index(self, fd: int, start: int, n: int) -> np.ndarray:
        """Records ``start .. start + n`` of one rank as ``(n, 64)`` uint8 (zeros past the end of file)."""
        raw = np.zeros((n, RECORD_BYTES), np.uint8)
        view = memoryview(raw.reshape(-1))
        done = 0
        while done < view.nbytes:
            got = os.preadv(fd, [view[done:]], start * RECORD_BYTES + done)
            if got == 0:
                break
            done += got
        return raw

    # ------------------------------------------------------------------ opening the medium

    def _rank_dir(self, rank: int) -> str:
        return os.path.join(self.path, TREE, f"rank{rank}of{self.spec.world_size}")

    def _open_root(self) -> int:
        path = self.path
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            try:
                os.makedirs(path, mode=0o700, exist_ok=True)
                st = os.lstat(path)
            except OSError as exc:
                raise TierError("disk", path, f"cannot create the directory: {exc.strerror}") from exc
        if stat.S_ISLNK(st.st_mode):
            raise TierError(
                "disk",
                path,
                "is a symbolic link; give the real directory (a link could redirect kvhal's files)",
            )
        if not stat.S_ISDIR(st.st_mode):
            raise TierError("disk", path, "exists and is not a directory")
        if st.st_mode & stat.S_IWOTH:
            raise TierError(
                "disk",
                path,
                f"is world-writable (mode {stat.S_IMODE(st.st_mode):o}): any user could replace "
                "kvhal's files; use a directory others cannot write",
            )
        fd = os.open(path, _DIR_FLAGS)
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)
            raise TierError("disk", path, "was replaced while being opened")
        return fd

    def _open_dir(self, parent: int, name: str, where: str) -> int:
        """Open (creating, 0700) kvhal's own directory ``name`` in ``parent``; never through a link."""
        path = os.path.join(where, name)
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            why = "is a symbolic link" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else exc.strerror
            raise TierError("disk", path, f"cannot be used: {why}") from exc
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise TierError("disk", path, f"belongs to another user (uid {st.st_uid})")
        if st.st_mode & 0o077:  # kvhal's own directory: keep it private whatever happened to it
            os.fchmod(fd, 0o700)
        return fd

    def _open_file(self, dir_fd: int, name: str, flags: int, where: str) -> int:
        """Open kvhal's file ``name`` (created 0600 with ``O_CREAT``); never through a link."""
        path = os.path.join(where, name)
        try:
            fd = os.open(name, flags | _FILE_FLAGS, 0o600, dir_fd=dir_fd)
        except FileNotFoundError as exc:
            raise TierError("disk", path, "is missing; remove the directory it was in to start over") from exc
        except OSError as exc:
            why = "is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise TierError("disk", path, f"cannot be used: {why}") from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise TierError("disk", path, "is not a regular file")
        return fd

    def _take_lock(self) -> int:
        fd = self._open_file(self._tree_fd, "LOCK", os.O_RDWR | os.O_CREAT, os.path.join(self.path, TREE))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise TierError(
                "disk",
                self.path,
                f"in use by another engine (pid {holder}); stop it or give this engine another path",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _read_meta(self, dir_fd: int, where: str) -> dict[str, Any] | None:
        try:
            fd = os.open("meta.json", os.O_RDONLY | _FILE_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                meta = json.loads(f.read())
        except (OSError, ValueError) as exc:
            raise TierError(
                "disk",
                os.path.join(where, "meta.json"),
                f"is unreadable ({exc}); remove {where} to start over",
            ) from exc
        if not isinstance(meta, dict):
            raise TierError("disk", os.path.join(where, "meta.json"), f"is not a JSON object; remove {where}")
        return meta

    def _write_meta(self, dir_fd: int, rank: int) -> None:
        """Replace ``meta.json`` atomically (a reader sees the old or the new one, whole)."""
        text = meta_text(
            self.geometry, rank, self.spec.world_size, self.spec.fingerprint, self.spec.digest(rank)
        )
        temp = f"meta.json.{os.getpid()}.{threading.get_ident()}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _FILE_FLAGS, 0o600, dir_fd=dir_fd)
        try:
            os.write(fd, text)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, "meta.json", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)

    def _files(self) -> list[tuple[str, int]]:
        return [(f"data-{i}.bin", self.geometry.file_bytes(i)) for i in range(self.geometry.num_files)] + [
            ("index.bin", self.geometry.index_bytes)
        ]

    def _ensure_ranks(self, ranks: Sequence[int]) -> None:
        """Open each rank's directory; check a ready one's geometry, create and preallocate the others."""
        new: list[int] = []
        for rank in ranks:
            where = self._rank_dir(rank)
            fd = self._rank_fds[rank] = self._open_dir(
                self._tree_fd, os.path.basename(where), os.path.dirname(where)
            )
            meta = self._read_meta(fd, where)
            if meta is None:
                new.append(rank)
                continue
            wrong = meta_mismatches(meta, self.geometry)
            if wrong:
                raise TierError(
                    "disk",
                    where,
                    f"holds slots of another geometry ({'; '.join(wrong)}; "
                    f"bytes_to_use={self.options.bytes_to_use} and the slot size decide it); "
                    f"nothing was changed: use another path or remove {where}",
                )
            if self.spec.role == "index" and meta.get("digest") != self.spec.digest(rank).hex():
                self._write_meta(fd, rank)  # another KV from now on: say so for people reading the directory
        if not new:
            return
        missing = 0  # bytes still to allocate, counted before anything is created
        for rank in new:
            for name, size in self._files():
                try:
                    st = os.stat(name, dir_fd=self._rank_fds[rank], follow_symlinks=False)
                    missing += max(0, size - st.st_blocks * 512)
                except FileNotFoundError:
                    missing += size
        vfs = os.statvfs(self.path)
        free = vfs.f_bavail * vfs.f_frsize
        if missing > free:
            raise self._no_space(missing, free)
        for rank in new:
            for name, size in self._files():
                fd = self._open_file(self._rank_fds[rank], name, os.O_RDWR | os.O_CREAT, self._rank_dir(rank))
                try:
                    self._preallocate(fd, size)
                finally:
                    os.close(fd)
            self._write_meta(self._rank_fds[rank], rank)

    def _no_space(self, needed: int, free: int) -> ValidationError:
        return ValidationError(
            "bytes_to_use",
            f"{self.options.bytes_to_use} bytes do not fit at {self.path}: preallocating needs {needed} more "
            f"bytes and the file system has {free} free; lower bytes_to_use or free space",
        )

    def _preallocate(self, fd: int, size: int) -> None:
        if os.fstat(fd).st_size >= size:
            return
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                vfs = os.statvfs(self.path)
                raise self._no_space(size, vfs.f_bavail * vfs.f_frsize) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise TierError(
                    "disk", self.path, f"preallocating a data file failed: {exc.strerror}"
                ) from exc
            os.ftruncate(fd, size)  # no fallocate here: a sparse file, space taken as blocks arrive

    def _open_io(self) -> None:
        rank = self.spec.rank
        dir_fd, where = self._rank_fds[rank], self._rank_dir(rank)
        want = self.options.direct
        if want is not False:
            reason = self._probe_direct(dir_fd)
            if reason is not None and want is True:
                raise ValidationError(
                    "direct",
                    f'the file system at {self.path} does not take O_DIRECT ({reason}); use "auto" or false',
                )
            self.direct = reason is None
        flags = os.O_RDWR | (os.O_DIRECT if self.direct else 0)
        for name, size in self._files():
            fd = self._open_file(dir_fd, name, flags if name != "index.bin" else os.O_RDWR, where)
            if name == "index.bin":
                self._index_fd = fd
            else:
                self._data_fds.append(fd)
            if os.fstat(fd).st_size < size:
                raise TierError(
                    "disk", os.path.join(where, name), f"is shorter than its {size} bytes; remove {where}"
                )
        self._pool = ThreadPoolExecutor(self.options.io_threads, thread_name_prefix="kvhal-disk")

    def _release(self) -> None:
        """Close every descriptor (closing the lock's releases the flock)."""
        fds = [
            *self._data_fds,
            self._index_fd,
            *self._rank_fds.values(),
            self._tree_fd,
            self._root_fd,
            self._lock_fd,
        ]
        self._data_fds, self._rank_fds = [], {}
        self._index_fd = self._tree_fd = self._root_fd = self._lock_fd = -1
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
