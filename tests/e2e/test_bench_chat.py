"""``kvhal bench chat`` at a tiny size on real vLLM engines: it runs, writes its JSON and plot,
checks the outputs, and kvhal serves the returning turns (no speed targets here).

One run covers every kvhal configuration (host; disk below a small host tier; two engines
sharing a Redis server) against one floor: each configuration's engines start once."""

from __future__ import annotations

import json

import pytest

from kvhal.bench.chat.checks import STEP_PARTS
from kvhal.bench.chat.slow_tier import SLOW_TIER
from kvhal.cli import main
from tests.e2e.common import MODEL_CACHE


def tiny_bench(out, rounds: int, *more: str) -> dict:
    """``kvhal bench chat`` at a tiny size (4 users, one repeat) with ``more`` arguments: its JSON,
    once the run passed its outputs checks."""
    argv = ["bench", "chat", "--users", "4", "--rounds", str(rounds), "--context", "96", "160"]
    argv += ["--turn", "32", "--max-tokens", "8", "--inflight", "1", "--repeats", "1", *more]
    argv += ["--models", str(MODEL_CACHE), "--out", str(out)]
    assert main(argv) == 0, "an outputs check failed"
    return json.loads((out / "chat.json").read_text())


@pytest.mark.timeout(600)  # six engines in a row, each started from a fresh interpreter
def test_chat_bench_floor_host_disk_and_shared(tmp_path, vllm_installed):
    """Round 2 of the host configuration comes from the host tier, of the disk configuration
    from the disk tier (its host tier is too small), and of the shared configuration from the
    other engine, through a Redis server."""
    pytest.importorskip("redis")
    out = tmp_path / "out"
    result = tiny_bench(out, 2, "--configs", "floor", "host", "disk", "shared", "--store", "redis")
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
