"""What one store's run measured: throughput over time and around each fault, read latency
(all reads, and those that overlap no fault nor the window after it),
values lost and served wrong, slots leaked, the remote tier's own counts.

Throughput counts blocks (a batch of 16 is 16): a write acknowledged, or a read answered
(served and checked, or a miss). A write refused or a read that failed (the store unreachable,
a value refused) is counted apart as failed. Around each fault: the rate in the
``window_s`` before it, during it, and in the ``window_s`` after it (each cut short where
the next fault begins), and how long after its end the first block was done again.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from kvhal.bench.store_load.client import BUCKET_S, HEAD, WRONG
from kvhal.bench.store_load.rigs import RESTART_LOSES

#: read outcomes that are a value refused by kvhal (its name is then written again)
REFUSED = ("read_corrupt", "read_foreign", "read_unauthenticated")


def _per_bucket(board: Any) -> tuple[np.ndarray, np.ndarray]:
    """Blocks done and failed per bucket, summed over every client row (killed ones too)."""
    buckets = (board.shape[1] - HEAD) // 2
    rows = np.asarray(board[1:], dtype=np.int64)
    return rows[:, HEAD : HEAD + buckets].sum(axis=0), rows[:, HEAD + buckets :].sum(axis=0)


def _rate(done: np.ndarray, a: float, b: float) -> float | None:
    """Blocks per second done in ``[a, b)`` seconds into the run; None for an empty window."""
    first, last = max(0, math.floor(a / BUCKET_S)), min(len(done), math.ceil(b / BUCKET_S))
    if b - a < BUCKET_S or last <= first:
        return None
    return float(done[first:last].sum()) / ((last - first) * BUCKET_S)


def _around(
    events: list[dict],
    done: np.ndarray,
    failed: np.ndarray,
    downs: list[float],
    duration: float,
    window: float,
) -> None:
    """Add each fault's rates before, during and after it, its recovery time, and how many
    tiers were marked down from its start to a window after its end (``downs``: when), in place."""
    for i, event in enumerate(events):
        previous_end = events[i - 1]["end_s"] if i else 0.0
        following = events[i + 1]["at_s"] if i + 1 < len(events) else duration
        at, end = event["at_s"], event["end_s"]
        event["before_ops_s"] = _rate(done, max(previous_end, at - window), at)
        event["during_ops_s"] = _rate(done, at, end)
        event["after_ops_s"] = _rate(done, end, min(following, end + window))
        before, after = event["before_ops_s"], event["after_ops_s"]
        event["held_after"] = after / before if before and after is not None else None
        first_after = max(0, math.floor(end / BUCKET_S))
        later = np.flatnonzero(done[first_after : max(first_after, math.ceil(following / BUCKET_S))])
        event["recovered_s"] = (
            None if not len(later) else max(0.0, (first_after + int(later[0])) * BUCKET_S - end)
        )
        event["tiers_down"] = sum(1 for t in downs if at <= t < min(following, end + window))
        event["done_after"] = int(done[first_after : math.ceil(following / BUCKET_S)].sum())
        event["failed_during"] = int(
            failed[max(0, math.floor(at / BUCKET_S)) : math.ceil(max(end, at + BUCKET_S) / BUCKET_S)].sum()
        )


def _lost(verify: dict, events: list[dict], start: int) -> dict:
    """Lost values: written before a restart began (expected: said why), or not (must be 0)."""
    restarts = [start + int(e["at_s"] * 1e9) for e in events if e["fault"] == "restart"]
    cut = max(restarts) if restarts else None
    written = verify.get("lost_ack_ns", [])
    before = sum(1 for ns in written if cut is not None and ns < cut)
    return {"lost": len(written), "lost_to_restart": before, "lost_unexplained": len(written) - before}


def _killed_timing(verify: dict, events: list[dict], start: int) -> dict:
    """Seconds from the last kill until its check began, and until every name it left read
    back once written again (None: never, within the wait)."""
    kills = [e["at_s"] for e in events if e["fault"] == "kill"]
    if not kills or "killed_left_checked_ns" not in verify:
        return {"killed_left_checked_s": None, "killed_left_stored_s": None}
    readable = verify["killed_left_readable_ns"]
    return {
        "killed_left_checked_s": (verify["killed_left_checked_ns"] - start) / 1e9 - max(kills),
        "killed_left_stored_s": None if readable is None else (readable - start) / 1e9 - max(kills),
    }


def summarize(
    kind: str,
    config: Any,
    board: Any,
    start: int,
    ran_s: float,
    events: list[dict],
    results: list[dict],
    errors: list[str],
    verify: dict,
    faults: list[str],
) -> dict:
    """The run's figures (JSON-able); see the module."""
    done, failed = _per_bucket(board)
    duration = ran_s
    downs = [(t - start) / 1e9 for r in results for t, up, _ in r["health"] if not up]
    _around(events, done, failed, downs, duration, config.window_s)
    counts: Counter[str] = Counter()
    reads: list[tuple[float, float]] = []
    for result in results:
        counts.update(result["counts"])
        reads += [(began, took) for began, took in result["reads"]]
    latencies = [took for _, took in reads]
    # reads that overlap no fault (nor the window after it): the store's pace under load alone
    spans = [(e["at_s"], e["end_s"] + config.window_s) for e in events]
    quiet = [took for began, took in reads if not any(began < b and began + took > a for a, b in spans)]
    verified = verify.get("counts", {})
    left_before = verify.get("killed_left_before", {})
    wrong_live = int(np.asarray(board[1:, WRONG]).sum())  # killed clients' too
    span = math.ceil(duration / BUCKET_S)
    series = (done[: span + int(1 / BUCKET_S)] / BUCKET_S).tolist()  # and the drain's first second
    return {
        "store": kind,
        "clients": config.clients,
        "faults": faults,
        "duration_s": duration,
        "ops_s": float(done[:span].sum()) / duration,
        "failed_ops_s": float(failed[:span].sum()) / duration,
        "blocks_done": int(done.sum()),
        "blocks_failed": int(failed.sum()),
        "read_batches": len(latencies),
        "read_p50_ms": 1e3 * float(np.percentile(latencies, 50)) if latencies else None,
        "read_p99_ms": 1e3 * float(np.percentile(latencies, 99)) if latencies else None,
        "quiet_reads": len(quiet),
        "quiet_read_p50_ms": 1e3 * float(np.percentile(quiet, 50)) if quiet else None,
        "quiet_read_p99_ms": 1e3 * float(np.percentile(quiet, 99)) if quiet else None,
        "wrong": wrong_live
        + int(verified.get("wrong", 0))
        + int(left_before.get("wrong", 0))
        + verify.get("killed_left_wrong", 0),
        "wrong_names": [n for r in results for n in r["wrong_names"]],
        "checked_at_end": verify.get("checked", 0),
        "present_at_end": int(verified.get("present", 0)),
        **_lost(verify, events, start),
        "restart_loses": RESTART_LOSES[kind] if "restart" in faults else None,
        # blocks a killed client was writing: absent or whole before, readable once written again
        "killed_left": verify.get("killed_left", 0),
        "killed_left_served": int(left_before.get("ok", 0)),
        "killed_left_first_try": verify.get("killed_left_first_try", 0),
        **_killed_timing(verify, events, start),
        "killed_left_never": verify.get("killed_left_never", 0),
        "refused_at_end": sum(int(v) for k, v in verified.items() if k not in ("present", "wrong", "lost")),
        "leaked_slots": sum(r["leaked_slots"] for r in results),
        "hung_ops": sum(r["hung_ops"] for r in results),
        "unclosed_tiers": sum(1 for r in results if not r["closed"]),
        "unreachable": sum(r["unreachable"] for r in results),
        "refused": sum(counts[k] for k in REFUSED),
        "read_io_errors": counts["read_io_error"],
        "write_failed": counts["write_failed"],
        "counts": dict(counts),
        "events": events,
        "errors": errors + ([verify["error"]] if "error" in verify else []),
        "ops_s_series": series,
        "bucket_s": BUCKET_S,
    }


def failures(row: dict) -> list[str]:
    """What in a store's figures must not happen: wrong KV, a leak, a hang, an error."""
    out = [f"{row['store']}: {e}" for e in row["errors"]]
    for field, what in (
        ("wrong", "values served wrong"),
        ("leaked_slots", "host slots leaked"),
        ("hung_ops", "batches past their deadline"),
        ("unclosed_tiers", "tiers that did not close"),
        ("lost_unexplained", "values lost that no restart explains"),
        ("killed_left_never", "names a killed client was writing that never read back once written again"),
    ):
        if row[field]:
            out.append(f"{row['store']}: {row[field]} {what}")
    for event in row["events"]:
        if not event["done_after"]:
            out.append(f"{row['store']}: nothing done after {event['fault']} at {event['at_s']:.1f} s")
    return out
