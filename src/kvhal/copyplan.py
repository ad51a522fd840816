"""Validated, coalesced block copies: what every plugin's ``kvhal_copy_blocks`` receives.

:func:`plan_copy` checks a copy before any byte moves (ids in range, unique
destinations, caches of one geometry and layout, no overlap) and turns the
``(src block, dst block)`` pairs into byte descriptors: one per run of
consecutive ids and contiguous segment. A plugin executes the descriptors
with its device's (batched) copy call; it never re-derives addresses.

The descriptors' addresses are virtual addresses (as ``Tensor.data_ptr()``
gives them) into the memory of the two caches: device memory on the device's
side, host memory on the host's. They stay valid as long as ``plan.src`` and
``plan.dst`` are alive; a plugin keeps a reference to the plan in the work it
enqueues until that work has run. docs/vendor-guide.md ("Copies") says more.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from kvhal.cache import KVCache, SegmentFamily
from kvhal.errors import CopyValidationError

try:
    from kvhal import _copyplan as native
except ImportError:  # built without a C compiler: numpy does the same work
    native = None

BlockMapping = Sequence[tuple[int, int]] | np.ndarray | torch.Tensor


class Direction(str, enum.Enum):
    """Where the bytes go, by the torch device types of the two caches (``cpu`` is the host).

    A device whose tensors are torch ``cpu`` tensors sees every plan as :attr:`H2H`.
    """

    D2H = "d2h"
    H2D = "h2d"
    D2D = "d2d"
    H2H = "h2h"


@dataclass(frozen=True, eq=False)
class CopyPlan:
    """A checked copy of whole blocks from ``src`` to ``dst``: what ``kvhal_copy_blocks`` gets.

    Made by :func:`plan_copy` (never by a plugin) and read-only. Checked before any
    byte moves: block ids in range, destination ids unique, both caches of one
    geometry and layout, sharing no memory. Hence no two destination ranges of
    :attr:`descriptors` overlap and no source range overlaps a destination range:
    the descriptors are independent, to run in any order, in parallel or batched.

    :param src: the cache read; its memory is what the source addresses point into.
    :param dst: the cache written; its memory is what the destination addresses point into.
    :param mapping: ``(n, 2)`` int64 ``(src id, dst id)`` rows, sorted by src.
    :param runs: ``(m, 3)`` int64 ``(src start, dst start, count)``: maximal
        runs where both ids advance by one.
    :param families: paired ``(src, dst)`` :class:`~kvhal.cache.SegmentFamily`
        with equal lengths: the contiguous byte runs each block consists of, from
        which :attr:`descriptors` are built (for plugins that build their own
        batches, e.g. a kernel taking strides).
    """

    src: KVCache
    dst: KVCache
    mapping: np.ndarray
    runs: np.ndarray
    families: tuple[tuple[SegmentFamily, SegmentFamily], ...]

    @property
    def num_blocks(self) -> int:
        """How many blocks are copied (rows of :attr:`mapping`)."""
        return len(self.mapping)

    @property
    def num_bytes(self) -> int:
        """How many bytes are copied: :attr:`num_blocks` times the bytes of one block."""
        return self.num_blocks * sum(s.length for s, _ in self.families)

    @property
    def src_ids(self) -> np.ndarray:
        """The source block ids, int64, ascending (the first column of :attr:`mapping`)."""
        return self.mapping[:, 0]

    @property
    def dst_ids(self) -> np.ndarray:
        """The destination block ids, int64, unique, paired with :attr:`src_ids`."""
        return self.mapping[:, 1]

    @property
    def direction(self) -> Direction:
        """Which side is the host: from the torch device types of :attr:`src` and :attr:`dst`."""
        src_host = self.src.device.type == "cpu"
        dst_host = self.dst.device.type == "cpu"
        if src_host and dst_host:
            return Direction.H2H
        if src_host:
            return Direction.H2D
        return Direction.D2H if dst_host else Direction.D2D

    @cached_property
    def descriptors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src_ptrs, dst_ptrs, sizes)``, int64 arrays of equal length: descriptor
        ``i`` copies ``sizes[i]`` bytes from address ``src_ptrs[i]`` to ``dst_ptrs[i]``.

        Addresses are virtual addresses into :attr:`src`'s and :attr:`dst`'s memory
        (device memory on the device's side, host memory on the host's, which is
        usually a buffer from ``kvhal_allocate_host_buffer`` but may be any CPU
        tensor a caller wrapped), valid while those caches are alive. No alignment
        is promised beyond the dtype's element size, and sizes need not be multiples
        of any page or vector width. Empty when the mapping is.

        One descriptor per run and segment family where both sides' runs are
        dense (consecutive blocks touch), else one per block and family;
        family-major (all of a family's descriptors together). Computed on first
        use, then kept.
        """
        if native is not None:
            return _native_descriptors(self.families, self.runs, self.mapping)
        return _descriptors([self.families], self.runs, self.mapping)[0]

    @property
    def num_descriptors(self) -> int:
        """How many descriptors :attr:`descriptors` holds."""
        return len(self.descriptors[2])


_Triple = tuple[np.ndarray, np.ndarray, np.ndarray]


def _family_table(families: tuple[tuple[SegmentFamily, SegmentFamily], ...]) -> np.ndarray:
    """``(src address, src stride, dst address, dst stride, length, dense)`` per family pair."""
    return np.array(
        [
            (s.address, s.block_stride, d.address, d.block_stride, s.length, s.dense and d.dense)
            for s, d in families
        ],
        dtype=np.int64,
    ).reshape(-1, 6)


#: Family tables by ``id`` of the families tuple they were made from (kept, with the tuple,
#: so the id is not reused): a cache pair's families are paired once (:func:`_checked_pair`).
_TABLES: dict[int, tuple[tuple, np.ndarray, int]] = {}
_TABLES_MAX = 256


def _table_of(families: tuple[tuple[SegmentFamily, SegmentFamily], ...]) -> tuple[np.ndarray, int]:
    """:func:`_family_table` of ``families`` and how many of them are dense, made once."""
    entry = _TABLES.get(id(families))
    if entry is not None and entry[0] is families:
        return entry[1], entry[2]
    table = _family_table(families)
    dense = sum(bool(s.dense and d.dense) for s, d in families)
    if len(_TABLES) >= _TABLES_MAX:
        _TABLES.clear()
    _TABLES[id(families)] = (families, table, dense)
    return table, dense


def _native_descriptors(
    families: tuple[tuple[SegmentFamily, SegmentFamily], ...], runs: np.ndarray, mapping: np.ndarray
) -> _Triple:
    table, dense = _table_of(families)
    room = dense * len(runs) + (len(table) - dense) * len(mapping)
    out = np.empty((3, room), dtype=np.int64)
    written = native.descriptors(table, runs, mapping, out[0], out[1], out[2])
    return out[0, :written], out[1, :written], out[2, :written]


def _descriptors(
    families: Sequence[tuple[tuple[SegmentFamily, SegmentFamily], ...]], runs: np.ndarray, mapping: np.ndarray
) -> list[_Triple]:
    """:attr:`CopyPlan.descriptors` of plans sharing ``runs`` and ``mapping``, one per entry
    of ``families``, computed together (a layer-by-layer load's layers: one numpy pass)."""
    table = np.array(
        [
            (s.address, s.block_stride, d.address, d.block_stride, s.length)
            for fams in families
            for s, d in fams
        ],
        dtype=np.int64,
    ).reshape(-1, 5)
    dense = np.array([s.dense and d.dense for fams in families for s, d in fams], dtype=bool)
    owner = np.repeat(np.arange(len(families)), [len(fams) for fams in families])
    single = np.concatenate([mapping, np.ones((len(mapping), 1), dtype=np.int64)], axis=1)
    pieces: list[list[_Triple]] = [[] for _ in families]
    for mask, rows in ((dense, runs), (~dense, single)):
        fam = table[mask]
        if not len(fam) or not len(rows):
            continue
        src = fam[:, 0:1] + rows[None, :, 0] * fam[:, 1:2]
        dst = fam[:, 2:3] + rows[None, :, 1] * fam[:, 3:4]
        size = fam[:, 4:5] * rows[None, :, 2]
        # rows of one plan's families are consecutive: cut the family-major blocks by plan
        bounds = np.searchsorted(owner[mask], np.arange(len(families) + 1))
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            if b > a:
                pieces[i].append((src[a:b].ravel(), dst[a:b].ravel(), size[a:b].ravel()))
    empty = np.zeros(0, dtype=np.int64)
    return [
        tuple(np.concatenate(column) for column in zip(*plan_pieces, strict=True))  # type: ignore[misc]
        if plan_pieces
        else (empty, empty, empty)
        for plan_pieces in pieces
    ]


def _as_mapping(mapping: BlockMapping) -> np.ndarray:
    if isinstance(mapping, torch.Tensor):
        mapping = mapping.detach().cpu().numpy()
    array = np.asarray(mapping)
    if array.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if array.ndim != 2 or array.shape[1] != 2:
        raise CopyValidationError(
            "mapping", f"must be (src block, dst block) pairs of shape (n, 2), got shape {array.shape}"
        )
    if array.dtype.kind not in "iu":  # integers (np.issubdtype costs more, on a hot path)
        raise CopyValidationError("mapping", f"block ids must be integers, got {array.dtype}")
    return array.astype(np.int64, order="C")  # a copy of its own: the plan sorts it


def _check_ids(ids: np.ndarray, limit: int, side: str) -> None:
    bad = ids[(ids < 0) | (ids >= limit)]
    if len(bad):
        raise CopyValidationError(
            "mapping",
            f"{side} block ids out of range [0, {limit}): {sorted(set(bad.tolist()))[:8]}",
        )


def _pair_families(src: KVCache, dst: KVCache) -> tuple[tuple[SegmentFamily, SegmentFamily], ...]:
    a, b = src.segments, dst.segments
    for ours, theirs in ((a.merged, b.merged), (a.fine, b.fine)):
        if [f.keys for f in ours] == [f.keys for f in theirs] and [f.length for f in ours] == [
            f.length for f in theirs
        ]:
            return tuple(zip(ours, theirs, strict=True))
    raise CopyValidationError(
        "dst",
        f"its blocks are laid out unlike the source's ({len(b.fine)} vs {len(a.fine)} runs per "
        "block); allocate both caches in the same layout",
    )


def plan_copy(src: KVCache, dst: KVCache, mapping: BlockMapping) -> CopyPlan:
    """Check a block copy and compute its descriptors; raises :class:`CopyValidationError`.

    Nothing is copied here, so a refused copy leaves both caches untouched.
    """
    for name, cache in (("src", src), ("dst", dst)):
        if not isinstance(cache, KVCache):
            raise CopyValidationError(name, f"must be a KVCache, got {type(cache).__name__}")
    families = _checked_pair(src, dst)
    pairs = _as_mapping(mapping)
    if native is not None:
        runs = np.empty((len(pairs), 3), dtype=np.int64)
        count = native.plan_runs(pairs, runs, src.num_blocks, dst.num_blocks)
        if count >= 0:
            return CopyPlan(src, dst, pairs, runs[:count], families)
        # refused: the numpy path below says why
    _check_ids(pairs[:, 0], src.num_blocks, "src")
    _check_ids(pairs[:, 1], dst.num_blocks, "dst")
    values, counts = np.unique(pairs[:, 1], return_counts=True)
    if (counts > 1).any():
        raise CopyValidationError(
            "mapping", f"duplicate destination block ids: {values[counts > 1].tolist()[:8]}"
        )
    pairs = pairs[np.argsort(pairs[:, 0], kind="stable")]
    if len(pairs):
        breaks = np.flatnonzero((np.diff(pairs[:, 0]) != 1) | (np.diff(pairs[:, 1]) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        counts = np.diff(np.concatenate((starts, [len(pairs)])))
        runs = np.stack([pairs[starts, 0], pairs[starts, 1], counts], axis=1)
    else:
        runs = np.zeros((0, 3), dtype=np.int64)
    return CopyPlan(src, dst, pairs, runs.astype(np.int64), families)


def _checked_pair(src: KVCache, dst: KVCache) -> tuple[tuple[SegmentFamily, SegmentFamily], ...]:
    """The checks of ``src`` and ``dst`` as a pair (one geometry and layout, no shared memory)
    and their paired families: done once per pair, kept on ``src`` (both are immutable)."""
    known = src.__dict__.setdefault("_kvhal_paired", {})
    entry = known.get(id(dst))
    if entry is not None and entry[0]() is dst:
        return entry[1]
    why = src.geometry.mismatch(dst.geometry)
    if why is not None:
        raise CopyValidationError("dst", f"geometry differs from src ({why})")
    if src.layout.stride_order != dst.layout.stride_order:
        raise CopyValidationError("dst", f"layout {dst.layout} differs from src layout {src.layout}")
    if src is dst or src.overlaps(dst):
        raise CopyValidationError("dst", "shares memory with src; copy between distinct caches")
    families = _pair_families(src, dst)
    for key in [key for key, (ref, _) in known.items() if ref() is None]:
        del known[key]  # pairs with caches since freed
    known[id(dst)] = (weakref.ref(dst), families)
    return families


def plan_by_layer(
    plan: CopyPlan, src_layers: Sequence[KVCache], dst_layers: Sequence[KVCache]
) -> list[CopyPlan]:
    """``plan`` cut into one plan per layer, for copies a layer's compute waits for alone.

    ``src_layers[i]`` and ``dst_layers[i]`` are layer ``i``'s views of ``plan.src`` and
    ``plan.dst`` (:meth:`KVCache.of_layers`, kept by the caller so that their segments are
    derived once). The block ids were checked once, for ``plan``, and hold for every layer:
    a layer-by-layer load checks its job once, not once per layer. Raises
    :class:`CopyValidationError` for a view that is not the plan's layer.
    """
    num_layers = plan.src.geometry.num_layers
    for side, views, whole in (("src", src_layers, plan.src), ("dst", dst_layers, plan.dst)):
        if len(views) != num_layers or any(
            len(view.layers) != 1 or view.layers[0] is not whole.layers[i] for i, view in enumerate(views)
        ):
            raise CopyValidationError(
                side, f"the layer views are not {num_layers} views of the plan's layers"
            )
    plans = [
        CopyPlan(src, dst, plan.mapping, plan.runs, _pair_families(src, dst))
        for src, dst in zip(src_layers, dst_layers, strict=True)
    ]
    for layer, descriptors in zip(
        plans, _descriptors([p.families for p in plans], plan.runs, plan.mapping), strict=True
    ):
        layer.__dict__["descriptors"] = descriptors  # the cached property, filled in one pass
    return plans
