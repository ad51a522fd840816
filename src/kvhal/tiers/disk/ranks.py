"""Each rank's directory of a disk tier's namespace: checked if it is there, made if not.

A rank's directory (``rank{r}of{n}/``: :mod:`kvhal.tiers.disk.directory` lists its files)
whose ``meta.json`` matches the tier's geometry is used as it is; a damaged one is cleared
(one warning) and made again. A ``meta.json`` of another geometry is damaged too: the
geometry follows from the namespace's name (slot and tensor-parallel size) and its recorded
size, which :mod:`kvhal.tiers.disk.namespaces` has checked against the ranks' files, so no
configuration can make a rank disagree with it (a ``bytes_to_use`` too small for the cache
is refused there, before a rank is opened). New ones are made only once the free space for
all of them is known to be there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from kvhal.tiers.backend import TierSpec
from kvhal.tiers.disk.directory import (
    DamagedMeta,
    clear_rank,
    damaged_files,
    free_bytes,
    no_space,
    open_dir,
    open_file,
    preallocate,
    read_meta,
    write_meta,
)
from kvhal.tiers.disk.format import Geometry, meta_mismatches, meta_text

log = logging.getLogger(__name__)


def rank_dir(namespace: str, rank: int, world_size: int) -> str:
    """The path of ``rank``'s directory under the ``namespace`` directory."""
    return os.path.join(namespace, f"rank{rank}of{world_size}")


def rank_files(geometry: Geometry) -> list[tuple[str, int]]:
    """``(name, size)`` of every file of a rank's directory but ``meta.json``."""
    return [(f"data-{i}.bin", geometry.file_bytes(i)) for i in range(geometry.num_files)] + [
        ("index.bin", geometry.index_bytes)
    ]


def write_rank_meta(dir_fd: int, spec: TierSpec, geometry: Geometry, rank: int) -> None:
    """``rank``'s ``meta.json``: its geometry, and the KV its records hold."""
    write_meta(dir_fd, meta_text(geometry, rank, spec.world_size, spec.fingerprint, spec.digest(rank)))


def ensure_ranks(
    spec: TierSpec,
    geometry: Geometry,
    ns_fd: int,
    namespace: str,
    ranks: Sequence[int],
    rank_fds: dict[int, int],
    bytes_to_use: int,
    path: str,
) -> None:
    """Open each of ``ranks``' directories under ``ns_fd`` (the ``namespace`` directory):
    check a ready one's geometry, create and preallocate the others.

    Each descriptor goes into ``rank_fds`` as it is opened, so the caller closes them all
    whatever is raised.

    :raises ValidationError: the disk has too little free space for the new ranks' files.
    :raises OSError: the file system failed.
    """
    files = rank_files(geometry)
    new: list[int] = []
    for rank in ranks:
        where = rank_dir(namespace, rank, spec.world_size)
        fd = rank_fds[rank] = open_dir(ns_fd, os.path.basename(where), namespace)
        try:
            meta = read_meta(fd, where)
            if meta is not None:
                lacking = [n for n in geometry.fields() if n not in meta]
                if lacking:
                    raise DamagedMeta(f"meta.json lacks {', '.join(lacking)}")
                wrong = meta_mismatches(meta, geometry)
                if wrong:  # a flipped digit, say: the namespace's size and the files say otherwise
                    raise DamagedMeta(f"meta.json disagrees with the namespace's size ({'; '.join(wrong)})")
                broken = damaged_files(fd, files)
                if broken is not None:
                    raise DamagedMeta(broken)
        except DamagedMeta as exc:
            # a cache, not a record: what it held cannot be trusted, and an empty tier serves
            log.warning(
                "kvhal: disk tier %s: %s; the rank's blocks are dropped and it starts empty",
                where,
                exc,
            )
            clear_rank(fd, where)
            meta = None
        if meta is None:
            new.append(rank)
            continue
        if spec.role == "index" and meta.get("digest") != spec.digest(rank).hex():
            write_rank_meta(fd, spec, geometry, rank)  # another KV from now on: say so for people
    if not new:
        return
    missing = 0  # bytes still to allocate, counted before anything is created
    for rank in new:
        for name, size in files:
            try:
                st = os.stat(name, dir_fd=rank_fds[rank], follow_symlinks=False)
                missing += max(0, size - st.st_blocks * 512)
            except FileNotFoundError:
                missing += size
    free = free_bytes(path)
    if missing > free:
        raise no_space(bytes_to_use, path, missing, free)
    for rank in new:
        where = rank_dir(namespace, rank, spec.world_size)
        for name, size in files:
            fd = open_file(rank_fds[rank], name, os.O_RDWR | os.O_CREAT, where)
            try:
                preallocate(fd, size, bytes_to_use, path)
            finally:
                os.close(fd)
        write_rank_meta(rank_fds[rank], spec, geometry, rank)
