"""Checks of ``kvhal bench store-load``: after the load, every block a client acknowledged is
read back once (the ``verify`` job); right after a kill, the blocks the killed client left
mid-write are written again and read back (the ``killcheck`` job, connected before the run
starts, waiting for the kill). Both run in client processes: never in the parent, whose proxies
a store client holding the GIL would stall.

A block's latest write counts (a shared block written again after a restart must be there).
A block acknowledged and then absent is lost; the caller tells a restart's losses from others
by when its write began. A block a killed client was writing must read as absent or as its
block (never wrong), and once written again must read back: a write cut off by a kill must
not keep its name from the fleet for longer than the store says (Mooncake discards a put whose
writer never finished it after its master's ``put_start_discard_timeout_sec``, 30 s by
default: until then every other writer's put of the name answers success and stores nothing).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kvhal.bench.store_load.blocks import ACK, Content, key
from kvhal.bench.store_load.client import KILLS, STOP, close_tier, open_board, open_tier


def _records(path: str) -> Iterable[tuple[int, int, int]]:
    data = Path(path).read_bytes() if Path(path).exists() else b""
    return ACK.iter_unpack(data[: len(data) - len(data) % ACK.size])


class BlockReader:
    """Reads (and writes) batches of blocks through one remote tier, checking every byte."""

    def __init__(self, job: dict) -> None:
        self.job = job
        self.host, self.tier = open_tier(job, [])
        self.content = Content(job["block_bytes"])
        self.nonce = bytes.fromhex(job["nonce"])

    def _batches(
        self, ids: list[tuple[int, int]]
    ) -> Iterable[tuple[list[tuple[int, int]], list[bytes], list[int]]]:
        batch = self.job["batch"]
        for first in range(0, len(ids), batch):
            chunk = ids[first : first + batch]
            slots = self.host.allocate(len(chunk))
            assert slots is not None, "the verifying tier's slots are all its own"
            try:
                yield chunk, [key(self.nonce, origin, n) for origin, n in chunk], slots
            finally:
                self.host.free(slots)

    def read(self, ids: list[tuple[int, int]]) -> list[tuple[tuple[int, int], str]]:
        """Each block's outcome: ``ok``, ``wrong`` (served, not its bytes), or the tier's word."""
        out = []
        for chunk, keys, slots in self._batches(ids):
            outcomes = self.tier.read(keys, slots).result(timeout=self.job["op_deadline_s"])
            for block, outcome, k, slot in zip(chunk, outcomes, keys, slots, strict=True):
                words = np.frombuffer(self.host.slot_memory(slot), dtype=np.uint64)
                if outcome.value == "ok" and not self.content.matches(words, k):
                    out.append((block, "wrong"))
                else:
                    out.append((block, outcome.value))
        return out

    def write(self, ids: list[tuple[int, int]]) -> int:
        """Write ``ids`` with their content; how many were acknowledged."""
        acked = 0
        for _, keys, slots in self._batches(ids):
            for k, slot in zip(keys, slots, strict=True):
                self.content.fill(np.frombuffer(self.host.slot_memory(slot), dtype=np.uint64), k)
            acked += sum(self.tier.write(keys, slots).result(timeout=self.job["op_deadline_s"]))
        return acked

    def close(self) -> None:
        if close_tier(self.tier, self.job["drain_s"]):
            self.host.close()


def check_killed(reader: BlockReader, intents: str, acks: str, wait_s: float) -> dict:
    """The blocks a killed client was writing (in its ``intents`` log, not in its ``acks``):
    read once (absent or whole, never wrong), then written and read back, again every half
    second while some do not read back, for at most ``wait_s``: how many read back at the
    first try, when the check began and when all read back (monotonic ns), how many never did,
    and how many came back wrong."""
    left = sorted({(o, n) for o, n, _ in set(_records(intents)) - set(_records(acks))})
    checked_ns = time.monotonic_ns()
    before = Counter(outcome for _, outcome in reader.read(left))
    began = time.monotonic()
    pending, first, wrong = list(left), None, before.get("wrong", 0)
    while True:
        reader.write(pending)
        outcomes = reader.read(pending)
        wrong += sum(1 for _, outcome in outcomes if outcome == "wrong")
        pending = [block for block, outcome in outcomes if outcome != "ok"]
        first = len(left) - len(pending) if first is None else first
        if not pending or time.monotonic() - began > wait_s:
            break
        time.sleep(0.5)
    return {
        "killed_left": len(left),
        "killed_left_before": dict(before),
        "killed_left_checked_ns": checked_ns,
        "killed_left_first_try": first,
        "killed_left_readable_ns": None if pending else time.monotonic_ns(),
        "killed_left_never": len(pending),
        "killed_left_wrong": wrong,
    }


def run_verify(job: dict) -> dict:
    """``job["acks"]``: every client's ack log. See the module."""
    began = time.monotonic()
    latest: dict[tuple[int, int], int] = {}
    for path in job["acks"]:
        for origin, n, ns in _records(path):
            latest[(origin, n)] = max(ns, latest.get((origin, n), ns))
    reader = BlockReader(job)
    try:
        outcomes = reader.read(sorted(latest))
    finally:
        reader.close()
    counts = Counter(outcome for _, outcome in outcomes)
    return {
        "checked": len(latest),
        "counts": {
            ("present" if k == "ok" else "lost" if k == "missing" else k): v for k, v in counts.items()
        },
        "lost_ack_ns": [latest[block] for block, outcome in outcomes if outcome == "missing"],
        "took_s": time.monotonic() - began,
    }


def run_ping(job: dict) -> dict:
    """A ``ping`` job: answered once the process has imported what a job needs."""
    return {}


def run_killcheck(job: dict) -> dict:
    """A ``killcheck`` job (check ``job["check"]``): connect, say so on the board, wait for the
    parent to name the client it killed, then :func:`check_killed` its logs. Without a kill
    before the run stops, nothing (``killed_left`` 0)."""
    board = open_board(job["board"], job["rows"], job["buckets"])
    signal, ready = KILLS + 2 * job["check"], KILLS + 2 * job["check"] + 1
    reader = BlockReader(job)
    try:
        board[0, ready] = 1
        while not board[0, signal] and not board[0, STOP]:
            time.sleep(0.002)
        if not board[0, signal]:
            return {"killed_left": 0}
        row = int(board[0, signal]) - 1
        logs = Path(job["logs"])
        return check_killed(
            reader, str(logs / f"intents-{row}"), str(logs / f"acks-{row}"), job["blocked_wait_s"]
        )
    finally:
        reader.close()
