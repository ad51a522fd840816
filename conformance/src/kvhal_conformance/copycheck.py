"""Where a block copy's bytes went, compared with an independently computed expectation.

Given snapshots of source and destination before and after a copy, the checks
name each problem the way a vendor can act on it: a destination block that
was never written, one holding the wrong source block, one partly wrong, a
batch cut short, a block written outside the mapping, a changed source.
"""

from __future__ import annotations

import numpy as np
import torch

from kvhal_conformance.blockdata import Snapshot, block_label, blocks_equal, id_list, take

#: Wrong blocks described one by one; the rest are counted.
DESCRIBED = 3


def _first_difference(got: Snapshot, want: Snapshot) -> str:
    total = sum(p.numel() for p in want)
    wrong = 0
    first = None
    for part, (g, w) in enumerate(zip(got, want, strict=True)):
        diff = g != w
        wrong += int(diff.sum())
        if first is None and diff.any():
            layer, _, head, token, elem = (int(i) for i in diff.nonzero()[0])
            name = "" if len(want) == 1 else ("K " if part == 0 else "V ")
            first = f"{name}layer {layer} head {head} token {token} element {elem}"
    return f"{wrong} of {total} elements differ (first at {first})"


def _describe(dst: int, src: int, before: Snapshot, after: Snapshot, src_before: Snapshot) -> str:
    """A sentence on a destination block that does not hold its source block."""
    num_dst, num_src = before[0].shape[1], src_before[0].shape[1]
    got = take(after, [dst])
    where = f"dst {block_label(dst, num_dst)}"
    expected = f"src {block_label(src, num_src)}'s data"
    if bool(blocks_equal(got, take(before, [dst]))[0]):
        return f"{where} was not written (expected {expected})"
    holds = torch.nonzero(blocks_equal(src_before, got)).flatten().tolist()
    if holds:
        return f"{where} holds src block {holds[0]}'s data; expected {expected}"
    return f"{where} is not {expected}: {_first_difference(got, take(src_before, [src]))}"


def _truncation(mapping: np.ndarray, ok: np.ndarray, unwritten: np.ndarray) -> str | None:
    """A sentence when the wrong pairs are exactly an unwritten tail in plan (src-id) order."""
    order = np.argsort(mapping[:, 0], kind="stable")
    ok, unwritten = ok[order], unwritten[order]
    bad = np.flatnonzero(~ok)
    if not len(bad) or not unwritten[~ok].all():
        return None
    first = int(bad[0])
    if first == 0 or not (~ok[first:]).all():
        return None
    return (
        f"the first {first} of {len(mapping)} pairs (in src-id order) arrived and the remaining "
        f"{len(mapping) - first} were not written: the batch was cut short"
    )


def mapped_problems(
    mapping: np.ndarray, src_before: Snapshot, dst_before: Snapshot, dst_after: Snapshot
) -> list[str]:
    """Problems with the destination blocks the mapping names."""
    if not len(mapping):
        return []
    want = take(src_before, mapping[:, 0])
    got = take(dst_after, mapping[:, 1])
    ok = blocks_equal(got, want).numpy()
    if ok.all():
        return []
    unwritten = blocks_equal(got, take(dst_before, mapping[:, 1])).numpy() & ~ok
    bad = np.flatnonzero(~ok)
    sentences = []
    for index in bad[:DESCRIBED]:
        src, dst = (int(x) for x in mapping[index])
        sentences.append(_describe(dst, src, dst_before, dst_after, src_before))
    summary = f"{len(bad)} of {len(mapping)} mapped dst blocks are wrong"
    if len(bad) > DESCRIBED:
        summary += f" ({int(unwritten.sum())} not written at all)"
    problems = [summary + ": " + "; ".join(sentences)]
    truncated = _truncation(mapping, ok, unwritten)
    if truncated:
        problems.append(truncated)
    return problems


def unmapped_problems(mapping: np.ndarray, dst_before: Snapshot, dst_after: Snapshot) -> list[str]:
    """Destination blocks outside the mapping that changed."""
    num_dst = dst_before[0].shape[1]
    others = np.setdiff1d(np.arange(num_dst), mapping[:, 1] if len(mapping) else [])
    if not len(others):
        return []
    same = blocks_equal(take(dst_after, others), take(dst_before, others)).numpy()
    changed = others[~same]
    if not len(changed):
        return []
    return [f"dst blocks {id_list(changed)} are not in the mapping but were written"]


def source_problems(src_before: Snapshot, src_after: Snapshot) -> list[str]:
    """Source blocks the copy changed."""
    changed = torch.nonzero(~blocks_equal(src_after, src_before)).flatten().numpy()
    if not len(changed):
        return []
    return [f"src blocks {id_list(changed)} changed: a copy must only read its source"]


def copy_problems(
    mapping: np.ndarray,
    src_before: Snapshot,
    src_after: Snapshot,
    dst_before: Snapshot,
    dst_after: Snapshot,
) -> list[str]:
    """Everything wrong with a finished copy of ``mapping`` (``(src, dst)`` rows), or nothing."""
    return [
        *mapped_problems(mapping, src_before, dst_before, dst_after),
        *unmapped_problems(mapping, dst_before, dst_after),
        *source_problems(src_before, src_after),
    ]
