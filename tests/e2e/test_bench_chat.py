"""``kvhal bench chat`` at a tiny size on real vLLM engines: it runs, writes its JSON and plot,
checks the outputs, and kvhal serves the returning turns (no speed targets here)."""

from __future__ import annotations

import json

import pytest

from kvhal.cli import main


def test_chat_bench_floor_and_host(tmp_path, vllm_installed):
    out = tmp_path / "out"
    argv = ["bench", "chat", "--users", "3", "--rounds", "2", "--context", "96", "160"]
    argv += ["--turn", "32", "--max-tokens", "8", "--inflight", "1", "--repeats", "1"]
    argv += ["--configs", "floor", "host"]
    argv += ["--models", str(tmp_path / "models"), "--out", str(out)]
    assert main(argv) == 0, "the outputs check failed"
    result = json.loads((out / "chat.json").read_text())
    assert (out / "chat.png").stat().st_size > 0
    assert [p.name for p in out.iterdir() if p.is_dir()] == [], "the bench left its scratch folder behind"

    summary = result["summary"]
    assert list(summary) == ["floor", "host"]
    for name, s in summary.items():
        assert [row["round"] for row in s["rounds"]] == [1, 2], name
        for row in s["rounds"]:
            assert row["ttft"]["n"] == 3 and 0 < row["ttft"]["p50"] <= row["ttft"]["p90"], (name, row)
            assert row["ttft"]["mean"] > 0
        assert s["ttft_later"]["n"] == 3 and s["output_tokens_per_s"] > 0
    for run in result["runs"]:
        assert run["load_before"] and run["load_after"]
        for rnd in run["rounds"]:
            assert [q["user"] for q in rnd["requests"]] == [0, 1, 2]
            assert all(len(q["tokens"]) == 8 and q["ttft_s"] > 0 for q in rnd["requests"])

    outputs = result["outputs"]
    assert outputs["reference"]["config"] == "floor" and outputs["passed"]
    (host,) = outputs["comparisons"]
    assert host["config"] == "host" and host["compared"] >= 3 and host["unexplained"] == 0

    round2 = summary["host"]["rounds"][1]["tiers"]
    assert round2["host"] > 0 and round2["kvhal"] > 0, f"kvhal served nothing in round 2: {round2}"
    assert summary["host"]["rounds"][0]["tiers"]["kvhal"] == 0, "round 1 is every user's first sight"
    assert {t["target"].split(":")[0] for t in result["targets"]} == {"host"}


def test_chat_bench_disk_and_shared(tmp_path, vllm_installed):
    """Round 2 of the disk configuration comes from the disk tier (its host tier is too small),
    and the shared configuration's from the other engine, through a Redis server."""
    pytest.importorskip("redis")
    out = tmp_path / "out"
    argv = ["bench", "chat", "--users", "4", "--rounds", "2", "--context", "96", "160"]
    argv += ["--turn", "32", "--max-tokens", "8", "--inflight", "1", "--repeats", "1"]
    argv += ["--configs", "floor", "disk", "shared", "--store", "redis"]
    argv += ["--models", str(tmp_path / "models"), "--out", str(out)]
    assert main(argv) == 0, "the outputs check failed"
    result = json.loads((out / "chat.json").read_text())
    summary = result["summary"]
    assert list(summary) == ["floor", "disk", "shared"]
    disk, shared = summary["disk"]["rounds"][1]["tiers"], summary["shared"]["rounds"][1]["tiers"]
    assert disk["disk"] > 0, f"the disk tier served nothing in round 2: {disk}"
    assert shared["remote"] > 0, f"the other engine's turns were not served from the store: {shared}"
    engines = {q["engine"] for rnd in result["runs"][2]["rounds"] for q in rnd["requests"]}
    assert engines == {"A", "B"}
    by_user = {q["user"]: q["engine"] for rnd in result["runs"][2]["rounds"][:1] for q in rnd["requests"]}
    again = {q["user"]: q["engine"] for q in result["runs"][2]["rounds"][1]["requests"]}
    assert all(by_user[u] != again[u] for u in by_user), "a returning turn stayed on its engine"
    assert result["outputs"]["passed"]
    assert {t["target"].split(":")[0] for t in result["targets"]} == set(), "no host run, no ratio"
