"""Runs of blocks stored as one value: fewer, larger objects where every request costs more than
its bytes (an object store).

A run is ``k`` blocks aligned from a request's first block (blocks ``jk .. jk + k - 1``), so
every request that shares a prefix cuts the same runs (LMCache's chunks). Its value is its
blocks' values one after another, each with the header it would have alone (naming the
block, not the run): a read of any tail of the run is one ranged request, and each block in
it is verified, counted and refused alone. A run is named by its last block's key (vLLM's
chained hash names every block before it) under a namespace that holds ``k``, so engines of
another ``k`` never read each other's runs.

A write stores as a run only the runs it holds whole (the blocks of a request's prefill);
its other blocks (a decode step's, a prompt's last partial run) stay one object each. A
read takes a run's blocks from the run wherever its tail up to the run's last block is
wanted; a run that is not there is read block by block instead. A lookup asks about a block
by both names (:func:`held_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvhal.tiers.remote.run_search import held_prefix, tail_round

__all__ = ["MAX_RUN_BLOCKS", "RUN_BYTES", "Piece", "held_blocks", "pieces", "run_blocks_for"]

#: what a lookup asks the store about: ``(True, i)`` the run whose last block is key ``i``,
#: ``(False, i)`` block ``i`` stored alone
Unit = tuple[bool, int]

#: a run holds blocks until it reaches this many bytes: where an object store's requests stop
#: costing more than their bytes (docs/tiers.md, "Object size and count": 1 MiB objects read
#: 1.8-2.5x faster than 256 KiB ones from a self-hosted server, at a quarter of the requests)
RUN_BYTES = 1 << 20
#: the most blocks of a run (a run's read waits for all of them)
MAX_RUN_BLOCKS = 16


def run_blocks_for(value_bytes: int) -> int:
    """Blocks per run for values of ``value_bytes``: the smallest power of two whose run
    reaches :data:`RUN_BYTES`, at most :data:`MAX_RUN_BLOCKS` (1: a block is large enough)."""
    if value_bytes <= 0:
        raise ValueError(f"value_bytes must be positive, got {value_bytes}")
    k = 1
    while k * value_bytes < RUN_BYTES and k < MAX_RUN_BLOCKS:
        k *= 2
    return k


@dataclass(frozen=True, slots=True)
class Piece:
    """One object a call moves: ``indices`` into the call's keys, in block order; ``run``
    whether it is a run (named by the key of its last block, ``indices[-1]``), whose first
    ``skip`` blocks the call does not move."""

    indices: range
    run: bool
    skip: int = 0


def pieces(positions: Sequence[int], k: int, *, tails: bool) -> list[Piece]:
    """Split a call's keys, given each key's block position in its request, into objects: a
    run wherever the keys hold run ``j``'s blocks in order, whole (``tails=False``, a write)
    or from any of them to the run's last (``tails=True``, a read or a lookup); every other key
    alone. ``k`` 1, or positions not given: every key alone."""
    n = len(positions)
    if k <= 1:
        return [Piece(range(i, i + 1), False) for i in range(n)]
    out: list[Piece] = []
    i = 0
    while i < n:
        p = positions[i]
        start = p - p % k
        length = start + k - p
        whole = p == start
        if (
            (tails or whole)
            and p >= 0
            and i + length <= n
            and positions[i + length - 1] == p + length - 1
            and all(positions[i + d] == p + d for d in range(1, length - 1))
        ):
            out.append(Piece(range(i, i + length), True, p - start))
            i += length
        else:
            out.append(Piece(range(i, i + 1), False))
            i += 1
    return out


def held_blocks(count: int, parts: list[Piece], exists: Callable[[list[Unit]], list[bool]]) -> int:
    """How many of a lookup's ``count`` blocks, from the first, the store holds, where
    ``parts`` are :func:`pieces` of their positions (``tails=True``) and ``exists(units)``
    asks the store about each unit (one batch of requests).

    A block is held where its run is (a run the lookup's blocks reach the end of) or where it
    is stored alone; asking about a block asks both names. The held part is searched as a
    prefix (:func:`~kvhal.tiers.remote.run_search.held_prefix`), its first round asking the
    first block and the last :data:`~kvhal.tiers.remote.run_search.DENSE_TAIL`: a returning
    request's stored blocks end a few blocks before its new prompt does (its new turn), and a
    new request's first block is not held, so both end in that one round trip of a few
    ``HEAD`` s, wherever the blocks between lie in runs or alone (a run split by a turn's end,
    or by a chunk of a prefill, is blocks alone). A block between that no round asks is taken
    as held: where it is not (a write dropped, an object expired), its read fails and it is
    recomputed (the remote tier's contract for a value that has gone).
    """
    run_of: dict[int, Unit] = {}
    for part in parts:
        if part.run:
            for i in part.indices:
                run_of[i] = (True, part.indices[-1])
    memo: dict[Unit, bool] = {}

    def ask(indices: list[int]) -> list[bool]:
        asked = [(run_of[i],) if i in run_of else () for i in indices]
        units = [unit for i, runs in zip(indices, asked, strict=True) for unit in (*runs, (False, i))]
        new = [unit for unit in dict.fromkeys(units) if unit not in memo]
        if new:
            memo.update(zip(new, exists(new), strict=True))
        return [memo[(False, i)] or (i in run_of and memo[run_of[i]]) for i in indices]

    return held_prefix(count, ask, tail_round(count))
