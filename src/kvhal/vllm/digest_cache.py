"""The digests of a model's weight files, kept between starts in kvhal's own cache directory.

Reading every byte of a multi-GB model costs seconds to minutes; a restart on the same files
should not pay it again. A file's digest is kept under the file's identity: its resolved path,
device, inode, size, ``mtime_ns`` and ``ctime_ns``. Any write to the file changes its
``ctime`` (which no user can set back), so a file changed in place, even with its ``mtime``
restored, is read again; so is a file replaced by another (another inode).

Where: ``$KVHAL_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvhal``, else ``~/.cache/kvhal``; its
``weights/`` directory (made 0700), one JSON file per model path (``<16 hex>.json``, 0600),
replaced atomically. A directory other users could write (another owner, group- or
world-writable) is not used: a planted digest would name new weights as old ones, so the
digests are then computed at every start, with one warning.

Bounded: a file of at most :data:`MAX_FILE_BYTES` is read, at most :data:`MAX_ENTRIES` entries
a model, at most :data:`MAX_MODELS` models (the least recently written go). Never pickle:
JSON, every field checked, and each entry carries a checksum of its fields, so a damaged entry
(a flipped digit) is ignored and its file read again; a file that is not this format is ignored
and rewritten.

While one process reads a model's files, the others starting on it (an engine's scheduler and
its workers) wait for its ``.lock`` (``flock``) and then take its digests, at most until a
deadline; past it they read the files themselves.
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
import time
from collections.abc import Iterator, Mapping
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import blake3

from kvhal import env

__all__ = ["DigestCache", "FileId", "cache_dir"]

log = logging.getLogger("vllm." + __name__)  # under "vllm": its handlers and level

FORMAT = 1
MAX_FILE_BYTES = 16 << 20
MAX_ENTRIES = 65536
MAX_MODELS = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class FileId:
    """What a file is now, for its digest kept between starts (see the module)."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> FileId:
        """The identity of ``path``'s file now (through links: a hub snapshot's files are links)."""
        resolved = os.path.realpath(path)
        st = os.stat(resolved)
        return cls.from_stat(resolved, st)

    @classmethod
    def from_stat(cls, resolved: str, st: os.stat_result) -> FileId:
        return cls(resolved, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def cache_dir() -> Path:
    """kvhal's cache directory (``KVHAL_CACHE_DIR``, ``$XDG_CACHE_HOME/kvhal``, ``~/.cache/kvhal``)."""
    chosen = env.read("KVHAL_CACHE_DIR")
    if chosen:
        return Path(chosen)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg if xdg and os.path.isabs(xdg) else Path.home() / ".cache") / "kvhal"


def _check(entry: FileId, digest: str) -> str:
    return blake3.blake3(json.dumps([*astuple(entry), digest]).encode()).hexdigest(length=8)


class DigestCache:
    """The digests kept in ``directory/weights`` (default :func:`cache_dir`), one file per model.

    Every failure to read or write is a cache miss, never an error: at worst the files are read.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else cache_dir()
        self.where = self.directory / "weights"
        self._fd: int | None = None
        self._opened = False
        self._mutex = threading.Lock()

    def _dir(self) -> int | None:
        """The weights directory's descriptor, made on first use; ``None`` where it cannot be used."""
        with self._mutex:
            if not self._opened:
                self._opened = True
                self._fd = self._open_dir()
            return self._fd

    def _open_dir(self) -> int | None:
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.where, 0o700)
            fd = os.open(self.where, _DIR_FLAGS)
        except OSError as exc:
            _warn_once(f"kvhal: no cache of weight digests at {self.where} ({exc}): each start reads them")
            return None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            os.close(fd)
            _warn_once(
                f"kvhal: {self.where} is not a directory only this user writes (uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):o}): its weight digests are not trusted, each start reads "
                "the weights; set KVHAL_CACHE_DIR to a private directory"
            )
            return None
        return fd

    def close(self) -> None:
        with self._mutex:
            if self._fd is not None:
                os.close(self._fd)
            self._fd, self._opened = None, False

    @staticmethod
    def name(model: str) -> str:
        """The stem of ``model``'s (a resolved path) files in the cache."""
        return blake3.blake3(model.encode()).hexdigest(length=8)

    def load(self, model: str) -> dict[FileId, str]:
        """The digests kept for ``model``'s files (every entry checked; damaged ones left out)."""
        fd = self._dir()
        if fd is None:
            return {}
        raw = _read_bounded(fd, self.name(model) + ".json")
        if raw is None:
            return {}
        try:
            record = json.loads(raw)
            if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("model") != model:
                raise ValueError("not a cache of this model's digests")
            entries = record.get("files")
            if not isinstance(entries, list):
                raise ValueError("no list of files")
        except ValueError as exc:
            log.info(
                "kvhal: weight digests of %s in %s ignored (%s); they are rewritten", model, self.where, exc
            )
            return {}
        found: dict[FileId, str] = {}
        damaged = 0
        for item in entries[:MAX_ENTRIES]:
            parsed = _entry(item)
            if parsed is None:
                damaged += 1
            else:
                found[parsed[0]] = parsed[1]
        if damaged:
            log.info(
                "kvhal: %d damaged weight digest(s) of %s ignored: those files are read again", damaged, model
            )
        return found

    def store(self, model: str, digests: Mapping[FileId, str]) -> None:
        """Keep ``digests`` as ``model``'s (only these: entries of files gone or changed go)."""
        fd = self._dir()
        if fd is None:
            return
        files = [
            {**{k: v for k, v in zip(FIELDS, astuple(i), strict=True)}, "digest": d, "check": _check(i, d)}
            for i, d in list(digests.items())[:MAX_ENTRIES]
        ]
        text = json.dumps({"format": FORMAT, "model": model, "files": files}, indent=0).encode()
        name = self.name(model) + ".json"
        temp = f".{name}.{os.getpid()}.{threading.get_ident()}"
        try:
            out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _FILE_FLAGS, 0o600, dir_fd=fd)
            try:
                os.write(out, text)
                os.fsync(out)
            finally:
                os.close(out)
            os.replace(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=fd)
            _warn_once(f"kvhal: weight digests not kept in {self.where} ({exc}): the next start reads them")
            return
        _prune(fd, keep=name)

    @contextlib.contextmanager
    def reading(self, model: str, wait_s: float) -> Iterator[bool]:
        """Hold ``model``'s lock while its files are read: ``True`` once held, ``False`` where there is
        no cache or another process held it ``wait_s`` seconds (the caller then reads them anyway)."""
        fd = self._dir()
        lock = -1
        if fd is not None:
            with contextlib.suppress(OSError):
                lock = os.open(
                    self.name(model) + ".lock", os.O_RDWR | os.O_CREAT | _FILE_FLAGS, 0o600, dir_fd=fd
                )
        try:
            yield lock >= 0 and _flock(lock, wait_s, model)
        finally:
            if lock >= 0:
                os.close(lock)  # releases the flock


FIELDS = ("path", "dev", "ino", "size", "mtime_ns", "ctime_ns")


def _entry(item: Any) -> tuple[FileId, str] | None:
    """``(identity, digest)`` of one kept entry, or ``None`` where it is not what kvhal wrote."""
    if not isinstance(item, dict):
        return None
    path, digest = item.get("path"), item.get("digest")
    numbers = [item.get(k) for k in FIELDS[1:]]
    if not isinstance(path, str) or any(type(n) is not int or n < 0 for n in numbers):
        return None
    if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX:
        return None
    identity = FileId(path, *numbers)
    if item.get("check") != _check(identity, digest):
        return None
    return identity, digest


def _read_bounded(dir_fd: int, name: str) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None  # none yet (or a link, which is never followed)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
            log.info(
                "kvhal: weight digests file %s ignored (not a regular file of at most %d bytes)",
                name,
                MAX_FILE_BYTES,
            )
            return None
        return os.pread(fd, MAX_FILE_BYTES + 1, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


def _prune(dir_fd: int, keep: str) -> None:
    """At most :data:`MAX_MODELS` models' files: the least recently written go (their locks
    with them, where no process holds one)."""
    try:
        kept = []
        stale = time.time_ns() - 3600 * 10**9  # a temporary file an hour old: its writer died
        for name in os.listdir(dir_fd):
            mtime = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime_ns
            if name.startswith(".") and mtime < stale:
                os.unlink(name, dir_fd=dir_fd)
            elif name.endswith(".json") and not name.startswith(".") and name != keep:
                kept.append((mtime, name))
        kept.sort()
        for _, name in kept[: max(0, len(kept) - (MAX_MODELS - 1))]:
            os.unlink(name, dir_fd=dir_fd)
            _remove_unheld_lock(dir_fd, name[: -len(".json")] + ".lock")
    except OSError:
        pass  # another process pruned meanwhile: the next store does it


def _remove_unheld_lock(dir_fd: int, name: str) -> None:
    try:
        fd = os.open(name, os.O_RDWR | _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass  # held: that model is being read now
    finally:
        os.close(fd)


def _flock(fd: int, wait_s: float, model: str) -> bool:
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
        if time.monotonic() >= deadline:
            log.warning(
                "kvhal: another process has read %s's weights for %.0f s; this one reads them too",
                model,
                wait_s,
            )
            return False
        if not said:
            said = True
            log.info("kvhal: another process is reading %s's weights; waiting for its digests", model)
        time.sleep(0.05)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)
