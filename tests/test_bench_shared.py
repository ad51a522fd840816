"""``kvhal bench shared`` at a tiny size: real stores started by the bench, no engines (no speed targets)."""

from __future__ import annotations

import json

import pytest

from kvhal.cli import main
from kvhal.testing.mooncake_servers import MooncakeCluster
from kvhal.testing.redis_servers import redis_server_binary
from kvhal.testing.seaweedfs_servers import SeaweedS3


def test_throughput_beside_each_stores_own_client_at_a_tiny_size(tmp_path):
    if not MooncakeCluster.available():
        pytest.skip(MooncakeCluster.missing())
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    if SeaweedS3.missing():
        pytest.skip(SeaweedS3.missing())
    out = tmp_path / "out"
    argv = ["bench", "shared", "--gib", "0.004", "--blocks", "256K", "--batches", "4", "--rounds", "2"]
    assert main([*argv, "--no-e2e", "--out", str(out)]) == 0, "a block failed to put or get back verified"
    result = json.loads((out / "shared.json").read_text())
    assert (out / "shared.png").stat().st_size > 0
    rows = result["throughput"]
    assert [(r["store"], r["block_bytes"], r["batch"]) for r in rows] == [
        ("mooncake", 256 << 10, 4),
        ("redis", 256 << 10, 4),
        ("s3", 256 << 10, 4),
    ]
    for r in rows:
        for field in ("put_gbps", "get_gbps", "limit_put_gbps", "limit_get_gbps"):
            assert r[field] > 0, (field, r)
        for field in ("put_share", "get_share", "framed_put_share", "framed_get_share"):
            assert r[field] > 0, (field, r)
        assert r["bytes"] == r["blocks"] * r["block_bytes"] == 16 * (256 << 10)
        assert r["failed_puts"] == r["failed_gets"] == 0, "every block put is got back verified"
        assert r["limit_failed_puts"] == r["limit_failed_gets"] == 0
        assert r["bytes_equal"] and r["limit_bytes_equal"]
        assert r["rounds"] == len(r["gbps_per_round"]) == 2
        assert r["target_met"] in (True, False)
    assert set(result["stores"]) == {"mooncake", "redis", "s3"}
    assert result["header_bytes"] == 96
    assert result["e2e"] is None
    assert [t["target"].split(":")[0] for t in result["targets"]] == ["mooncake", "redis", "s3"]
