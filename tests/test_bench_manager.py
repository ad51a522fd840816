"""``kvhal bench manager``: the trace, the report, and LRU equivalence with vLLM's manager."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from kvhal.bench.drivers import KvhalDriver
from kvhal.bench.manager import TraceSpec, make_trace, replay
from kvhal.cli import main


def test_trace_shares_prefixes_and_keeps_tails_unique():
    spec = TraceSpec(documents=3, prefix_blocks=4, tail_blocks=2, requests=50, groups=2)
    trace = make_trace(spec)
    assert len(trace) == 50 and all(len(request) == 2 for request in trace)
    keys = [k for request in trace for group in request for k in group]
    assert all(isinstance(k, bytes) and len(k) == 36 for k in keys)
    assert {k[-4:] for k in keys} == {b"\0\0\0\0", b"\0\0\0\1"}  # vLLM OffloadKey group suffix
    prefixes = {tuple(request[0][:4]) for request in trace}
    assert len(prefixes) <= 3  # documents are shared
    tails = [k for request in trace for k in request[0][4:]]
    assert len(set(tails)) == len(tails) == 100
    first = trace[0][0][0]
    assert any(r[0][0] == first and r[0][0] is not first for r in trace[1:])  # equal, fresh objects


def test_replay_counts_hits_and_caps_tracking(registry):
    trace = make_trace(TraceSpec(documents=5, prefix_blocks=4, tail_blocks=1, requests=200))
    driver = KvhalDriver(16, "lru", registry)
    result = replay(driver, trace, inflight=2, tick=lambda: None)
    assert result.blocks == 200 * 5
    assert 0 < result.hits < result.blocks
    assert driver.tracked() == 16


def test_cli_writes_a_report_without_vllm(tmp_path, capsys):
    argv = ["bench", "manager", "--requests", "300", "--slots", "64", "--repeats", "1", "--no-vllm"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "manager.json").read_text())
    assert [r["manager"] for r in report["rows"]] == ["kvhal lru", "kvhal s3fifo"]
    assert all(r["tracked_blocks"] == 64 and r["bytes_per_block"] > 0 for r in report["rows"])
    assert (tmp_path / "manager.png").stat().st_size > 0
    assert "no vLLM baseline" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_same_hits_as_vllms_lru(tmp_path):
    """Two LRU managers fed the same calls keep the same blocks: kvhal's order is vLLM 0.32's.

    Requests one after another: with transfers in flight vLLM's request end
    skips blocks another request is still storing (BENCHMARKS.md). In a
    subprocess: importing vLLM changes process-wide settings.
    """
    out = tmp_path / "report"
    command = [sys.executable, "-m", "kvhal.cli", "bench", "manager", "--requests", "400", "--slots", "256"]
    command += ["--policies", "lru", "--repeats", "1", "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    report = json.loads((out / "manager.json").read_text())
    ours, theirs = report["rows"]
    assert theirs["manager"].startswith("vLLM")
    assert report["targets"]["hit_rates_equal"]
    assert (ours["hits"], ours["stored"]) == (theirs["hits"], theirs["stored"])
    assert 0 < ours["hits"] < ours["blocks"]  # the cache really is smaller than the working set
