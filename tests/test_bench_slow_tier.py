"""The benchmark's slow tier: the disk tier with reads held to a bandwidth, offered through a
real entry point (the chat bench's ``slow`` configuration)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvhal.bench.chat.slow_tier import SLOW_TIER, SlowTier, install
from kvhal.tiers.backend import OK, TierSpec
from kvhal.tiers.disk import DiskTier

SLOT = 64 << 10


def opened(tmp_path, rate: float) -> SlowTier:
    """The ``io`` role (a worker's), after the ``index`` role made the medium."""
    options = {"path": str(tmp_path / "d"), "bytes_to_use": 16 * SLOT}
    index = DiskTier(TierSpec(options, SLOT, {"model": "m"}, "index"))
    index.recover()
    index.close()
    return SlowTier(DiskTier(TierSpec(options, SLOT, {"model": "m"}, "io")), rate)


def test_reads_end_no_sooner_than_the_bandwidth_allows_and_return_the_bytes(tmp_path):
    tier = opened(tmp_path, rate=4 * SLOT / 0.2)  # four slots take 0.2 s
    data = [memoryview(bytearray(bytes([i]) * SLOT)) for i in range(4)]
    keys = [bytes([i]) * 16 for i in range(4)]
    assert tier.write(range(4), keys, data).result(timeout=30) == [True] * 4
    out = [memoryview(bytearray(SLOT)) for _ in range(4)]
    start = time.monotonic()
    first = tier.read([0, 1], keys[:2], out[:2])
    second = tier.read([2, 3], keys[2:], out[2:])  # queued behind the first
    assert first.result(timeout=30) == [OK, OK]
    assert second.result(timeout=30) == [OK, OK]
    assert time.monotonic() - start >= 0.2
    assert [bytes(o) for o in out] == [bytes(d) for d in data]
    tier.close()


def test_a_failed_read_stays_failed(tmp_path):
    tier = opened(tmp_path, rate=1e9)
    out = [memoryview(bytearray(SLOT))]
    assert tier.read([5], [b"k" * 16], out).result(timeout=30) != [OK]  # nothing written there
    tier.close()


@pytest.mark.parametrize("installed", [True, False])
def test_the_engine_finds_the_tier_through_the_entry_point(tmp_path, installed):
    code = "from kvhal.registry import PluginRegistry; from kvhal.tiers.media import available_tiers; "
    code += f"print({SLOW_TIER!r} in available_tiers(PluginRegistry()))"
    env = dict(os.environ)
    if installed:  # the negative control: without the metadata, no plugin offers it
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(install(tmp_path)), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(installed), out.stderr
