"""A ``load`` job of ``kvhal bench store-load``'s client process (:mod:`.process`): kvhal's
remote tier under load.

It writes and reads blocks through a :class:`~kvhal.tiers.remote.tier.RemoteTier` (``io``
role, signed with the run's secret) over a CPU :class:`~kvhal.offload.host_tier.HostTier`'s
slots, as an engine's worker does, until the board says stop; every block read is checked
byte for byte (:mod:`.blocks`).

The board is a file of int64 shared by the parent and every client (``np.memmap``): row 0 the
parent's (start time, stop, kills and their checks), row ``1 + i`` client ``i``'s live counters
and its blocks done and failed per time bucket, so a client killed mid-run leaves what it did
behind. Each write's blocks are logged before it starts (``intents``) and once acknowledged
(``acks``): append-only files of :data:`~kvhal.bench.store_load.blocks.ACK` records, one
``write`` per batch, which a kill cannot take back.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhal.bench.store_load.blocks import ACK, SHARED, Content, key

# board: row 0 (the parent's)
START_NS, STOP = 0, 1
#: row 0 from here on, two columns per kill check k: the killed row + 1 (set by the parent at the
#: kill), and 1 once check k's tier is connected (set by the checker)
KILLS = 2
# board: a client's row
READY, WRITING, SEQ, DONE, FAILED, WRONG = range(6)
#: columns before a row's buckets (done blocks per bucket, then failed blocks per bucket)
HEAD = 8
BUCKET_S = 0.1
#: seconds a client keeps trying to connect at the start
CONNECT_S = 60.0


def board_shape(rows: int, buckets: int) -> tuple[int, int]:
    return rows + 1, HEAD + 2 * buckets


def open_board(path: str | os.PathLike[str], rows: int, buckets: int, mode: str = "r+") -> np.memmap:
    return np.memmap(path, dtype=np.int64, mode=mode, shape=board_shape(rows, buckets))


@dataclass
class Op:
    """A batch in flight: a write or a read of ``ids`` (origin, n) through host ``slots``."""

    write: bool
    ids: list[tuple[int, int]]
    keys: list[bytes]
    slots: list[int]
    future: Future
    started: int  # monotonic ns
    ended: list[int] = field(default_factory=list)


def open_tier(job: dict, health: list) -> tuple[Any, Any]:
    """A host tier of ``job["slots"]`` slots and a remote tier over it. ``strict`` (the
    default): connected, tried again for up to :data:`CONNECT_S` (16 clients connecting at
    once on a busy machine can outlast a client's connect timeout), else the last error."""
    from kvhal.errors import TierError
    from kvhal.offload.host_tier import HostTier
    from kvhal.registry import select_device
    from kvhal.tiers.backend import TierSpec
    from kvhal.tiers.remote.tier import RemoteTier

    block = job["block_bytes"]
    host = HostTier(select_device("cpu"), job["slots"] * block, block)
    spec = TierSpec({}, block, fingerprint={"benchmark": "kvhal bench store-load"}, role="io")

    def on_health(up: bool, why: str) -> None:
        health.append((time.monotonic_ns(), up, why))

    deadline = time.monotonic() + CONNECT_S
    while True:
        try:
            tier = RemoteTier(
                job["url"],
                spec,
                host=host,
                secret=bytes.fromhex(job["secret"]),
                strict=job.get("strict", True),  # a replacement starts as an engine does: down if need be
                on_health=on_health,
            )
            return host, tier
        except TierError:
            if time.monotonic() < deadline:
                time.sleep(1.0)
                continue
            host.close()
            raise
        except BaseException:
            host.close()
            raise


def close_tier(tier: Any, deadline_s: float) -> bool:
    """Close ``tier`` (it waits for its calls in flight); False if that took past ``deadline_s``."""
    closer = threading.Thread(target=tier.close, daemon=True)
    closer.start()
    closer.join(deadline_s)
    return not closer.is_alive()


class Load:
    """A ``load`` job's state: see the module."""

    def __init__(self, job: dict, host: Any, tier: Any, board: np.memmap) -> None:
        self.job, self.host, self.tier, self.board = job, host, tier, board
        self.me = board[1 + job["row"]]
        self.origin = 1 + job["row"]
        self.nonce = bytes.fromhex(job["nonce"])
        self.batch = job["batch"]
        self.content = Content(job["block_bytes"])
        self.rng = random.Random(job["seed"])
        self.seq = 0
        self.buckets = (self.me.shape[0] - HEAD) // 2
        self.counts: Counter[str] = Counter()
        self.reads: list[tuple[float, float]] = []  # (seconds into the run it began, its latency)
        self.wrong_names: list[str] = []
        self.acks = os.open(job["acks"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        # every write's blocks before it starts: what a client killed mid-write left in flight
        self.intents = os.open(job["intents"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def _rows(self, i: int) -> np.ndarray:
        return self.board[1 + i]

    def _words(self, slot: int) -> np.ndarray:
        return np.frombuffer(self.host.slot_memory(slot), dtype=np.uint64)

    def _bucket(self, ns: int) -> int:
        start = int(self.board[0, START_NS])
        return min(self.buckets - 1, max(0, int((ns - start) / (BUCKET_S * 1e9))))

    def _count(self, done: int, failed: int) -> None:
        b = self._bucket(time.monotonic_ns())
        self.me[HEAD + b] += done
        self.me[HEAD + self.buckets + b] += failed
        self.me[DONE] += done
        self.me[FAILED] += failed

    # -- choosing blocks ----------------------------------------------------------------

    def _write_ids(self) -> list[tuple[int, int]]:
        job, batch = self.job, self.batch
        if self.rng.random() < job["shared_fraction"]:
            first = self.rng.randrange(job["shared_blocks"] // batch) * batch
            return [(SHARED, first + i) for i in range(batch)]
        first = self.seq % job["own_blocks"]
        self.seq += batch
        return [(self.origin, (first + i) % job["own_blocks"]) for i in range(batch)]

    def _read_ids(self) -> list[tuple[int, int]] | None:
        job, batch = self.job, self.batch
        if self.rng.random() < job["shared_fraction"]:
            first = self.rng.randrange(job["shared_blocks"] // batch) * batch
            return [(SHARED, first + i) for i in range(batch)]
        written = [
            (i, min(int(self._rows(i)[SEQ]), job["own_blocks"]))
            for i in range(job["rows"])
            if self._rows(i)[SEQ] >= batch
        ]
        if not written:
            return None
        row, upto = self.rng.choice(written)
        first = self.rng.randrange(upto - batch + 1)
        return [(1 + row, first + i) for i in range(batch)]

    # -- one batch ----------------------------------------------------------------------

    def start(self) -> Op | None:
        write = self.rng.random() < self.job["write_fraction"]
        ids = None if write else self._read_ids()
        if ids is None:
            write, ids = True, self._write_ids()
        slots = self.host.allocate(len(ids))
        if slots is None:
            return None  # every slot is held by a batch in flight (or a hung one)
        keys = [key(self.nonce, origin, n) for origin, n in ids]
        started = time.monotonic_ns()
        if write:
            for slot, k in zip(slots, keys, strict=True):
                self.content.fill(self._words(slot), k)
            os.write(self.intents, b"".join(ACK.pack(origin, n, started) for origin, n in ids))
            self.me[WRITING] += 1
            future = self.tier.write(keys, slots)
        else:
            future = self.tier.read(keys, slots)
        op = Op(write, ids, keys, slots, future, started)
        future.add_done_callback(lambda _: op.ended.append(time.monotonic_ns()))
        return op

    def finish(self, op: Op) -> None:
        if op.write:
            self.me[WRITING] -= 1
            results = op.future.result()
            acked = [ids for ids, ok in zip(op.ids, results, strict=True) if ok is True]
            if acked:  # with the time the write began: one begun after a restart must be kept
                os.write(self.acks, b"".join(ACK.pack(origin, n, op.started) for origin, n in acked))
            self.counts["written"] += len(acked)
            self.counts["write_failed"] += len(results) - len(acked)
            self._count(len(acked), len(results) - len(acked))
            if op.ids[0][0] == self.origin:
                self.me[SEQ] = max(int(self.me[SEQ]), min(self.seq, self.job["own_blocks"]))
        else:
            self._check_read(op)
        self.host.free(op.slots)

    def _check_read(self, op: Op) -> None:
        outcomes = op.future.result()
        done = failed = 0
        for outcome, slot, k in zip(outcomes, op.slots, op.keys, strict=True):
            self.counts[f"read_{outcome.value}"] += 1
            if outcome.value == "ok":
                if not self.content.matches(self._words(slot), k):
                    self.me[WRONG] += 1
                    self.counts["wrong"] += 1
                    if len(self.wrong_names) < 8:
                        self.wrong_names.append(self.tier.names([k])[0])
                done += 1
            elif outcome.value == "missing":
                done += 1  # an answer: not there (not written yet, or lost)
            else:
                failed += 1
        began = (op.started - int(self.board[0, START_NS])) / 1e9
        self.reads.append((began, (op.ended[0] - op.started) / 1e9))
        self._count(done, failed)

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> dict:
        job = self.job
        pending: list[Op] = []
        hung: list[Op] = []
        self.me[READY] = 1
        while int(self.board[0, START_NS]) == 0 and not self.board[0, STOP]:
            time.sleep(0.01)
        while not self.board[0, STOP]:
            while len(pending) < job["inflight"]:
                op = self.start()
                if op is None:
                    break
                pending.append(op)
            self._settle(pending, hung, 0.05, job["op_deadline_s"])
        # drain: what is in flight ends, or is counted hung at the deadline
        drain_until = time.monotonic() + job["drain_s"]
        while pending and time.monotonic() < drain_until:
            self._settle(pending, hung, drain_until - time.monotonic(), job["op_deadline_s"])
        hung += pending
        late = [op for op in hung if op.future.done()]  # hung past the deadline, ended since
        for op in late:
            self.finish(op)
        hung = [op for op in hung if not op.future.done()]
        os.close(self.acks)
        os.close(self.intents)
        return {
            "row": job["row"],
            "counts": dict(self.counts),
            "reads": self.reads,
            "wrong_names": self.wrong_names,
            "hung_ops": len(hung) + len(late),
            "hung_unended": len(hung),
        }

    def _settle(self, pending: list[Op], hung: list[Op], timeout: float, deadline_s: float) -> None:
        """Finish the batches that ended within ``timeout``; those past the deadline are hung."""
        ended, _ = wait([op.future for op in pending], timeout=max(0.0, timeout), return_when=FIRST_COMPLETED)
        now = time.monotonic_ns()
        for op in list(pending):
            if op.future in ended:
                pending.remove(op)
                self.finish(op)
            elif now - op.started > deadline_s * 1e9:
                pending.remove(op)
                hung.append(op)  # its slots stay held: its bytes may still be moving


def run_load(job: dict) -> dict:
    """A ``load`` job (see :class:`Load`); ``health`` is every reachability change the tier reported."""
    board = open_board(job["board"], job["rows"], job["buckets"])
    health: list[tuple[int, bool, str]] = []
    try:
        host, tier = open_tier(job, health)
    except Exception:
        board[1 + job["row"], READY] = -1
        raise
    try:
        result = Load(job, host, tier, board).run()
    except BaseException:
        close_tier(tier, job["drain_s"])
        host.close()
        raise
    # the tier waits for its calls in flight: a call that never returns shows here
    result["closed"] = close_tier(tier, job["drain_s"])
    result["leaked_slots"] = host.num_slots - host.pool.num_free
    if result["closed"]:  # else a call may still write into it: left to the process's end
        host.close()
    result["health"] = [(t, up, why) for t, up, why in health]
    result["unreachable"] = sum(1 for _, up, _ in health if not up)
    return result
