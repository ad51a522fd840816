"""``scheduler_calls.py worker``: the worker side's cost on the engine thread, per step, from
``kvhal replay`` of a worker trace on the CPU plugin (issue 40, item 5); the steps whose
metadata carries loads (a returning turn's) apart."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from scheduler_calls import _stats

LOADING = "(loads)"  # a step's mark: its metadata carries loads
WORKER_CALLS = {
    "begin_step": "begin",
    "start_loads": "loads",
    "layer": "layer",
    "start_stores": "stores",
    "collect": "collect",
    "take_load_errors": "load_errors",
    "worker_meta": "worker_meta",
    "take_stats": "stats",
}


def worker(traces: list[str], passes: int, out: str | None) -> None:
    """``kvhal replay`` of worker traces on the CPU plugin, each worker-side call's wall and CPU
    time (its thread's) per step; an idle step's collect, which waits for a job by design
    (``IDLE_WAIT_S``), apart. Per step: the fastest pass."""
    import kvhal.replay
    from kvhal.vllm.worker_side import WorkerSide

    calls: list[tuple[str, int, int]] = []
    originals = {name: getattr(WorkerSide, name) for name in WORKER_CALLS}
    catching_up = [False]  # the replay polling until the recording's jobs ended: not vLLM's calls
    catch_up = kvhal.replay._catch_up

    def caught_up(*args: Any) -> None:
        catching_up[0] = True
        try:
            catch_up(*args)
        finally:
            catching_up[0] = False

    kvhal.replay._catch_up = caught_up
    # the replay's checks of each load's and store's bytes run inside the worker's calls (its
    # observer; in an engine, a no-op): their time is taken out of the call's
    observed = [0, 0]

    def observing(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                observed[0] += time.perf_counter_ns() - w0
                observed[1] += time.thread_time_ns() - c0

        return call

    for hook in ("stored", "ended"):
        setattr(kvhal.replay._Checks, hook, observing(getattr(kvhal.replay._Checks, hook)))

    def timed(name: str) -> Any:
        method = originals[name]

        def call(self: Any, *args: Any) -> Any:
            if catching_up[0]:
                return method(self, *args)
            label = WORKER_CALLS[name]
            if name == "collect" and self._idle and self.jobs_in_flight:
                label = "collect (idle, may wait)"
            if name == "start_loads" and args and getattr(args[0], "loads", None):
                calls.append((LOADING, 0, 0))  # this step loads: a returning turn's
            before = list(observed)
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return method(self, *args)
            finally:
                wall, cpu = time.perf_counter_ns() - w0, time.thread_time_ns() - c0
                calls.append((label, wall - observed[0] + before[0], cpu - observed[1] + before[1]))

        return call

    for name in WORKER_CALLS:
        setattr(WorkerSide, name, timed(name))
    report: dict[str, Any] = {"python_path": os.environ.get("PYTHONPATH", ""), "traces": []}
    for trace in traces:
        runs = []
        for _ in range(passes):
            calls.clear()
            result = kvhal.replay.replay(trace, "cpu")
            if result.status != "passed":
                raise SystemExit(f"{trace}: {result.status} {result.reason}")
            steps: list[dict[str, list[int]]] = []
            for label, wall, cpu in calls:
                if label == "begin" or not steps:
                    steps.append({})
                spent = steps[-1].setdefault(label, [0, 0])
                spent[0] += wall
                spent[1] += cpu
            runs.append(steps)
        n = min(len(r) for r in runs)
        labels = sorted({label for r in runs for s in r for label in s} - {LOADING})
        best = [
            {lb: [min(r[s].get(lb, [0, 0])[k] for r in runs) for k in range(2)] for lb in labels}
            for s in range(n)
        ]
        busy = [
            {
                k: sum(v[k] for lb, v in step.items() if not lb.startswith("collect (idle")) / 1e3
                for k in (0, 1)
            }
            for step in best
        ]
        summary: dict[str, Any] = {"trace": trace, "steps": n, "passes": passes}
        summary["step_wall_us"] = _stats([b[0] for b in busy])
        summary["step_cpu_us"] = _stats([b[1] for b in busy])
        loading = [b for b, step in zip(busy, runs[0][:n], strict=True) if LOADING in step]
        summary["load_steps"] = len(loading)
        summary["load_step_wall_us"] = _stats([b[0] for b in loading])
        summary["load_step_cpu_us"] = _stats([b[1] for b in loading])
        marked = [s for s in range(n) if LOADING in runs[0][s]]
        summary["load_step_calls"] = {
            lb: {
                k: _stats([best[s][lb][i] / 1e3 for s in marked]) for i, k in ((0, "wall_us"), (1, "cpu_us"))
            }
            for lb in labels
        }
        summary["calls"] = {
            lb: {
                "wall_us": _stats([s[lb][0] / 1e3 for s in best if s[lb][0]]),
                "cpu_us": _stats([s[lb][1] / 1e3 for s in best if s[lb][0]]),
            }
            for lb in labels
        }
        report["traces"].append(summary)
        print(f"{trace}: {n} steps, the fastest of {passes} passes; a step's calls but an idle collect:")
        print(f"  wall us {summary['step_wall_us']}; CPU us {summary['step_cpu_us']}")
        print(
            f"  the {len(loading)} steps that load: wall us {summary['load_step_wall_us']}; "
            f"CPU us {summary['load_step_cpu_us']}; by call (mean wall/CPU): "
            + ", ".join(
                f"{lb} {v['wall_us']['mean']}/{v['cpu_us']['mean']}"
                for lb, v in summary["load_step_calls"].items()
                if v["wall_us"]
            )
        )
        for lb, v in summary["calls"].items():
            print(f"  {lb}: wall {v['wall_us']}, CPU {v['cpu_us']}")
    if out:
        Path(out).write_text(json.dumps(report, indent=1))
