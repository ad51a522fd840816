"""One disk path, many models: a namespace per model under the tree, and the byte budget they share.

Under ``<path>/kvhal-tier-v1/``, each model (its KV fingerprint, tensor-parallel size and
slot size) keeps its blocks in a directory of its own, ``m-<16 hex digits>/``, so an engine
never reads, overwrites or deletes another model's blocks:

- ``namespace.json``: the bytes the namespace was given when it was made, the
  ``bytes_to_use`` asked then, and, for people, the fingerprint. Every opener (the
  scheduler, each worker) takes the size from it, so all agree on the slots. A size that no
  rank there was made with (neither a rank's ``meta.json`` nor its preallocated files agree:
  a flipped digit) is damage: the namespace starts empty, with one warning.
- ``LOCK``: the engine using the namespace (a second engine of the same model is refused).
- ``rank{r}of{n}/``: each rank's files (:mod:`kvhal.tiers.disk.directory`).

``BUDGET`` in the tree is locked (with a deadline) while a namespace is sized, made or
migrated, so two engines starting at once cannot both spend the same bytes.

The budget: ``bytes_to_use`` bounds everything kvhal keeps under the path. A new namespace
gets ``bytes_to_use`` less what the other namespaces hold (their recorded size, or the bytes
their files take where they have none), never another model's bytes; none left is an error at
start naming them. A namespace keeps its size when reopened (an existing cache is never refused
because another model joined later); one larger than the engine's ``bytes_to_use`` is an error
at start, nothing changed.

Rank directories at the top of the tree were written by kvhal before namespaces; those of
this model and size are moved into its namespace (a restart keeps its cache), others are
left alone and counted against the budget.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvhal.errors import TierError, ValidationError
from kvhal.tiers.backend import TierSpec
from kvhal.tiers.disk.directory import (
    DIR_FLAGS,
    DamagedMeta,
    clear_rank,
    open_file,
    read_meta,
    write_meta,
)
from kvhal.tiers.disk.format import RECORD_BYTES, Geometry, meta_mismatches
from kvhal.tiers.disk.ranks import rank_files

__all__ = ["NAMESPACE_FILE", "budget_lock", "namespace_name", "recorded_size", "size_namespace"]

log = logging.getLogger(__name__)

NAMESPACE_FILE = "namespace.json"
NAMESPACE_VERSION = 1
#: How long an engine waits for another to finish sizing its namespace (seconds).
BUDGET_WAIT_S = 30.0
_LEGACY_RANK = re.compile(r"rank(\d+)of(\d+)")


def namespace_name(spec: TierSpec) -> str:
    """The directory of ``spec``'s model: its fingerprint, tensor-parallel size and slot size."""
    whole = {"kv": spec.fingerprint, "world_size": spec.world_size, "slot_bytes": spec.slot_bytes}
    text = json.dumps(whole, sort_keys=True, separators=(",", ":"), default=str)
    return "m-" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@contextlib.contextmanager
def budget_lock(tree_fd: int, where: str, wait_s: float | None = None) -> Iterator[None]:
    """Hold the tree's ``BUDGET`` lock, waiting at most ``wait_s`` (:data:`BUDGET_WAIT_S`) for another
    engine's."""
    wait_s = BUDGET_WAIT_S if wait_s is None else wait_s
    fd = open_file(tree_fd, "BUDGET", os.O_RDWR | os.O_CREAT, where)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TierError(
                        "disk",
                        os.path.join(where, "BUDGET"),
                        f"another engine held it for {wait_s:.0f} s while sizing its cache; "
                        "is a process stuck on this disk?",
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the flock


def size_namespace(
    spec: TierSpec,
    tree_fd: int,
    ns_fd: int,
    where: str,
    path: str,
    bytes_to_use: int,
    make: Callable[[int], None],
) -> int:
    """The bytes of ``spec``'s namespace (``ns_fd``, at ``where``); call it holding
    :func:`budget_lock`. ``make(size)`` opens (and, where new, creates) the namespace's files; the
    size of a new one is recorded only once they are made, so a failure records nothing.

    :raises ValidationError: ``bytes_to_use`` cannot hold this namespace (beside the others,
        for a new one); the message names them, and nothing is changed.
    """
    try:
        meta = read_meta(ns_fd, where, NAMESPACE_FILE)
        if meta is not None:
            size = _recorded_size(meta, spec)
            _check_against_ranks(spec, ns_fd, size)
    except DamagedMeta as exc:
        log.warning("kvhal: disk tier %s: %s; this model's blocks there are dropped", where, exc)
        meta = None
    if meta is not None:
        # an existing cache is never refused because another model joined the path later
        if size > bytes_to_use:
            raise ValidationError(
                "bytes_to_use",
                f"{bytes_to_use} bytes cannot hold this model's cache at {where}, made with "
                f"{size} bytes; nothing was changed: raise bytes_to_use, or remove that directory "
                "to start a smaller one",
            )
        if bytes_to_use != meta.get("bytes_to_use"):
            log.info(
                "kvhal: disk tier %s keeps its %d bytes (made with bytes_to_use=%s); remove it to resize",
                where,
                size,
                meta.get("bytes_to_use"),
            )
        make(size)
        return size
    _clear_namespace(ns_fd, where)
    size = _migrate_legacy(spec, tree_fd, ns_fd, where, bytes_to_use)
    if size is None:
        others = _others(tree_fd, os.path.basename(where))
        held = sum(b for _, b, _ in others)
        size = bytes_to_use - held
        least = spec.world_size * (Geometry.plan(spec.slot_bytes, 0).stride + RECORD_BYTES)
        if size < least:
            raise ValidationError(
                "bytes_to_use",
                f"{bytes_to_use} bytes is the budget of everything kvhal keeps at {path}, and "
                f"{held} of it is taken{_listing(others)}, leaving {max(size, 0)}; this model needs "
                f"at least {least}: raise bytes_to_use, or remove a cache no engine uses",
            )
        if size < bytes_to_use:
            log.warning(
                "kvhal: disk tier %s gets %d of bytes_to_use=%d bytes: the rest is held%s",
                where,
                size,
                bytes_to_use,
                _listing(others),
            )
    make(size)
    record = {
        "format": NAMESPACE_VERSION,
        "bytes": size,
        "bytes_to_use": bytes_to_use,
        "world_size": spec.world_size,
        "slot_bytes": spec.slot_bytes,
        "fingerprint": spec.fingerprint,
    }
    text = (json.dumps(record, indent=1, sort_keys=True, default=str) + "\n").encode()
    write_meta(ns_fd, text, NAMESPACE_FILE)
    return size


def recorded_size(spec: TierSpec, ns_fd: int, where: str) -> int | None:
    """The bytes ``namespace.json`` gives ``spec``'s namespace, read only (another engine may own
    it); ``None`` where it has none kvhal wrote."""
    try:
        meta = read_meta(ns_fd, where, NAMESPACE_FILE)
        if meta is None:
            return None
        size = _recorded_size(meta, spec)
        _check_against_ranks(spec, ns_fd, size)
        return size
    except DamagedMeta:
        return None


def _recorded_size(meta: dict[str, Any], spec: TierSpec) -> int:
    size = meta.get("bytes")
    if meta.get("format") != NAMESPACE_VERSION or type(size) is not int or size <= 0:
        raise DamagedMeta(f"{NAMESPACE_FILE} holds no size kvhal wrote")
    if meta.get("world_size") != spec.world_size or meta.get("slot_bytes") != spec.slot_bytes:
        raise DamagedMeta(f"{NAMESPACE_FILE} names another tensor-parallel or slot size")
    asked = meta.get("bytes_to_use")
    if type(asked) is int and size > asked:  # kvhal never gives a namespace more than was asked
        raise DamagedMeta(
            f"{NAMESPACE_FILE} gives {size} bytes, more than the bytes_to_use={asked} it was made with"
        )
    return size


def _check_against_ranks(spec: TierSpec, ns_fd: int, size: int) -> None:
    """The ranks' own records of the geometry are ``namespace.json``'s witnesses: where a rank
    directory holds one (a ``meta.json`` with a geometry, or an index) and none agrees with
    ``size`` (by its ``meta.json`` or by its preallocated files' sizes), ``size`` is damaged.

    One damaged ``meta.json`` is outvoted by its own files, so only that rank starts empty
    (:func:`~kvhal.tiers.disk.ranks.ensure_ranks`); a ``namespace.json`` whose size changed has
    every rank against it.

    :raises DamagedMeta: no rank was made with ``size``.
    """
    geometry = Geometry.plan(spec.slot_bytes, size // spec.world_size)
    witnesses = 0
    for rank in range(spec.world_size):
        name = f"rank{rank}of{spec.world_size}"
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=ns_fd)
        except OSError:
            continue  # none yet (or not a directory: ensure_ranks says so)
        try:
            try:
                meta = read_meta(fd, name)
            except DamagedMeta:
                meta = None
            if meta is not None and not all(field in meta for field in geometry.fields()):
                meta = None
            sizes = _sizes(fd, [file for file, _ in rank_files(geometry)])  # the index among them
        finally:
            os.close(fd)
        if meta is None and sizes.get("index.bin") is None:
            continue  # nothing of its geometry recorded: no witness
        witnesses += 1
        if (meta is not None and not meta_mismatches(meta, geometry)) or all(
            sizes.get(file) == want for file, want in rank_files(geometry)
        ):
            return
    if witnesses:
        raise DamagedMeta(
            f"{NAMESPACE_FILE} gives {size} bytes ({geometry.num_slots} slots a rank), which no rank "
            "there was made with (their meta.json and files disagree)"
        )


def _sizes(dir_fd: int, names: Sequence[str]) -> dict[str, int | None]:
    """Each of ``names``' size, ``None`` where it is missing or not a regular file."""
    found: dict[str, int | None] = {}
    for name in names:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            found[name] = st.st_size if stat.S_ISREG(st.st_mode) else None
        except OSError:
            found[name] = None
    return found


def _clear_namespace(ns_fd: int, where: str) -> None:
    """A namespace without its record cannot say its size: start it empty (its lock stays)."""
    for name in os.listdir(ns_fd):
        if name == "LOCK":
            continue
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=ns_fd)
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=ns_fd)
            continue
        try:
            clear_rank(fd, os.path.join(where, name))
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=ns_fd)


def _others(tree_fd: int, ns: str) -> list[tuple[str, int, str]]:
    """``(directory, bytes, model)`` of every other namespace and earlier kvhal's rank directories."""
    found = []
    for name in sorted(os.listdir(tree_fd)):
        if name == ns or not (name.startswith("m-") or _LEGACY_RANK.fullmatch(name)):
            continue
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=tree_fd)
        except OSError:
            continue  # not a directory kvhal made (a link, a file): not kvhal's bytes
        try:
            # a namespace's own small files (its lock, its record) are not blocks
            used = _allocated(fd, files=not name.startswith("m-"))
            model = "an earlier kvhal's rank directory"
            if name.startswith("m-"):
                with contextlib.suppress(DamagedMeta):
                    meta = read_meta(fd, name, NAMESPACE_FILE) or {}
                    recorded = meta.get("bytes")
                    if type(recorded) is int and recorded > 0:
                        used = recorded  # its files are preallocated to it (sparse ones fill up to it)
                    fingerprint = meta.get("fingerprint")
                    model = str(fingerprint.get("model", "?")) if isinstance(fingerprint, dict) else "?"
        finally:
            os.close(fd)
        if used:  # a namespace whose start was refused holds only its lock: nothing to name
            found.append((name, used, model))
    return found


def _allocated(dir_fd: int, depth: int = 2, files: bool = True) -> int:
    """Bytes the files under ``dir_fd`` take on disk (links are not followed; ``files=False``:
    only those in its subdirectories)."""
    total = 0
    for name in os.listdir(dir_fd):
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            total += st.st_blocks * 512 if files else 0
        elif stat.S_ISDIR(st.st_mode) and depth > 1:
            fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
            try:
                total += _allocated(fd, depth - 1)
            finally:
                os.close(fd)
    return total


def _listing(others: Sequence[tuple[str, int, str]]) -> str:
    if not others:
        return ""
    return " by " + ", ".join(f"{name} ({model}, {used} bytes)" for name, used, model in others)


def _legacy_unlocked(tree_fd: int) -> bool:
    """Whether no engine holds the tree's top-level ``LOCK`` (kvhal before namespaces took it)."""
    try:
        fd = os.open("LOCK", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=tree_fd)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _migrate_legacy(spec: TierSpec, tree_fd: int, ns_fd: int, where: str, bytes_to_use: int) -> int | None:
    """Move this model's rank directories from the top of the tree (kvhal before namespaces)
    into its namespace; its size then, or ``None`` where there are none of this model and size."""
    geometry = Geometry.plan(spec.slot_bytes, bytes_to_use // spec.world_size)
    names = [f"rank{r}of{spec.world_size}" for r in range(spec.world_size)]
    if not _legacy_unlocked(tree_fd):
        return None  # an earlier kvhal's engine is using them
    for rank, name in enumerate(names):
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=tree_fd)
        except OSError:
            return None
        try:
            meta = read_meta(fd, name)
        except DamagedMeta:
            return None
        finally:
            os.close(fd)
        if meta is None or meta.get("digest") != spec.digest(rank).hex() or meta_mismatches(meta, geometry):
            return None
    for name in names:
        os.rename(name, name, src_dir_fd=tree_fd, dst_dir_fd=ns_fd)
    if not any(_LEGACY_RANK.fullmatch(n) for n in os.listdir(tree_fd)):
        with contextlib.suppress(OSError):
            os.unlink("LOCK", dir_fd=tree_fd)
    log.info(
        "kvhal: disk tier: this model's blocks moved into %s (kvhal now keeps a directory per model)", where
    )
    return bytes_to_use
