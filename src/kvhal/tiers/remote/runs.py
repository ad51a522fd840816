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
wanted; a run that is not there is read block by block instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvhal.tiers.remote.run_search import first_round, held_prefix

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

    The runs the lookup's blocks begin with are searched first
    (:func:`~kvhal.tiers.remote.run_search.held_prefix`; a run not there counts where its
    blocks are there one by one), then the blocks after the last run held, alone (a prompt's
    last partial run, a decode step's blocks, a run that was never
    whole in one write). The first batch asks, besides the runs, the first block alone and
    the search's first names of the blocks after the runs: a returning request's lookup and a
    new one's both end in that one round trip.
    """
    runs = []
    for part in parts:
        if not part.run:
            break
        runs.append(part)
    memo: dict[Unit, bool] = {}

    def ask(units: list[Unit]) -> list[bool]:
        new = [unit for unit in dict.fromkeys(units) if unit not in memo]
        if new:
            memo.update(zip(new, exists(new), strict=True))
        return [memo[unit] for unit in units]

    after = runs[-1].indices.stop if runs else 0
    early = [(False, 0)] + [(False, after + i) for i in first_round(count - after) if after + i < count]
    first = True

    def ask_runs(indices: list[int]) -> list[bool]:
        nonlocal first
        units = [(True, runs[i].indices[-1]) for i in indices]
        extra, first = (early if first else []), False  # the first batch carries the blocks' first names
        answers = ask(units + extra)[: len(units)]
        # A run not there may be held block by block (never stored whole: a prefill cut in chunks
        # across it, or written by an engine storing every block alone): the blocks of every such
        # run of this round in one batch; none where the first one's first block is known absent
        # (a new request's: asked in the first batch). The prefix ends at the first run held
        # neither way.
        absent = sorted((a for a in range(len(indices)) if not answers[a]), key=lambda a: indices[a])
        if absent and memo.get((False, runs[indices[absent[0]]].indices[0])) is not False:
            ask([(False, i) for a in absent for i in runs[indices[a]].indices])
            for a in absent:
                answers[a] = all(memo[(False, i)] for i in runs[indices[a]].indices)
                if not answers[a]:
                    break
        return answers

    found = held_prefix(len(runs), ask_runs)
    start = after if found == len(runs) else runs[found].indices.start
    if start >= count or memo.get((False, start)) is False:
        return start
    return start + held_prefix(count - start, lambda indices: ask([(False, start + i) for i in indices]))
