"""The built-in ``disk`` tier backend: KV blocks in preallocated files on a local disk.

Its options (``TierSpec.options``: ``path``, ``bytes_to_use``, ``io_threads``,
``direct``) and the files it keeps are described in :mod:`kvhal.tiers.disk.directory`.

Durability: a write stores the payload, then its record; nothing is synced
per block (the data files are ``fdatasync``-ed on :meth:`DiskTier.close`). A
crash of the process loses nothing the kernel accepted. A crash between payload
and record leaves the old record over new bytes, whose crc then mismatches. A
power loss may lose recent blocks or leave such mismatches, but every read
verifies the record and the payload's crc, so a torn or stale block reads as
``"corrupt"`` or ``"missing"`` (the engine recomputes it), never as wrong KV.

Threading: :meth:`~DiskTier.write` and :meth:`~DiskTier.read` validate their
arguments, cut the batch into runs of contiguous slots of at most a few MiB
and hand them to a pool of ``io_threads`` threads (one pool for reads, one for writes, so
that a read does not queue behind writes); the returned future
completes when all are done. Failures are per slot and never raised from the
future; they are logged once per batch.

Tests inject faults by subclassing: every file access goes through
:meth:`DiskTier._pwritev`, :meth:`DiskTier._preadv`,
:meth:`DiskTier._write_records` and :meth:`DiskTier._probe_direct`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import crc32c

from kvhal.errors import ClosedError, TierError, ValidationError, check_int
from kvhal.threads import named_pool
from kvhal.tiers.backend import IO_ERROR, OK, TierBackend, TierSpec
from kvhal.tiers.disk.batches import Work, check_batch, submit_batch
from kvhal.tiers.disk.directory import FILE_FLAGS, DiskOptions, open_dir, open_file, open_root
from kvhal.tiers.disk.format import ALIGN, RECORD_BYTES, TREE, Geometry, check_record, pack_record
from kvhal.tiers.disk.io import aligned_buffer, is_aligned, plan_tasks, preadv_all, pwritev_all
from kvhal.tiers.disk.lock import LockWaiter, try_lock, wait_lock
from kvhal.tiers.disk.namespaces import budget_lock, namespace_name, recorded_size, size_namespace
from kvhal.tiers.disk.ranks import ensure_ranks, rank_dir, rank_files
from kvhal.tiers.disk.recovery import recover_slots

__all__ = ["DiskTier"]

log = logging.getLogger(__name__)

#: Largest single request: big enough for the disk's full bandwidth, small
#: enough that a batch becomes several requests in flight.
CHUNK_BYTES = 4 << 20


class DiskTier(TierBackend):
    """Slots in preallocated files under ``spec.options["path"]``.

    :raises ValidationError: an option is wrong (names it), or the disk has too
        little free space for ``bytes_to_use``.
    :raises TierError: the path is unsafe (a symbolic link; under a world-writable one, a
        ``kvhal-<uid>`` that is not kvhal's), another engine holds it past ``lock_wait_s``
        (:mod:`kvhal.tiers.disk.lock`). A ``meta.json`` or ``namespace.json`` that disagrees
        with the tier's other records is damage: that rank (or namespace) starts empty.
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
        self._root_fd = self._tree_fd = self._ns_fd = self._lock_fd = self._index_fd = -1
        self._rank_fds: dict[int, int] = {}
        self._data_fds: list[int] = []
        self._pools: dict[str, ThreadPoolExecutor] = {}  # "read", "write"
        self._local = threading.local()
        #: Whether the tier serves: False while the ``index`` role waits for another engine's
        #: lock on a thread (``spec.defer``); :attr:`lock_waiter` says how that went.
        self.ready = True
        self.lock_waiter: LockWaiter | None = None
        self._recovered: tuple[list[int], list[bytes]] | None = None  # read on the waiter's thread
        try:
            self._root_fd, self.path = open_root(self.path)
            tree = os.path.join(self.path, TREE)
            #: This model's directory under the path (:mod:`kvhal.tiers.disk.namespaces`).
            self.namespace = os.path.join(tree, namespace_name(spec))
            self._tree_fd = open_dir(self._root_fd, TREE, self.path)
            self._ns_fd = open_dir(self._tree_fd, os.path.basename(self.namespace), tree)
            ranks = range(world_size) if spec.role == "index" else [spec.rank]
            if spec.role == "index":
                self._lock_fd, holder = try_lock(self._ns_fd, self.namespace)
                if holder is not None and self._defer(holder):
                    return
                if holder is not None:
                    wait_lock(self._lock_fd, holder, self.path, self.options.lock_wait_s)
            self._open_namespace(ranks)
            if spec.role == "io":
                self._open_io()
        except OSError as exc:  # the file system failed (EIO, ENOSPC, ...): a clear error at start
            self._release()
            raise TierError("disk", self.path, f"cannot be opened: {exc.strerror or exc}") from exc
        except BaseException:
            self._release()
            raise

    def _open_namespace(self, ranks: Sequence[int]) -> None:
        """Size the model's namespace (new ones: made) and open ``ranks``' directories."""
        spec, world_size = self.spec, self.spec.world_size
        tree = os.path.dirname(self.namespace)

        def make(size: int) -> None:
            self.geometry = Geometry.plan(spec.slot_bytes, size // world_size)
            self.num_slots = self.geometry.num_slots
            if self.num_slots < 1:
                raise TierError("disk", self.namespace, f"was made with {size} bytes, less than a slot")
            ensure_ranks(
                spec,
                self.geometry,
                self._ns_fd,
                self.namespace,
                ranks,
                self._rank_fds,
                self.options.bytes_to_use,
                self.path,
            )

        with budget_lock(self._tree_fd, tree):
            size_namespace(
                spec, self._tree_fd, self._ns_fd, self.namespace, self.path, self.options.bytes_to_use, make
            )

    def _defer(self, holder: str) -> bool:
        """With ``spec.defer``, wait for ``holder``'s lock on a thread: not :attr:`ready` until then.

        Only where the namespace's size is recorded (its slots are then known now, and stay
        what the waiter opens); else False, and the caller waits here. Once the lock is taken,
        the waiter opens the namespace and reads its index (what the engine before left) for
        :meth:`recover`, then sets :attr:`ready`; where that fails, it lets the lock go.
        """
        if not self.spec.defer or self.options.lock_wait_s == 0:
            return False
        with budget_lock(self._tree_fd, os.path.dirname(self.namespace)):
            size = recorded_size(self.spec, self._ns_fd, self.namespace)
        if size is None:
            return False
        self.geometry = Geometry.plan(self.spec.slot_bytes, size // self.spec.world_size)
        self.num_slots = self.geometry.num_slots
        if self.num_slots < 1:
            return False
        self.ready = False

        announced = self.num_slots

        def on_taken() -> None:
            if self._closed:
                return
            try:
                self._open_namespace(range(self.spec.world_size))
                if self.num_slots != announced:  # remade meanwhile: the chain's index has the old count
                    raise TierError(
                        "disk", self.namespace, f"now has {self.num_slots} slots, not {announced}"
                    )
                self._recovered = self._read_index(None)
            except BaseException:
                self._release()  # never ready: the lock goes to whoever waits next
                raise
            self.ready = True  # after the index is read: a reader of ready finds it there

        self.lock_waiter = LockWaiter(self._lock_fd, holder, self.path, self.options.lock_wait_s, on_taken)
        return True

    @property
    def ready_error(self) -> BaseException | None:  # type: ignore[override] - the contract's attribute
        """Why the tier never becomes :attr:`ready`: its wait for the lock gave up or failed."""
        waiter = self.lock_waiter
        return None if self.ready or waiter is None else waiter.error

    # ------------------------------------------------------------------ the chain's calls

    def recover(self, progress: Callable[[int, int], None] | None = None) -> tuple[list[int], list[bytes]]:
        """The slots holding a block of this fingerprint in every rank, with the same key in each.

        Records of another fingerprint, rank or format, damaged records and
        slots whose ranks disagree are left out (the chain overwrites them).
        """
        self._check_open("recover", "index")
        if not self.ready:
            raise TierError(
                "disk",
                self.path,
                "recover() before the tier is ready: another engine holds its lock (poll ready)",
            )
        if self._recovered is not None:  # read when the lock came (a deferred tier)
            found, self._recovered = self._recovered, None
            return found
        return self._read_index(progress)

    def _read_index(self, progress: Callable[[int, int], None] | None) -> tuple[list[int], list[bytes]]:
        try:
            return self._recover(progress)
        except OSError as exc:  # a cache: what cannot be read is not offered, and the tier serves
            log.warning(
                "kvhal: disk tier at %s: reading its index failed (%s); it starts empty", self.path, exc
            )
            return [], []

    def _recover(self, progress: Callable[[int, int], None] | None) -> tuple[list[int], list[bytes]]:
        ranks = range(self.spec.world_size)
        return recover_slots(
            [(self._rank_fds[r], self._rank_dir(r)) for r in ranks],
            [self.spec.digest(r) for r in ranks],
            self.num_slots,
            progress,
        )

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
        if self.lock_waiter is not None:
            self.lock_waiter.cancel()
        for pool in self._pools.values():
            pool.shutdown(wait=True)
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
            fd = os.open("data-0.bin", os.O_RDONLY | os.O_DIRECT | FILE_FLAGS, dir_fd=dir_fd)
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
        return check_batch(call, slots, keys, buffers, self.num_slots, self.geometry.slot_bytes)

    def _submit(
        self, work: Work, slots: list[int], keys: list[bytes], views: list[memoryview], failed: Any, what: str
    ) -> Future[Any]:
        tasks = plan_tasks(slots, self.geometry, self.options.io_threads, CHUNK_BYTES) if slots else []
        return submit_batch(self._pools[what], work, tasks, slots, keys, views, failed, what, self.path)

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

    # ------------------------------------------------------------------ opening the medium

    def _rank_dir(self, rank: int) -> str:
        return rank_dir(self.namespace, rank, self.spec.world_size)

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
        for name, size in rank_files(self.geometry):
            fd = open_file(dir_fd, name, flags if name != "index.bin" else os.O_RDWR, where)
            if name == "index.bin":
                self._index_fd = fd
            else:
                self._data_fds.append(fd)
            if os.fstat(fd).st_size < size:
                raise TierError(
                    "disk", os.path.join(where, name), f"is shorter than its {size} bytes; remove {where}"
                )
        # Reads have threads of their own: a lookup waits for its read, and in one queue it
        # waited behind the write-throughs of every store before it.
        self._pools = {
            what: named_pool(self.options.io_threads, f"kvhal-disk-{what}") for what in ("read", "write")
        }

    def _release(self) -> None:
        """Close every descriptor (closing the lock's releases the flock)."""
        fds = [
            *self._data_fds,
            self._index_fd,
            *self._rank_fds.values(),
            self._ns_fd,
            self._tree_fd,
            self._root_fd,
            self._lock_fd,
        ]
        self._data_fds, self._rank_fds = [], {}
        self._index_fd = self._ns_fd = self._tree_fd = self._root_fd = self._lock_fd = -1
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
