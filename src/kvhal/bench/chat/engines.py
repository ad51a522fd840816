"""``kvhal bench chat``'s engines: one process per engine (two sharing a store), each running the
whole workload of one configuration."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvhal.bench.chat.slow_tier import SLOW_TIER, install
from kvhal.bench.chat.workload import DTYPE, TOP_LOGPROBS
from kvhal.bench.counters import by_tier, store_tier
from kvhal.bench.e2e import SHARING_ENV
from kvhal.testing.scenario import JobEngine, run_scenario

KV_CACHE_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


#: What every kvhal configuration adds to its extra config: a chat's next prompt holds the
#: answers too, and vLLM's own prefix cache (the floor) keeps them, so kvhal stores the
#: blocks decoding fills as well as the prompt's (``offload_prompt_only`` is true by default,
#: as vLLM's offloading has it). With prompt blocks alone, each returning turn recomputed its
#: previous answer: 2,435 tokens a round where the floor computes 1,955 (BENCHMARKS.md).
CHAT_KVHAL = {"offload_prompt_only": False}


#: Seconds an engine of the shared configuration pauses after its half-round (writes land);
#: then it steps until kvhal has nothing in flight (a store writing slower than that).
SETTLE = 1.0


def engine_args(size: dict, device_tokens: int) -> dict[str, Any]:
    return {
        "max_model_len": size["max_model_len"],
        "max_num_batched_tokens": max(2048, size["max_model_len"]),
        "max_num_seqs": 8,
        "kv_cache_memory_bytes": device_tokens * size["kv_bytes_per_token"],
        "disable_log_stats": False,  # metrics, and vLLM's own first_token_latency
        "dtype": DTYPE,
    }


def _kv_cache_tokens(log: str) -> int | None:
    found = KV_CACHE_LINE.findall(log)
    return int(found[-1].replace(",", "")) if found else None


def _delta(after: dict, before: dict | None, name: str) -> float:
    return (after or {}).get(name, 0) - (before or {}).get(name, 0)


def _tier_deltas(after: dict | None, before: dict | None, family: str) -> dict[str, float]:
    """A per-tier counter family's growth between two ``metrics`` steps, by tier."""
    old = by_tier(before or {}, family)
    return {tier: value - old.get(tier, 0) for tier, value in by_tier(after or {}, family).items()}


def round_tiers(
    requests: list[dict], after: dict | None, before: dict | None, store: str | None = None
) -> dict[str, float]:
    """Prompt tokens of one round (one engine's share) by where they came from: the host tier,
    the tier below it (``disk``: the disk, or the slow configuration's tier), the store the
    engines share (tier ``store``)."""
    prompt = sum(q["prompt_tokens"] for q in requests)
    cached = sum(q["num_cached_tokens"] for q in requests)
    kvhal = sum(q["kvhal_loaded_tokens"] or 0 for q in requests)
    below = _tier_deltas(after, before, "tier_hit_tokens")
    remote = below.pop(store, 0) if store is not None else 0
    disk = sum(below.values())
    return {
        "prompt": prompt,
        "vllm_prefix_cache": cached - kvhal,
        "kvhal": kvhal,
        "kvhal_hit_tokens": _delta(after, before, "vllm:kvhal_hit_tokens"),
        "host": kvhal - disk - remote,
        "disk": disk,
        "remote": remote,
        "computed": prompt - cached,
        "failed_loads": _delta(after, before, "vllm:kvhal_failed_loads"),
        "remote_dropped_blocks": sum(_tier_deltas(after, before, "tier_dropped_blocks").values()),
        # the small device cache is sized for the requests in flight: a preemption is a sizing bug
        "preemptions": _delta(after, before, "vllm:num_preemptions"),
    }


def _rounds_of(chat: dict, engine: str | None = None, store: str | None = None) -> list[dict]:
    """A ``chat`` record's rounds, with each round's tier split and the engine named (``store``:
    the name the engines' shared store counts under)."""
    rounds, before = [], chat.get("metrics_before")
    for record in chat["rounds"]:
        after = record.get("metrics")
        for q in record["requests"]:
            q["engine"] = engine
        rounds.append(
            {
                "seconds": record["seconds"],
                "requests": record["requests"],
                "tiers": round_tiers(record["requests"], after, before, store),
                "load_avg": record.get("load_avg"),
                "steps": record.get("steps"),
                "thread_cpu_s": record.get("thread_cpu_s") or {},
            }
        )
        before = after
    return rounds


def warm_up(work: dict, engine: int, args: argparse.Namespace) -> dict:
    """A ``chat`` step of prompts no user has (not measured): kernels, allocations, logprobs."""
    prompts = work["warm_up"][engine]
    return {
        "op": "chat",
        "tag": f"warm-up-{engine}",
        "histories": prompts,
        "users": list(range(len(prompts))),
        "turns": [[[] for _ in prompts]],
        "max_tokens": args.max_tokens,
        "inflight": args.inflight,
        "logprobs": TOP_LOGPROBS,
        "metrics": False,
    }


def _metric_prefixes() -> list[str]:
    return ["vllm:kvhal_", "vllm:prompt_tokens", "vllm:external_prefix_cache"]


def single_engine(
    name: str,
    model: str,
    work: dict,
    size: dict,
    kvhal: dict | None,
    device: int,
    args: argparse.Namespace,
    answers: list[list[list[int]]] | None,
    env: dict[str, str] | None = None,
) -> dict:
    """One engine serves the whole workload (every configuration but ``shared``)."""
    users = list(range(len(work["contexts"])))
    steps = [
        warm_up(work, 0, args),
        {
            "op": "chat",
            "tag": name,
            "histories": work["contexts"],
            "users": users,
            "turns": work["turns"],
            "answers": answers,
            "max_tokens": args.max_tokens,
            "inflight": args.inflight,
            "logprobs": TOP_LOGPROBS,
            "trace": args.trace,
        },
        {"op": "metrics", "prefixes": _metric_prefixes()},
    ]
    result = run_scenario(
        {
            "model": model,
            "kvhal": kvhal,
            "steps": steps,
            "engine": engine_args(size, device),
            "env": {**SHARING_ENV, **(env or {})},
        },
        timeout=3600,
    )
    chat = result["steps"][1]
    rounds = _rounds_of(chat)
    return {
        "rounds": rounds,
        "engine_start_s": [result["engine_start_seconds"]],
        "kv_cache_tokens": [_kv_cache_tokens(result["stderr"])],
        "metrics": result["steps"][2]["metrics"],
        "kvhal_device": result.get("kvhal_device"),
    }


#: The stores ``--store`` may start for the shared configuration.
SHARED_STORES = ("redis", "mooncake", "s3")


@dataclass
class SharedStore:
    """A store started for one run of the shared configuration: its URL, what its engines need
    in their environment to reach it (an S3 bucket's credentials), and its server."""

    url: str
    server: Any
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pids(self) -> list[int]:
        """The server's processes (their CPU time is the store server's)."""
        return self.server.pids


@contextlib.contextmanager
def remote_store(kind: str) -> Iterator[SharedStore]:
    """A fresh store of ``kind`` (:data:`SHARED_STORES`) on loopback."""
    if kind == "mooncake":
        from kvhal.testing.mooncake_servers import MooncakeCluster

        with MooncakeCluster(segment="4GB") as cluster:
            yield SharedStore(cluster.url, cluster)
    elif kind == "s3":
        from kvhal.testing.seaweedfs_servers import SeaweedS3

        with SeaweedS3() as s3:  # one weed server: master, volume server, filer, S3 gateway
            yield SharedStore(s3.url(prefix="chat"), s3, s3.credentials)
    elif kind == "redis":
        from kvhal.testing.redis_servers import RedisServer

        with RedisServer() as server:
            yield SharedStore(server.url, server)
    else:
        raise ValueError(f"unknown store {kind!r}: one of {', '.join(SHARED_STORES)}")


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds the processes ``pids`` and their children have spent so far."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            process = psutil.Process(pid)
            for one in [process, *process.children(recursive=True)]:
                times = one.cpu_times()
                total += times.user + times.system
        except psutil.Error:  # ended meanwhile
            continue
    return total


def shared_engines(
    model: str,
    work: dict,
    size: dict,
    store: SharedStore,
    folder: Path,
    args: argparse.Namespace,
    advance: Callable[[str], None],
    answers: list[list[list[int]]] | None,
) -> dict:
    """Two live engines on one remote tier; user ``u`` in round ``r`` on engine ``(u + r) % 2``."""
    kvhal = {
        "cpu_bytes_to_use": size["host_tokens"] * size["kv_bytes_per_token"],
        "remote_url": store.url,
        **CHAT_KVHAL,
        "load_mode": args.load_mode,
        **getattr(args, "store_options", {}),  # --store-option
    }
    engines = []
    for e in range(2):
        spec = {
            "model": model,
            "kvhal": kvhal,
            "steps": [
                warm_up(work, e, args),
                {"op": "chat_jobs", "folder": str(folder / f"engine-{e}")},
                {"op": "metrics", "prefixes": _metric_prefixes()},
            ],
            "engine": engine_args(size, size["small_device_tokens"]),
            # values authenticated, as a fleet runs by default (remote_auth "hmac")
            "env": {**SHARING_ENV, "KVHAL_REMOTE_SECRET": "kvhal-bench-chat", **store.env},
        }
        engines.append(JobEngine(spec, folder / f"engine-{e}"))
    try:
        for engine in engines:
            engine.ready()
        histories = [list(c) for c in work["contexts"]]
        rounds = []
        for r, turns in enumerate(work["turns"]):
            merged: dict[str, Any] = {"seconds": 0.0, "requests": [], "tiers": {}}
            merged.update({"load_avg": [], "steps": [], "thread_cpu_s": {}})
            merged.update({"store_cpu_s": 0.0, "store_wall_s": 0.0, "writes_landed_s": 0.0})
            for e, engine in enumerate(engines):
                users = [u for u in range(len(histories)) if (u + r) % 2 == e]
                if not users:
                    continue
                chat = {
                    "op": "chat",
                    "tag": f"shared-{'AB'[e]}",
                    "histories": [histories[u] for u in users],
                    "users": users,
                    "turns": [[turns[u] for u in users]],
                    "answers": [[answers[r][u] for u in users]] if answers else None,
                    "max_tokens": args.max_tokens,
                    "inflight": args.inflight,
                    "logprobs": TOP_LOGPROBS,
                    "trace": args.trace,
                }
                job = {"chat": chat, "drain_prompt": work["drain"], "drain_tokens": 4, "settle": SETTLE}
                job["land_writes"] = True  # and then until the writes landed: the other engine reads them
                store_cpu, store_wall = cpu_seconds(store.pids), time.perf_counter()
                out = engine.answer(job)
                # the store's work during the half-round and its settle (its writes landing)
                merged["store_cpu_s"] += cpu_seconds(store.pids) - store_cpu
                merged["store_wall_s"] += time.perf_counter() - store_wall
                merged["writes_landed_s"] += out.get("writes_landed_s", 0.0)
                for u, history in zip(users, out["histories"], strict=True):
                    histories[u] = history
                (half,) = _rounds_of(out, engine="AB"[e], store=store_tier(store.url))
                merged["seconds"] += half["seconds"]
                merged["requests"] += half["requests"]
                for key, value in half["tiers"].items():
                    merged["tiers"][key] = merged["tiers"].get(key, 0) + value
                for name, seconds in half["thread_cpu_s"].items():
                    merged["thread_cpu_s"][name] = merged["thread_cpu_s"].get(name, 0) + seconds
                merged["load_avg"].append(half["load_avg"])
                merged["steps"].append(half["steps"])
                advance(f"round {r + 1}, engine {'AB'[e]}")
            merged["requests"].sort(key=lambda q: q["user"])
            rounds.append(merged)
    finally:
        results, failures = [], []
        for engine in engines:
            try:
                results.append(engine.stop())
            except BaseException as error:  # the first failure is raised below
                results.append(None)
                failures.append(error)
    if failures:
        raise RuntimeError("an engine of the shared configuration failed") from failures[0]
    return {
        "rounds": rounds,
        "engine_start_s": [r["engine_start_seconds"] for r in results],
        "kv_cache_tokens": [_kv_cache_tokens(r["stderr"]) for r in results],
        "metrics": [r["steps"][-1]["metrics"] for r in results],
        "kvhal_device": results[0].get("kvhal_device"),
    }


def run_config(
    name: str,
    model: str,
    work: dict,
    size: dict,
    scratch: Path,
    repeat: int,
    args: argparse.Namespace,
    advance: Callable[[str], None],
    answers: list[list[list[int]]] | None = None,
) -> dict:
    per_token = size["kv_bytes_per_token"]
    load_before = os.getloadavg()
    start = time.perf_counter()
    if name == "shared":
        with remote_store(args.store) as store:
            folder = scratch / f"shared-{repeat}"
            run = shared_engines(model, work, size, store, folder, args, advance, answers)
        run["store"] = args.store
    else:
        device = size["big_device_tokens"] if name == "floor" else size["small_device_tokens"]
        kvhal: dict | None = None
        env: dict[str, str] = {}
        if name in ("host", "cold-host"):
            kvhal = {"cpu_bytes_to_use": size["host_tokens"] * per_token, **CHAT_KVHAL}
        elif name == "disk":
            kvhal = {
                "cpu_bytes_to_use": size["small_host_tokens"] * per_token,
                **CHAT_KVHAL,
                "disk_path": str(scratch / f"disk-{repeat}"),
                "disk_bytes_to_use": size["disk_tokens"] * per_token,
            }
        elif name == "slow":
            kvhal = {
                "cpu_bytes_to_use": size["small_host_tokens"] * per_token,
                **CHAT_KVHAL,
                "tier_backend": SLOW_TIER,
                "tier_options": {
                    "path": str(scratch / f"disk-{repeat}"),
                    "bytes_to_use": size["disk_tokens"] * per_token,
                    "read_bytes_per_s": args.slow_tier_mb_s * 1e6,
                },
            }
            env = {
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(install(scratch / "plugins")), os.environ.get("PYTHONPATH")])
                )
            }
        if kvhal is not None:
            kvhal["load_mode"] = args.load_mode
        try:
            run = single_engine(name, model, work, size, kvhal, device, args, answers, env)
        finally:
            shutil.rmtree(scratch / f"disk-{repeat}", ignore_errors=True)
        advance(f"{name}: done")
    run.update(
        {
            "config": name,
            "repeat": repeat,
            "scripted": answers is not None,
            "wall_s": time.perf_counter() - start,
            "load_before": load_before,
            "load_after": os.getloadavg(),
        }
    )
    return run
