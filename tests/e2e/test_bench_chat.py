"""``kvhal bench chat`` at a tiny size on real vLLM engines: it runs, writes its JSON and plot,
checks the outputs, and kvhal serves the returning turns (no speed targets here).

One run covers every kvhal configuration (host; disk below a small host tier; two engines
sharing a Redis server) against one floor: each configuration's engines start once. Its kvhal
engines record their workers' traces (``KVHAL_TRACE_DIR``), which are replayed on the CPU
plugin: an engine's trace replays. Recording hashes every stored and loaded block on the
engine's thread (0.34-0.39 ms per 192 KiB block of this model, one thread at load 10; under
100 blocks an engine here: < 40 ms) and writes a few KB at shutdown; the replays take about
a second: nothing beside the five engines' starts (the run took 570 s at load 11)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhal.bench.chat.checks import STEP_PARTS
from kvhal.bench.chat.slow_tier import SLOW_TIER
from kvhal.cli import main
from kvhal.replay import replay
from kvhal.vllm.trace import TRACE_DIR_VARIABLE, load
from tests.e2e.common import MODEL_CACHE


def tiny_bench(out, rounds: int, *more: str) -> dict:
    """``kvhal bench chat`` at a tiny size (4 users, one repeat) with ``more`` arguments: its JSON,
    once the run passed its outputs checks."""
    argv = ["bench", "chat", "--users", "4", "--rounds", str(rounds), "--context", "96", "160"]
    argv += ["--turn", "32", "--max-tokens", "8", "--inflight", "1", "--repeats", "1", *more]
    argv += ["--models", str(MODEL_CACHE), "--out", str(out)]
    assert main(argv) == 0, "an outputs check failed"
    return json.loads((out / "chat.json").read_text())


@pytest.fixture(scope="module")
def floor_host_disk_shared(tmp_path_factory, vllm_installed) -> tuple[Path, dict, Path]:
    """The bench's folder and JSON, and the folder of its kvhal engines' worker traces."""
    pytest.importorskip("redis")
    out, traces = tmp_path_factory.mktemp("bench") / "out", tmp_path_factory.mktemp("traces")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(TRACE_DIR_VARIABLE, str(traces))  # the engines' environment is this process's
        result = tiny_bench(out, 2, "--configs", "floor", "host", "disk", "shared", "--store", "redis")
    return out, result, traces


@pytest.mark.timeout(600)  # six engines in a row, each started from a fresh interpreter
def test_chat_bench_floor_host_disk_and_shared(floor_host_disk_shared):
    """Round 2 of the host configuration comes from the host tier, of the disk configuration
    from the disk tier (its host tier is too small), and of the shared configuration from the
    other engine, through a Redis server."""
    out, result, _ = floor_host_disk_shared
    assert (out / "chat.png").stat().st_size > 0
    assert [p.name for p in out.iterdir() if p.is_dir()] == [], "the bench left its scratch folder behind"

    summary = result["summary"]
    assert list(summary) == ["floor", "host", "disk", "shared"]
    for name, s in summary.items():
        assert [row["round"] for row in s["rounds"]] == [1, 2], name
        for row in s["rounds"]:
            assert row["ttft"]["n"] == 4 and 0 < row["ttft"]["p50"] <= row["ttft"]["p90"], (name, row)
            assert row["ttft"]["mean"] > 0
        assert s["ttft_later"]["n"] == 4 and s["output_tokens_per_s"] > 0
        # where the CPU went in round 2: the engine's forward at least, and the store's server
        # measured where there is one
        assert s["later_cores_busy"]["engine"] > 0, (name, s["later_cores_busy"])
        assert ("store server" in s["later_cores_busy"]) == (name == "shared"), name
        # where the steps computing returning turns went: the forward always, kvhal's hooks
        # only where kvhal runs, and the parts add up to the step
        parts = s["later_first_token_step_parts_ms"]
        assert parts["n"] >= 1 and parts["forward"] > 0, (name, parts)
        assert (parts["kvhal_worker"] > 0) == (name != "floor"), (name, parts)
        assert (parts["kvhal_scheduler"] > 0) == (name != "floor"), (name, parts)
        assert abs(sum(parts[p] for p in STEP_PARTS) - parts["step"]) < 1e-6, (name, parts)
        assert parts["other"] > 0 and 0 < parts["model"] <= parts["forward"], (name, parts)
    runs = {run["config"]: run for run in result["runs"]}
    for run in result["runs"]:
        assert run["load_before"] and run["load_after"]
        if run["config"] == "shared":
            continue  # its requests alternate between two engines (below)
        for rnd in run["rounds"]:
            assert [q["user"] for q in rnd["requests"]] == [0, 1, 2, 3]
            assert all(len(q["tokens"]) == 8 and q["ttft_s"] > 0 for q in rnd["requests"])

    outputs = result["outputs"]
    assert outputs["reference"]["config"] == "floor" and outputs["passed"]
    compared = {c["config"]: c for c in outputs["comparisons"]}
    assert set(compared) == {"host", "disk", "shared"}
    for name, c in compared.items():
        assert c["compared"] >= 4 and c["unexplained"] == 0, (name, c)

    host = summary["host"]["rounds"][1]["tiers"]
    assert host["host"] > 0 and host["kvhal"] > 0, f"kvhal served nothing in round 2: {host}"
    assert summary["host"]["rounds"][0]["tiers"]["kvhal"] == 0, "round 1 is every user's first sight"
    disk, shared = summary["disk"]["rounds"][1]["tiers"], summary["shared"]["rounds"][1]["tiers"]
    assert disk["disk"] > 0, f"the disk tier served nothing in round 2: {disk}"
    assert shared["remote"] > 0, f"the other engine's turns were not served from the store: {shared}"
    engines = {q["engine"] for rnd in runs["shared"]["rounds"] for q in rnd["requests"]}
    assert engines == {"A", "B"}
    by_user = {q["user"]: q["engine"] for q in runs["shared"]["rounds"][0]["requests"]}
    again = {q["user"]: q["engine"] for q in runs["shared"]["rounds"][1]["requests"]}
    assert all(by_user[u] != again[u] for u in by_user), "a returning turn stayed on its engine"
    assert {t["target"].split(":")[0] for t in result["targets"]} == {"host", "disk", "shared"}


@pytest.mark.timeout(600)
def test_the_engines_traces_replay_on_the_cpu_plugin(floor_host_disk_shared):
    """Each kvhal engine's worker wrote its trace, which replays clean on the CPU plugin, every
    block checked (the shared configuration's say "not tested": a replay cannot reach their
    store); the host engine's trace holds the blocks the engine counted as loaded, and one
    step with a forward for each step of the chat that computed (the bench's step trace)."""
    _, result, traces = floor_host_disk_shared
    by_tiers: dict[str, list[Path]] = {}
    for path in sorted(traces.glob("*.json.gz")):
        kinds = [t.get("backend") or t["kind"] for t in load(path)["config"]["tiers"]]
        by_tiers.setdefault("+".join(kinds) or "host", []).append(path)
    assert {k: len(v) for k, v in by_tiers.items()} == {"host": 1, "disk": 1, "store": 2}, by_tiers
    for kind in ("host", "disk"):
        replayed = replay(by_tiers[kind][0], "cpu")
        assert replayed.status == "passed", (kind, replayed.failures)
        assert replayed.blocks_loaded > 0 and replayed.blocks_stored > 0 and replayed.blocks_unchecked == 0
    for path in by_tiers["store"]:
        replayed = replay(path, "cpu")
        assert replayed.status == "not tested" and "store" in replayed.reason, replayed.reason

    host = {run["config"]: run for run in result["runs"]}["host"]
    events = load(by_tiers["host"][0])["events"]
    assert replay(by_tiers["host"][0], "cpu").blocks_loaded == host["metrics"]["vllm:kvhal_loaded_blocks"] > 0
    # the chat's steps come after the warm-up's: from the first step naming a request of the chat
    begins = [e[1] for e in events if e[0] == "begin"]
    first = next(i for i, m in enumerate(begins) if any(j["req_id"].startswith("host-") for j in m["stores"]))
    computed = sum(1 for r in host["rounds"] for step in r["steps"] if step["scheduled_tokens"])
    assert sum(not m["no_forward"] for m in begins[first:]) == computed > 0


@pytest.mark.timeout(600)
def test_chat_bench_slow_tier_and_cold_workload(tmp_path, vllm_installed):
    """The slow configuration's engine finds the bench's tier through its entry point and,
    once it has measured it slower than recomputing, recomputes instead of reading; the cold
    workload's runs are checked against their own reference, and kvhal stored but served
    nothing there (no prompt returns)."""
    result = tiny_bench(
        tmp_path / "out", 3, "--configs", "vllm", "slow", "cold-vllm", "cold-host", "--slow-tier-mb-s", "2"
    )
    runs = {run["config"]: run for run in result["runs"]}

    slow = runs["slow"]["metrics"]
    assert slow[f"vllm:kvhal_tier_written_blocks{{tier={SLOW_TIER}}}"] > 0, "nothing reached the slow tier"
    assert slow[f"vllm:kvhal_tier_slow_blocks{{tier={SLOW_TIER}}}"] > 0, "the slow tier was read every time"

    cold = result["outputs_cold"]
    assert cold["reference"]["config"] == "cold-vllm" and cold["passed"]
    [compared] = cold["comparisons"]
    assert compared["config"] == "cold-host" and compared["compared"] == 12 == compared["equal"]
    assert [c["config"] for c in result["outputs"]["comparisons"]] == ["slow"]
    [round1] = result["summary"]["cold-host"]["rounds"]
    assert round1["ttft"]["n"] == 12 and round1["tiers"]["kvhal"] == 0
    assert runs["cold-host"]["metrics"]["vllm:kvhal_stored_blocks"] > 0
    targets = {t["target"].split(":")[0] for t in result["targets"]}
    assert targets == {"slow", "cold"}
