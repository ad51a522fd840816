"""One store under a fleet's load: the clients, the fault schedule, the final check.

:func:`run_store` starts the store's rig (:mod:`~kvhal.bench.store_load.rigs`), hands a
``load`` job to ``clients`` processes of a :class:`ClientPool` (each a fresh interpreter,
never a fork of the parent, which runs threads), starts the clock once every client is
connected, deals the faults at even intervals over the run, stops the clients, and has one
of them read back every block the clients acknowledged (``verify``). What it measured is summed up by
:mod:`~kvhal.bench.store_load.figures`.

A client killed mid-write (``kill``) is replaced at once by a fresh process (an orchestrator
restarting an engine), which joins the run under a new row once it is connected.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvhal.bench.store_load.client import (
    BUCKET_S,
    DONE,
    KILLS,
    READY,
    START_NS,
    STOP,
    WRITING,
    open_board,
)
from kvhal.bench.store_load.figures import summarize
from kvhal.bench.store_load.rigs import FAULTS, open_rig
from kvhal.errors import ValidationError
from kvhal.tiers.remote.format import HEADER_BYTES

#: seconds a spawned client may take to import kvhal and connect (2 busy cores: several each)
READY_TIMEOUT_S = 180.0
#: seconds the parent waits for a client to be caught mid-write before it kills it anyway
KILL_WAIT_S = 2.0


@dataclass(frozen=True)
class LoadConfig:
    """What one store's run does (the CLI's arguments; see ``kvhal bench store-load --help``)."""

    clients: int = 16
    duration_s: float = 60.0
    block_bytes: int = 64 << 10
    batch: int = 16
    inflight: int = 2
    write_fraction: float = 0.5
    shared_fraction: float = 0.25
    own_blocks: int = 512
    shared_blocks: int = 512
    faults: tuple[str, ...] = FAULTS
    pause_s: float = 3.0
    stall_s: float = 6.0
    op_deadline_s: float = 30.0
    drain_s: float = 30.0
    window_s: float = 2.0
    blocked_wait_s: float = 60.0
    mooncake_discard_s: int | None = None
    seed: int = 0

    def check(self) -> None:
        """Refuse what cannot run, naming the argument (before any server starts)."""
        for name in ("clients", "batch", "inflight", "own_blocks", "shared_blocks"):
            if int(getattr(self, name)) < 1:
                raise ValidationError(name, f"must be at least 1, got {getattr(self, name)}")
        if self.block_bytes < 64 or self.block_bytes % 32:
            raise ValidationError("block_bytes", f"must be a multiple of 32, at least 64: {self.block_bytes}")
        for name in ("own_blocks", "shared_blocks"):
            if getattr(self, name) < self.batch:
                raise ValidationError(name, f"must hold one batch ({self.batch} blocks)")
        for name in ("write_fraction", "shared_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValidationError(name, f"must be within [0, 1], got {getattr(self, name)}")
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ValidationError("faults", f"unknown {unknown}: each must be one of {list(FAULTS)}")
        if self.mooncake_discard_s is not None and self.mooncake_discard_s < 1:
            raise ValidationError(
                "mooncake_discard_s", f"must be at least 1 s, got {self.mooncake_discard_s}"
            )
        for name in (
            "duration_s",
            "pause_s",
            "stall_s",
            "op_deadline_s",
            "drain_s",
            "window_s",
            "blocked_wait_s",
        ):
            if not getattr(self, name) > 0:
                raise ValidationError(name, f"must be positive, got {getattr(self, name)}")
        gap = self.duration_s / (len(self.faults) + 1)
        longest = max(
            [self.window_s] + [getattr(self, f"{f}_s") for f in self.faults if f in ("pause", "stall")]
        )
        if self.faults and gap < longest + self.window_s:
            raise ValidationError(
                "duration_s",
                f"{self.duration_s:g} s leaves {gap:.1f} s between {len(self.faults)} faults; each needs "
                f"{longest + self.window_s:g} s (its length and a window of {self.window_s:g} s after it)",
            )


class Client:
    """A client process (``python -m kvhal.bench.store_load.process``) and its two pipes."""

    def __init__(self, log_dir: Path) -> None:
        job_read, job_write = os.pipe()
        result_read, result_write = os.pipe()
        self.log = log_dir / f"client-{job_write}-{time.monotonic_ns()}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvhal.bench.store_load.process", str(job_read), str(result_write)],
                pass_fds=(job_read, result_write),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,  # Mooncake's logs among them
            )
        os.close(job_read)
        os.close(result_write)
        self.jobs = os.fdopen(job_write, "w")
        self.results = os.fdopen(result_read, "r")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, job: dict | None) -> None:
        self.jobs.write("\n" if job is None else json.dumps(job) + "\n")
        self.jobs.flush()

    def result(self, timeout: float) -> dict | None:
        """The job's answer, or None if none came in ``timeout`` seconds (or the process died)."""
        try:
            ready, _, _ = select.select([self.results], [], [], timeout)
            line = self.results.readline() if ready else ""
        except (OSError, ValueError):
            return None
        return json.loads(line) if line else None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        for end in (self.jobs, self.results):
            with contextlib.suppress(OSError):
                end.close()


class ClientPool:
    """Client processes kept between stores (each pays its imports once); their logs in a
    temporary directory removed at :meth:`close`."""

    def __init__(self) -> None:
        self._logs = tempfile.TemporaryDirectory(prefix="kvhal-store-clients-")
        self.idle: list[Client] = []

    def spawn(self) -> Client:
        return Client(Path(self._logs.name))

    def take(self, n: int) -> list[Client]:
        taken = [c for c in self.idle[:n] if c.alive]
        self.idle = self.idle[n:]
        return taken + [self.spawn() for _ in range(n - len(taken))]

    def give_back(self, clients: list[Client]) -> None:
        self.idle += [c for c in clients if c.alive]

    def close(self) -> None:
        """Ask every idle client to end; one still there after a second is killed (it holds
        nothing: its tier was closed at the end of its last job)."""
        for client in self.idle:
            with contextlib.suppress(OSError):
                client.send(None)
        deadline = time.monotonic() + 1.0
        for client in self.idle:
            with contextlib.suppress(subprocess.TimeoutExpired):
                client.process.wait(max(0.01, deadline - time.monotonic()))
            client.kill()
        self.idle.clear()
        self._logs.cleanup()

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _segment_bytes(config: LoadConfig) -> int:
    rows = config.clients + config.faults.count("kill")
    held = (rows * config.own_blocks + config.shared_blocks) * (config.block_bytes + HEADER_BYTES)
    return 2 * held + (64 << 20)  # half full at most: a store node never evicts here


def run_store(
    kind: str, config: LoadConfig, pool: ClientPool, tick: Callable[[str, float], None] | None = None
) -> dict:
    """One store's run (see the module); ``tick(what, seconds into the run)`` reports progress."""
    config.check()
    tick = tick or (lambda what, t: None)
    rows = config.clients + config.faults.count("kill")
    buckets = math.ceil((config.duration_s + 2 * config.drain_s + 60) / BUCKET_S)
    with tempfile.TemporaryDirectory(prefix="kvhal-store-load-") as work:
        board = open_board(Path(work) / "board", rows, buckets, mode="w+")
        tick("starting the store", 0.0)
        with open_rig(kind, _segment_bytes(config), config.mooncake_discard_s) as rig:
            faults = [f for f in config.faults if f in rig.faults()]
            base = {
                **asdict(config),
                "kind": "load",
                "url": rig.url,
                "secret": os.urandom(32).hex(),
                "nonce": os.urandom(8).hex(),
                "rows": rows,
                "buckets": buckets,
                "board": str(Path(work) / "board"),
                "slots": 2 * config.inflight * config.batch,
                "logs": work,
            }

            def job(row: int) -> dict:
                logs = {
                    "acks": str(Path(work) / f"acks-{row}"),
                    "intents": str(Path(work) / f"intents-{row}"),
                }
                return {**base, **logs, "row": row, "seed": config.seed * 1000 + row}

            fleet = _Fleet(pool, board, job, config.clients, faults.count("kill"))
            try:
                checker = _KillCheck(fleet.checkers, board, base, config)
                fleet.wait_ready(tick, checker.ready)
                start = time.monotonic_ns()
                board[0, START_NS] = start
                events, ran_s = _deal_faults(rig, fleet, checker, faults, config, start, tick)
                board[0, STOP] = 1
                tick("draining", ran_s)
                results, errors = fleet.collect(config)
                tick("reading back every acknowledged block", ran_s)
                acks = [job(row)["acks"] for row in range(rows)]
                verify = fleet.verify({**base, "kind": "verify", "acks": acks}, config)
                verify |= checker.finish()
            finally:
                fleet.release()
        return summarize(kind, config, board, start, ran_s, events, results, errors, verify, faults)


class _Fleet:
    """The clients of one run: rows handed out, kills and replacements, results."""

    def __init__(self, pool: ClientPool, board: Any, job: Callable[[int], dict], n: int, spares: int) -> None:
        self.pool, self.board, self.job = pool, board, job
        taken = pool.take(n + 2 * spares)
        self.clients: dict[int, Client] = dict(enumerate(taken[:n]))
        self.spares = taken[n : n + spares]  # started with the others: a replacement joins in seconds
        self.checkers = taken[n + spares :]  # one per kill: its check (:class:`_KillCheck`)
        self.killed: dict[int, Client] = {}
        for row, client in self.clients.items():
            client.send(job(row))

    def wait_ready(self, tick: Callable[[str, float], None], checks_ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            states = [int(self.board[1 + row, READY]) for row in self.clients]
            for client in self.clients.values():
                if not client.alive:
                    raise RuntimeError(f"a client exited while starting:\n{client.log_tail()}")
            if -1 in states:  # it answers why
                client = list(self.clients.values())[states.index(-1)]
                answer = client.result(10.0) or {"error": client.log_tail()}
                raise RuntimeError(f"a client could not connect: {answer['error']}")
            if all(s == 1 for s in states):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{states.count(0)} clients not connected in {READY_TIMEOUT_S:g} s")
            tick(f"clients connecting ({states.count(1)}/{len(states)})", 0.0)
            time.sleep(0.1)
        # the spares and the kill checks too, so that a replacement and a check start at once
        for client in self.spares:
            client.send({"kind": "ping"})
        for client in self.spares:
            if client.result(max(1.0, deadline - time.monotonic())) is None:
                raise RuntimeError(f"a spare client did not start:\n{client.log_tail()}")
        while not checks_ready():
            for client in self.checkers:
                if not client.alive or client.results in select.select([client.results], [], [], 0)[0]:
                    answer = client.result(1.0) or {"error": client.log_tail()}
                    raise RuntimeError(f"a kill check could not connect: {answer.get('error')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the kill checks not connected in {READY_TIMEOUT_S:g} s")
            time.sleep(0.05)

    def kill_one(self, rng: random.Random) -> dict:
        """SIGKILL a client while it has a batch write in flight (if one is caught within
        :data:`KILL_WAIT_S`), and spawn its replacement under a new row."""
        live = [row for row, c in self.clients.items() if c.alive]
        deadline = time.monotonic() + KILL_WAIT_S
        victim, writing = rng.choice(live), False
        while time.monotonic() < deadline and not writing:
            caught = [row for row in live if self.board[1 + row, WRITING] > 0]
            if caught:
                victim, writing = rng.choice(caught), True
                break
            time.sleep(0.0005)
        client = self.clients.pop(victim)
        writing = writing and self.board[1 + victim, WRITING] > 0  # still, at the kill
        killed_ns = time.monotonic_ns()
        client.kill()  # SIGKILL, then reaped: its logs are final once this returns
        self.killed[victim] = client
        row = len(self.clients) + len(self.killed)
        replacement = self.spares.pop() if self.spares else self.pool.spawn()
        replacement.send({**self.job(row), "strict": False})
        self.clients[row] = replacement
        return {"row": victim, "writing": bool(writing), "replacement_row": row, "killed_ns": killed_ns}

    def collect(self, config: LoadConfig) -> tuple[list[dict], list[str]]:
        """Every live client's result; an error or a client that does not answer is an error."""
        results, errors = [], []
        # a replacement may still be importing: its wait for the board ends as soon as it is up
        deadline = time.monotonic() + 3 * config.drain_s + READY_TIMEOUT_S
        for row, client in self.clients.items():
            result = client.result(max(0.1, deadline - time.monotonic()))
            if result is None:
                errors.append(f"client row {row} gave no result (hung or died): killed\n{client.log_tail()}")
                client.kill()
            elif "error" in result:
                errors.append(f"client row {row}: {result['error']}\n{result.get('traceback', '')}")
            else:
                results.append(result)
        return results, errors

    def verify(self, job: dict, config: LoadConfig) -> dict:
        client = next((c for c in self.clients.values() if c.alive), None) or self.pool.spawn()
        self.clients.setdefault(-1, client)
        client.send(job)
        result = client.result(READY_TIMEOUT_S + 10 * config.drain_s)
        if result is None:
            client.kill()
            return {"error": "the verifying client gave no result"}
        if "error" in result:
            result["error"] = f"reading back every acknowledged block: {result['error']}"
        return result

    def release(self) -> None:
        live = [c for c in [*self.clients.values(), *self.spares, *self.checkers] if c.alive]
        self.pool.give_back(list(dict.fromkeys(live)))


class _KillCheck:
    """Right after each kill, the blocks the killed client was writing are written again and
    read back (a ``killcheck`` job, :func:`~kvhal.bench.store_load.verify.run_killcheck`) by a
    client process connected before the run starts, told of the kill on the board (never the
    parent: its proxies must keep moving)."""

    def __init__(self, checkers: list[Client], board: Any, base: dict, config: LoadConfig) -> None:
        self.checkers, self.board, self.config = checkers, board, config
        self.kills = 0
        for k, checker in enumerate(checkers):
            checker.send({**base, "kind": "killcheck", "check": k})

    def ready(self) -> bool:
        return all(self.board[0, KILLS + 2 * k + 1] for k in range(len(self.checkers)))

    def after_kill(self, row: int) -> None:
        if self.kills < len(self.checkers):
            self.board[0, KILLS + 2 * self.kills] = row + 1
            self.kills += 1

    def finish(self) -> dict:
        """Every kill's check, summed (the latest time all read back; None if some never did)."""
        wait = self.config.blocked_wait_s + 4 * self.config.op_deadline_s + READY_TIMEOUT_S
        missing = {"error": "a kill's check gave no result"}
        results = [checker.result(wait) or missing for checker in self.checkers]
        errors = [f"kill check: {r['error']}" for r in results if "error" in r]
        if errors:
            return {"error": "; ".join(errors)}
        results = [r for r in results if r["killed_left"]]
        if not results:
            return {}
        out: dict = {"killed_left_before": {}}
        for r in results:
            for field in ("killed_left", "killed_left_first_try", "killed_left_never", "killed_left_wrong"):
                out[field] = out.get(field, 0) + r[field]
            for outcome, n in r["killed_left_before"].items():
                out["killed_left_before"][outcome] = out["killed_left_before"].get(outcome, 0) + n
        out["killed_left_checked_ns"] = min(r["killed_left_checked_ns"] for r in results)
        readable = [r["killed_left_readable_ns"] for r in results]
        out["killed_left_readable_ns"] = None if None in readable else max(readable)
        return out


def _deal_faults(
    rig: Any,
    fleet: _Fleet,
    checker: _KillCheck,
    faults: list[str],
    config: LoadConfig,
    start: int,
    tick: Callable[[str, float], None],
) -> tuple[list[dict], float]:
    """Run for ``duration_s`` (longer where the last fault ends later than a window before it),
    dealing ``faults`` at even intervals (each no sooner than two windows after the previous
    one ended); each fault's record, and the run's length."""
    rng = random.Random(config.seed)
    gap = config.duration_s / (len(faults) + 1)
    due = [(gap * (i + 1), fault) for i, fault in enumerate(faults)]
    events: list[dict] = []
    stalled: dict | None = None
    done: list[tuple[float, int]] = []  # (seconds, blocks done): the last second's, for the rate

    def now() -> float:
        return (time.monotonic_ns() - start) / 1e9

    # blocks done when the last fault ended (None before it ends): the next fault, and the run's
    # end, wait until work was seen after it (up to op_deadline_s), so a loaded machine's slow
    # recovery is told apart from none (was: a fixed window, "nothing done" at load 20)
    done_at_end: int | None = None

    def recovered(t: float) -> bool:
        return done_at_end is not None and (
            int(fleet.board[1:, DONE].sum()) > done_at_end or t >= events[-1]["end_s"] + config.op_deadline_s
        )

    def running(t: float) -> bool:  # past the duration, until a window after the last fault's end
        after_last = bool(events) and (t < events[-1]["end_s"] + config.window_s or not recovered(t))
        return t < config.duration_s or bool(due) or after_last

    while running(t := now()):
        if events and done_at_end is None and t >= events[-1]["end_s"]:
            done_at_end = int(fleet.board[1:, DONE].sum())
        if stalled is not None and t >= stalled["end_s"]:
            rig.resume()
            stalled["end_s"] = now()
            stalled = None
        # a fault no sooner than two windows after the last one ended: its "after" is seen
        settled = not events or (t >= events[-1]["end_s"] + 2 * config.window_s and recovered(t))
        if due and t >= due[0][0] and settled and stalled is None:
            _, fault = due.pop(0)
            done_at_end = None
            event: dict = {"fault": fault, "at_s": t}
            if fault == "kill":
                event |= fleet.kill_one(rng)
                event["end_s"] = event["at_s"] = (event.pop("killed_ns") - start) / 1e9
                event["reaped_s"] = now()
                checker.after_kill(event["row"])
            elif fault == "pause":
                rig.pause(config.pause_s)
                event["end_s"] = t + config.pause_s
            elif fault == "stall":
                rig.stall()
                event["end_s"] = t + config.stall_s
                stalled = event
            else:  # restart: the servers' time down and up again is the fault's window
                rig.restart()
                event["end_s"] = now()
            events.append(event)
        active = next((e["fault"] for e in events if e["at_s"] <= t < e["end_s"]), None)
        done.append((t, int(fleet.board[1:, DONE].sum())))
        while done[0][0] < t - 1.0:
            done.pop(0)
        rate = (done[-1][1] - done[0][1]) / max(0.1, done[-1][0] - done[0][0])
        tick(f"{active or 'running'}, {rate:,.0f} blocks/s", t)
        time.sleep(0.1)
    if stalled is not None:
        rig.resume()
        stalled["end_s"] = now()
    return events, now()
