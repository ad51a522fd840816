"""Where the disk tier keeps its blocks: its options, and its directory opened safely.

Options (``TierSpec.options``):

- ``path`` (str, required): a directory; created (mode 0700) if missing. An
  existing one must be a real directory (not a symbolic link). Where other users can write it
  (world-writable: an ``emptyDir``, a fresh volume's mount point, ``/tmp``), kvhal keeps its
  files in a private directory of its own under it, ``kvhal-<uid>`` (0700, this user's; one
  that is not, or is a link, is refused).
- ``bytes_to_use`` (int, required): disk space for everything kvhal keeps under ``path``
  (models share it: see :mod:`kvhal.tiers.disk.namespaces`); of its model's share, each
  tensor-parallel rank gets ``1 / world_size``, as many whole slots
  as fit (a slot takes its size rounded up to 4 KiB plus a 64-byte record).
  Preallocated when the tier opens, so a full disk is an error at start-up
  naming the free bytes, never a failure mid-run.
- ``io_threads`` (int, default 8): requests in flight per worker, for reads and for writes each.
- ``direct`` (``"auto"`` default, ``True``, ``False``): read and write the data
  files with ``O_DIRECT``, bypassing the page cache (so a read really comes from
  the disk, and stored blocks do not push the engine's memory out of the page
  cache). ``"auto"`` uses it where the file system accepts an aligned O_DIRECT
  read (ext4, xfs; tmpfs since Linux 6.6); ``True`` makes a file system without
  it an error. Buffers that are not 4 KiB-aligned go through per-thread bounce
  buffers.
- ``lock_wait_s`` (int, default 60): how long the scheduler waits for another engine of the
  model to release ``LOCK`` (an engine being replaced, draining) before failing
  (:mod:`kvhal.tiers.disk.lock`); 0 fails at once.
  A caller that serves without the tier while it waits opens it with ``TierSpec.defer`` (not
  an option: the scheduler side of vLLM does): the ``index`` role then opens at once, not
  ``ready``, and takes the lock on a thread (:class:`~kvhal.tiers.disk.tier.DiskTier`).

What it writes, under ``<path>/kvhal-tier-v1/`` (directories 0700, files 0600,
all opened relative to directory descriptors with ``O_NOFOLLOW``; keys never
become file names), one directory per model (``m-<digest>/``, its size recorded in
``namespace.json``: :mod:`kvhal.tiers.disk.namespaces`), holding:

- ``LOCK``: held with ``flock`` by the engine's scheduler (``role="index"``)
  while open, holding its pid; a second engine of the model on the same path waits up to
  ``lock_wait_s`` for it, then is refused.
  Workers (``role="io"``) do not lock: they belong to the engine holding it.
- ``rank{r}of{n}/meta.json``: the slot geometry (checked on every open against the
  namespace's size) and, for people, the fingerprint of the KV it holds. A damaged one (not a
  regular file, unreadable, not kvhal's JSON, or a geometry the namespace's size and the
  rank's files disagree with: no setting can cause that, :mod:`kvhal.tiers.disk.ranks`)
  starts the rank empty, with one warning.
- ``rank{r}of{n}/data-{i}.bin``: the payloads, file-major (see
  :class:`~kvhal.tiers.disk.format.Geometry`): ascending slots are contiguous,
  so a run of them moves in one request.
- ``rank{r}of{n}/index.bin``: one 64-byte record per slot (key, fingerprint
  digest, payload crc32c, its own crc32c; :mod:`kvhal.tiers.disk.format`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhal.errors import TierError, ValidationError, check_int
from kvhal.tiers.disk.format import RECORD_BYTES

log = logging.getLogger(__name__)

__all__ = [
    "DamagedMeta",
    "DiskOptions",
    "clear_rank",
    "damaged_files",
    "open_dir",
    "open_file",
    "open_root",
    "preallocate",
    "read_meta",
    "write_meta",
]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: O_NONBLOCK: a FIFO put in place of a file must not block its open (no effect on regular files)
FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_OPTIONS = ("path", "bytes_to_use", "io_threads", "direct", "lock_wait_s")
#: The private directory kvhal keeps under a world-writable path (one per user).
PRIVATE_DIR = "kvhal-{uid}"
#: The default of ``lock_wait_s``: more than a pod's default termination grace period (30 s).
LOCK_WAIT_S = 60


@dataclass(frozen=True)
class DiskOptions:
    """The ``disk`` tier's options, validated (the module docstring describes them)."""

    path: str
    bytes_to_use: int
    io_threads: int = 8
    direct: bool | str = "auto"
    lock_wait_s: int = LOCK_WAIT_S

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
            lock_wait_s=check_int("lock_wait_s", options.get("lock_wait_s", LOCK_WAIT_S), minimum=0),
        )


def open_root(path: str) -> tuple[int, str]:
    """Open ``path`` (creating it, 0700), a real directory; where other users can write it, the
    private directory kvhal keeps under it instead (:data:`PRIVATE_DIR`). The descriptor and the
    directory's path."""
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
    fd = _open_checked(path, st)
    if not st.st_mode & stat.S_IWOTH:
        return fd, path
    # Any user could replace kvhal's files here: a directory of this user's own, opened
    # relative to the parent's descriptor without following a link, is what kvhal uses.
    try:
        return _open_private(fd, path, st)
    finally:
        os.close(fd)


def _open_checked(path: str, st: os.stat_result) -> int:
    fd = os.open(path, DIR_FLAGS)
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise TierError("disk", path, "was replaced while being opened")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_private(parent: int, path: str, st: os.stat_result) -> tuple[int, str]:
    name = PRIVATE_DIR.format(uid=os.geteuid())
    where = os.path.join(path, name)
    fd = _make_dir(parent, name, where)
    try:
        mine = os.fstat(fd)
        if mine.st_uid != os.geteuid() or stat.S_IMODE(mine.st_mode) & 0o077:
            # another user made it, or it was opened up: what is in it cannot be trusted
            raise TierError(
                "disk",
                where,
                f"is not kvhal's private directory (uid {mine.st_uid}, mode "
                f"{stat.S_IMODE(mine.st_mode):o}; kvhal makes it 0700 as uid {os.geteuid()}); "
                "remove it, or give a path other users cannot write",
            )
    except BaseException:
        os.close(fd)
        raise
    if where not in _SAID_PRIVATE:
        _SAID_PRIVATE.add(where)
        log.info(
            "kvhal: disk tier: %s is world-writable (mode %o); kvhal keeps its files in %s (0700)",
            path,
            stat.S_IMODE(st.st_mode),
            where,
        )
    return fd, where


#: The private directories already logged (the scheduler and each worker open the path).
_SAID_PRIVATE: set[str] = set()


def open_dir(parent: int, name: str, where: str) -> int:
    """Open (creating, 0700) kvhal's own directory ``name`` in ``parent``; never through a link."""
    path = os.path.join(where, name)
    fd = _make_dir(parent, name, path)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise TierError("disk", path, f"belongs to another user (uid {st.st_uid})")
        if st.st_mode & 0o077:  # kvhal's own directory: keep it private whatever happened to it
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_dir(parent: int, name: str, path: str) -> int:
    """Make directory ``name`` in ``parent`` (0700) unless it is there, and open it; never
    through a link (``path`` names it in errors)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent)
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        why = "is a symbolic link" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else exc.strerror
        raise TierError("disk", path, f"cannot be used: {why}") from exc


def open_file(dir_fd: int, name: str, flags: int, where: str) -> int:
    """Open kvhal's file ``name`` (created 0600 with ``O_CREAT``); never through a link."""
    path = os.path.join(where, name)
    try:
        fd = os.open(name, flags | FILE_FLAGS, 0o600, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise TierError("disk", path, "is missing; remove the directory it was in to start over") from exc
    except OSError as exc:
        why = "is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise TierError("disk", path, f"cannot be used: {why}") from exc
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        raise TierError("disk", path, "is not a regular file")
    return fd


class DamagedMeta(Exception):
    """A rank's ``meta.json`` or files cannot be what kvhal wrote (the message says why):
    the rank starts empty."""


#: The most bytes a ``meta.json`` may have (kvhal's are well under 4 KiB).
META_MAX_BYTES = 64 << 10


def read_meta(dir_fd: int, where: str, name: str = "meta.json") -> dict[str, Any] | None:
    """The rank's ``meta.json`` (or another of kvhal's JSON files, ``name``), or ``None`` if there is none.

    Opened without following a link and without blocking (a FIFO put in its place would
    block a plain open forever), and read only if it is a regular file of bounded size.

    :raises DamagedMeta: it is not a regular file, unreadable, too large, or not a JSON object.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
        raise DamagedMeta(f"{name} {why}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DamagedMeta(f"{name} is not a regular file")
        if st.st_size > META_MAX_BYTES:
            raise DamagedMeta(f"{name} has {st.st_size} bytes, more than kvhal ever writes")
        meta = json.loads(os.pread(fd, META_MAX_BYTES + 1, 0))
    except (OSError, ValueError) as exc:
        raise DamagedMeta(f"{name} is unreadable ({exc})") from exc
    finally:
        os.close(fd)
    if not isinstance(meta, dict):
        raise DamagedMeta(f"{name} is not a JSON object")
    return meta


def damaged_files(dir_fd: int, files: list[tuple[str, int]]) -> str | None:
    """Why a rank's ``(name, size)`` files cannot be what kvhal preallocated, or ``None``:
    one is missing, not a regular file (a FIFO, a directory, a link), or shorter."""
    for name, size in files:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return f"{name} is missing"
        if not stat.S_ISREG(st.st_mode):
            return f"{name} is not a regular file"
        if st.st_size < size:
            return f"{name} has {st.st_size} bytes, not {size}"
    return None


def clear_rank(dir_fd: int, where: str) -> None:
    """Remove every file of a rank's directory (whatever kind each is), to start it empty.

    :raises TierError: one cannot be removed (a permission: the operator's to fix).
    """
    for name in os.listdir(dir_fd):
        try:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except IsADirectoryError:
                shutil.rmtree(os.path.join(where, name))  # never follows the links inside
        except OSError as exc:
            raise TierError("disk", os.path.join(where, name), f"cannot be removed: {exc.strerror}") from exc


def write_meta(dir_fd: int, text: bytes, name: str = "meta.json") -> None:
    """Replace ``meta.json`` (or ``name``) atomically (a reader sees the old or the new one, whole)."""
    temp = f"{name}.{os.getpid()}.{threading.get_ident()}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | FILE_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        try:
            os.write(fd, text)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)  # no half-written temporary left beside the files
        raise
    os.fsync(dir_fd)


def no_space(bytes_to_use: int, path: str, needed: int, free: int) -> ValidationError:
    """The error of ``bytes_to_use`` that does not fit at ``path``."""
    return ValidationError(
        "bytes_to_use",
        f"{bytes_to_use} bytes do not fit at {path}: preallocating needs {needed} more "
        f"bytes and the file system has {free} free; lower bytes_to_use or free space",
    )


def free_bytes(path: str) -> int:
    """Bytes an unprivileged user may still allocate on ``path``'s file system."""
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize


def preallocate(fd: int, size: int, bytes_to_use: int, path: str) -> None:
    """Allocate ``size`` bytes of ``fd`` now (sparse where the file system cannot), so that a full
    disk is an error at start-up, never a failure mid-run."""
    if os.fstat(fd).st_size >= size:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise no_space(bytes_to_use, path, size, free_bytes(path)) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise TierError("disk", path, f"preallocating a data file failed: {exc.strerror}") from exc
        os.ftruncate(fd, size)  # no fallocate here: a sparse file, space taken as blocks arrive


def read_records(fd: int, start: int, n: int) -> np.ndarray:
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
