"""``kvhal demo``, the main job (scripts/demo.sh), at a small size: vLLM with kvhal on the
auto-selected device serves a kvhal hit, and the table's rows are what they say."""

from __future__ import annotations

import json

from kvhal.cli import main


def test_the_demo_serves_a_kvhal_hit(tmp_path, vllm_installed):
    out = tmp_path / "out"
    argv = ["demo", "--prompt-len", "256", "--repeats", "1", "--models", str(tmp_path / "models")]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads((out / "demo.json").read_text())
    assert (out / "demo.png").stat().st_size > 0
    assert result["kvhal_device"]["plugin"] == "cpu", "the CPU plugin is the one present here"
    rows = {r["category"]: r for r in result["ttft"]}
    assert list(rows) == ["cold", "vllm prefix hit", "kvhal hit", "recompute"]
    assert rows["kvhal hit"]["kvhal_loaded_tokens"] == 224, "kvhal served all but the last block"
    assert (
        rows["vllm prefix hit"]["kvhal_loaded_tokens"] == 0
        and rows["vllm prefix hit"]["cached_tokens"] == 224
    )
    assert rows["cold"]["cached_tokens"] == 0 and rows["recompute"]["cached_tokens"] == 0
    assert result["throughput"] is None and result["malloc_env"], (
        "the demo runs with MALLOC_ENV, no throughput"
    )
