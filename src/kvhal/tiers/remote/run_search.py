"""Where the part of a run of blocks that a store holds ends, found by asking few of its names.

A lookup asks a store about a run of blocks in order: a request's blocks after its local
hit. Only the held blocks from the run's first count (a hit is a prefix). Where each name
asked costs the store a request of its own (an object store's ``HEAD``: 0.6-1.7 ms of a
local SeaweedFS's time on 2 cores, tens of milliseconds of a remote S3's latency, and a
request billed), asking every name of a returning user's 35-70 blocks costs as many requests.
An engine stores a request's blocks in order, so the held part of a run is a prefix of it
nearly always; :func:`held_prefix` finds where it ends from a few names, in few rounds.

The first round asks the run's first name and names at growing distances from its end
(:func:`first_round`): a returning conversation's stored blocks end a few blocks before its
new prompt does (the new turn), and a new conversation's first block is not held. Each later
round asks up to :data:`ROUND` names evenly spread between the last name known held and the
first known absent. A run of 64 blocks whose last 0-4 are new takes one round of 13 requests.

A hole (a write that failed or was dropped, an object expired) ends the prefix at the first
absent name asked; one not asked is taken as held, and its read fails: those blocks are
recomputed and written again (the remote tier's contract for a value that has gone).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ROUND", "first_round", "held_prefix", "tail_round"]

#: most names a later round asks (one batch of requests in flight at once)
ROUND = 8
#: distances from the run's end that the first round asks each of: a new turn's blocks (4 absent
#: at most, 5 asked, for the end to be found in one round)
DENSE_TAIL = 5


def first_round(count: int) -> list[int]:
    """The indices the first round asks, ascending: 0, and ``count - d`` for d = 1..5, 7, 10,
    15, 20, 30, 40, ... (every index of a run no longer than those)."""
    distances = list(range(1, DENSE_TAIL + 1))
    step = DENSE_TAIL
    while distances[-1] < count:
        distances += [step * 3 // 2, step * 2]
        step *= 2
    return sorted({0} | {count - d for d in distances if d <= count})


def tail_round(count: int) -> list[int]:
    """A first round of only the run's first index and its last :data:`DENSE_TAIL`: for a
    store whose names answer for several blocks each (runs: each asked index costs up to two
    names), where the growing distances of :func:`first_round` would cost more names than
    the later round they save in the rare case (a new turn longer than the tail)."""
    return sorted({0} | {count - d for d in range(1, DENSE_TAIL + 1) if d <= count})


def held_prefix(count: int, ask: Callable[[list[int]], list[bool]], first: list[int] | None = None) -> int:
    """How many of a run's ``count`` names, from the first, the store holds, taking the held
    part as a prefix; ``ask(indices)`` says whether it holds each of those (one batch).
    ``first``: the first round's indices (ascending; default :func:`first_round`)."""
    if count <= 0:
        return 0
    held, absent = -1, count  # the last index known held, the first known absent
    indices = first_round(count) if first is None else first
    while indices:
        answers = ask(indices)
        absent = min([absent] + [i for i, found in zip(indices, answers, strict=True) if not found])
        # a held name after an absent one is past a hole: the prefix ends at the hole
        held = max([held] + [i for i, found in zip(indices, answers, strict=True) if found and i < absent])
        gap = absent - held - 1
        if gap <= 0:
            break
        if gap <= ROUND:
            indices = list(range(held + 1, absent))
        else:
            indices = sorted({held + (gap + 1) * k // (ROUND + 1) for k in range(1, ROUND + 1)})
    return held + 1
