"""The scheduler side's cost on the engine thread, without the engine (issue 40, item 5).

``record``: runs a command (``kvhal bench chat ...``) with every engine's
:class:`~kvhal.vllm.scheduler_side.SchedulerSide` recorded call by call, from its
construction: each hook's arguments as kvhal reads them (a request's counts and block
hashes, the scheduler output's block tables, the workers' output) and its answer, into
``DIR/sched-<pid>-<n>.jsonl`` (JSON lines: :mod:`recording_json`). ``replay``: runs a
recording's calls again on a fresh
``SchedulerSide`` of whichever kvhal is imported (``PYTHONPATH``), several passes, checks that
every answer is the recording's (build_connector_meta's metadata, lookups, request_finished),
and prints each hook's wall and CPU time per step (per step: the fastest pass)::

    PYTHONPATH=scripts/probes .venv/bin/python -m scheduler_calls record /tmp/rec -- \\
        .venv/bin/kvhal bench chat --configs host --users 8 --rounds 3 --repeats 1 --out /tmp/r
    PYTHONPATH=src .venv/bin/python scripts/probes/scheduler_calls.py replay /tmp/rec/sched-*.jsonl

A step is the calls from one ``build_connector_meta`` to the next one, that one included
(the previous step's output, this step's lookups and allocations). Steps computing returning
turns are those whose metadata carries a load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from recording_json import Blocks, Obj, Req, Tables, decode, encode

HOOKS = (
    "track",
    "lookup",
    "after_alloc",
    "hit_sources",
    "build_meta",
    "on_output",
    "request_finished",
    "take_events",
    "take_stats",
    "has_held_blocks",
    "has_jobs_in_flight",
)


def _output(so: Any) -> Obj:
    state = getattr(so, "kv_connector_block_state", None)
    tables = None
    if state is not None:
        tables = Tables({rid: state.get_block_ids(rid) for rid in so.num_scheduled_tokens})
    cached = so.scheduled_cached_reqs
    return Obj(
        num_scheduled_tokens=dict(so.num_scheduled_tokens),
        total_num_scheduled_tokens=so.total_num_scheduled_tokens,
        scheduled_new_reqs=[
            Obj(req_id=n.req_id, num_computed_tokens=n.num_computed_tokens, block_ids=n.block_ids)
            for n in so.scheduled_new_reqs
        ],
        scheduled_cached_reqs=Obj(
            req_ids=list(cached.req_ids),
            new_block_ids=list(cached.new_block_ids),
            resumed_req_ids=set(getattr(cached, "resumed_req_ids", ()) or ()),
        ),
        preempted_req_ids=set(so.preempted_req_ids or ()),
        finished_req_ids=set(so.finished_req_ids),
        kv_cache_block_copies=[Obj(dst_block_id=c.dst_block_id) for c in (so.kv_cache_block_copies or ())],
        new_block_ids_to_zero=list(getattr(so, "new_block_ids_to_zero", None) or ()),
        kv_connector_block_state=tables,
    )


# -- record ----------------------------------------------------------------------------


class _Recorder:
    def __init__(self, path: Path) -> None:
        self.file = path.open("ab")
        self.live: dict[str, Any] = {}  # req id -> vLLM's Request, while tracked
        self.seen: dict[str, tuple] = {}  # req id -> the counts last written

    def requests(self) -> list:
        """The tracked requests that changed since the last call."""
        out = []
        for rid, r in self.live.items():
            now = (r.num_tokens, r.num_computed_tokens, r.num_prompt_tokens, len(r.block_hashes))
            last = self.seen.get(rid)
            if last != now:
                start = last[3] if last else 0
                out.append((rid, now, [bytes(h) for h in r.block_hashes[start:]], r.cache_salt))
                self.seen[rid] = now
        return out

    def write(self, item: Any) -> None:
        self.file.write(json.dumps(encode(item), separators=(",", ":")).encode() + b"\n")


def _arg(rec: _Recorder, value: Any) -> Any:
    name = type(value).__name__
    if name == "Request":
        rec.live[value.request_id] = value
        return ("REQ", value.request_id)
    if name == "KVCacheBlocks":
        return Blocks(value.get_block_ids())
    if name == "SchedulerOutput":
        return _output(value)
    return value


def _answer(hook: str, out: Any) -> Any:
    if hook in ("track", "take_stats", "take_events"):
        return None
    return out


def install_recorder(directory: str) -> None:
    """Wrap SchedulerSide's hooks once kvhal.vllm.scheduler_side is imported."""
    import importlib.abc
    import importlib.util

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != "kvhal.vllm.scheduler_side":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            loader = spec.loader
            original = loader.exec_module

            def exec_module(module: Any) -> None:
                original(module)
                _wrap(module.SchedulerSide, Path(directory))

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def _wrap(cls: Any, directory: Path) -> None:
    init = cls.__post_init__
    count = [0]

    def post_init(self: Any) -> None:
        init(self)
        count[0] += 1
        self._rec = _Recorder(directory / f"sched-{os.getpid()}-{count[0]}.jsonl")
        self._rec.write(("init", self.config, self.kv_events))
        self._rec.file.flush()

    cls.__post_init__ = post_init
    for hook in HOOKS:
        _wrap_hook(cls, hook)


def _wrap_hook(cls: Any, hook: str) -> None:
    method = getattr(cls, hook)

    def recorded(self: Any, *args: Any) -> Any:
        rec = getattr(self, "_rec", None)
        if rec is None or getattr(self, "_in_hook", False):
            return method(self, *args)
        conv = [_arg(rec, a) for a in args]
        self._in_hook = True
        try:
            out = method(self, *args)
        finally:
            self._in_hook = False
        rec.write((hook, rec.requests(), conv, _answer(hook, out)))
        if hook == "request_finished":
            rec.live.pop(args[0].request_id, None)
        if hook == "build_meta":
            rec.file.flush()
        return out

    setattr(cls, hook, recorded)


# -- replay ----------------------------------------------------------------------------


def _load(path: str) -> list:
    with open(path, "rb") as f:
        return [decode(json.loads(line)) for line in f if line.strip()]


def _pass(items: list, check: bool) -> tuple[list[dict], list[bool], int]:
    """One pass: per step, each hook's (wall ns, CPU ns); whether each step loads; mismatches."""
    from kvhal.vllm.scheduler_side import SchedulerSide

    _, config, kv_events = items[0]
    side = SchedulerSide(config, kv_events=kv_events)
    reqs: dict[str, Req] = {}
    steps: list[dict] = []
    loads: list[bool] = []
    step: dict[str, list[int]] = {}
    mismatches = 0
    perf, cpu = time.perf_counter_ns, time.thread_time_ns
    for hook, changed, args, answer in items[1:]:
        for rid, (n_tok, n_comp, n_prompt, _), hashes, salt in changed:
            r = reqs.get(rid) or reqs.setdefault(rid, Req(rid))
            r.num_tokens, r.num_computed_tokens, r.num_prompt_tokens, r.cache_salt = (
                n_tok,
                n_comp,
                n_prompt,
                salt,
            )
            r.block_hashes.extend(hashes)
        call = [reqs[a[1]] if isinstance(a, tuple) and a[:1] == ("REQ",) else a for a in args]
        method = getattr(side, hook)
        c0, w0 = cpu(), perf()
        out = method(*call)
        w1, c1 = perf(), cpu()
        spent = step.setdefault(hook, [0, 0, 0])
        spent[0] += w1 - w0
        spent[1] += c1 - c0
        spent[2] += 1
        if check and answer is not None and out != answer:
            mismatches += 1
            if mismatches <= 3:
                print(f"  differs: {hook} -> {out!r:.300} (recorded {answer!r:.300})", file=sys.stderr)
        if hook == "request_finished":
            reqs.pop(call[0].request_id, None)
        if hook == "build_meta":
            steps.append(step)
            loads.append(bool(out.loads))
            step = {}
    return steps, loads, mismatches


def replay(paths: list[str], passes: int, out: str | None) -> None:
    report: dict[str, Any] = {"python_path": os.environ.get("PYTHONPATH", ""), "recordings": []}
    for path in paths:
        items = _load(path)
        if len(items) < 2:
            continue
        runs = []
        mismatches = 0
        for i in range(passes):
            steps, loads, bad = _pass(items, check=i == 0)
            runs.append(steps)
            mismatches += bad
        n = len(runs[0])
        # per step and hook: the fastest pass (the machine's other load only adds)
        best = [
            {
                h: [min(r[s].get(h, [0, 0, 0])[k] for r in runs) for k in range(3)]
                for h in HOOKS
                if h in runs[0][s]
            }
            for s in range(n)
        ]
        summary = {"recording": path, "steps": n, "load_steps": sum(loads), "mismatches": mismatches}
        for label, chosen in (("all", range(n)), ("load", [s for s in range(n) if loads[s]])):
            if not chosen:
                continue
            walls = [sum(v[0] for v in best[s].values()) / 1e3 for s in chosen]
            cpus = [sum(v[1] for v in best[s].values()) / 1e3 for s in chosen]
            hooks = {
                h: {
                    "wall_us": round(
                        sum(best[s].get(h, [0, 0, 0])[0] for s in chosen) / len(chosen) / 1e3, 1
                    ),
                    "cpu_us": round(sum(best[s].get(h, [0, 0, 0])[1] for s in chosen) / len(chosen) / 1e3, 1),
                    "calls": round(sum(best[s].get(h, [0, 0, 0])[2] for s in chosen) / len(chosen), 2),
                }
                for h in HOOKS
            }
            summary[label] = {
                "steps": len(chosen),
                "wall_us": {
                    "mean": round(statistics.mean(walls), 1),
                    "median": round(statistics.median(walls), 1),
                    "p90": round(_p90(walls), 1),
                },
                "cpu_us": {
                    "mean": round(statistics.mean(cpus), 1),
                    "median": round(statistics.median(cpus), 1),
                    "p90": round(_p90(cpus), 1),
                },
                "hooks": hooks,
            }
        report["recordings"].append(summary)
        _print(summary)
    if out:
        Path(out).write_text(json.dumps(report, indent=1))


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "mean": round(statistics.mean(values), 1),
        "median": round(statistics.median(values), 1),
        "p90": round(_p90(values), 1),
    }


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _print(summary: dict) -> None:
    print(
        f"{summary['recording']}: {summary['steps']} steps ({summary['load_steps']} loading), "
        f"{summary['mismatches']} answers differing from the recording"
    )
    for label in ("all", "load"):
        s = summary.get(label)
        if not s:
            continue
        print(
            f"  {label} steps ({s['steps']}): wall us mean {s['wall_us']['mean']} median "
            f"{s['wall_us']['median']} p90 {s['wall_us']['p90']}; CPU us mean {s['cpu_us']['mean']} "
            f"median {s['cpu_us']['median']} p90 {s['cpu_us']['p90']}"
        )
        ranked = sorted(s["hooks"].items(), key=lambda kv: -kv[1]["wall_us"])
        print("    " + ", ".join(f"{h} {v['wall_us']}/{v['cpu_us']}" for h, v in ranked if v["calls"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("dir")
    rec.add_argument("command", nargs=argparse.REMAINDER)
    rep = sub.add_parser("replay")
    rep.add_argument("recordings", nargs="+")
    rep.add_argument("--passes", type=int, default=5)
    rep.add_argument("--json")
    wrk = sub.add_parser("worker")
    wrk.add_argument("traces", nargs="+")
    wrk.add_argument("--passes", type=int, default=5)
    wrk.add_argument("--json")
    rep.add_argument("--profile", type=int, metavar="N", help="cProfile the passes: the top N functions")
    args = parser.parse_args()
    if args.cmd == "record":
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as site:
            Path(site, "sitecustomize.py").write_text(
                f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                "import scheduler_calls\n"
                f"scheduler_calls.install_recorder({str(Path(args.dir).resolve())!r})\n"
            )
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            sys.exit(subprocess.call(command, env=env))
    if args.cmd == "worker":
        from worker_calls import worker

        worker(args.traces, args.passes, args.json)
        return
    if args.profile:
        import cProfile
        import pstats

        items = [_load(p) for p in args.recordings]
        profiler = cProfile.Profile()
        for _ in range(args.passes):
            for recording in items:
                profiler.enable()
                _pass(recording, check=False)
                profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        return
    replay(args.recordings, args.passes, args.json)


if __name__ == "__main__":
    main()
