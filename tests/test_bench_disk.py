"""``kvhal bench disk`` at tiny sizes: it runs and writes its JSON and plot (no speed targets here)."""

from __future__ import annotations

import json

from kvhal.bench.common import parse_size
from kvhal.cli import main


def test_parse_size():
    assert [parse_size(s) for s in ("64K", "4M", "1G", "256KiB", "4096")] == [
        64 << 10,
        4 << 20,
        1 << 30,
        256 << 10,
        4096,
    ]


def test_throughput_index_and_restart_at_tiny_sizes(tmp_path):
    out = tmp_path / "out"
    argv = ["bench", "disk", "--path", str(tmp_path), "--gib", "0.01", "--blocks", "64K", "256K"]
    argv += ["--batches", "1", "4", "--no-e2e", "--index-slots", "5000", "--recover-blocks", "5000"]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads((out / "disk.json").read_text())
    assert (out / "disk.png").stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "the bench left files behind"
    rows = result["throughput"]
    assert [(r["block_bytes"], r["batch"]) for r in rows] == [
        (64 << 10, 1),
        (64 << 10, 4),
        (256 << 10, 1),
        (256 << 10, 4),
    ]
    for r in rows:
        for field in ("write_gbps", "read_gbps", "limit_write_gbps", "limit_read_gbps"):
            assert r[field] > 0, (field, r)
        assert r["write_share"] > 0 and r["read_share"] > 0
        assert r["bytes"] == r["blocks"] * r["block_bytes"] > 0
        assert r["failed_writes"] == r["failed_reads"] == 0, "every block written is read back verified"
    assert rows[0]["target_met"] is None, "no target below 256 KiB blocks"
    assert rows[-1]["target_met"] in (True, False)
    assert result["index"]["bytes_per_block"] > 0 and result["index"]["tracked_blocks"] == 5000
    assert result["recover"]["blocks_per_s"] > 0
    assert result["warm_restart"]["blocks"] == 5000 and result["warm_restart"]["blocks_per_s"] > 0
    assert result["e2e"] is None
    assert {"index <= 32 bytes per disk block"} <= {t["target"] for t in result["targets"]}
