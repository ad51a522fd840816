"""The three device plugin distributions as installed here: found, loaded, declining with reasons."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch

from kvhal.cli import main as kvhal_main

PLUGINS = {"cuda": "kvhal-cuda", "rocm": "kvhal-rocm", "npu": "kvhal-npu"}
REASONS = {"cuda": "built without CUDA", "rocm": "built without HIP", "npu": "torch_npu is not installed"}


def installed() -> set[str]:
    return {ep.name for ep in importlib.metadata.entry_points(group="kvhal.plugins")}


@pytest.fixture(autouse=True)
def _needs_plugins():
    if not set(PLUGINS) <= installed():
        pytest.skip("the plugin distributions are not installed (scripts/setup.sh installs them)")


@pytest.mark.skipif(
    bool(torch.version.cuda or getattr(torch.version, "hip", None)), reason="checks the CPU-only set-up"
)
def test_kvhal_devices_lists_all_four_with_cpu_selected(capsys):
    assert kvhal_main(["devices", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["plugin"]: row for row in report["plugins"]}
    assert report["selected"] == "cpu" and set(rows) == {"cpu", *PLUGINS}
    for name, dist in PLUGINS.items():
        assert rows[name]["status"] == "declined"
        assert rows[name]["distribution"].startswith(dist)
        assert REASONS[name] in rows[name]["reason"]


def test_importing_the_plugins_pulls_in_no_vendor_stack():
    code = (
        "import sys, kvhal_cuda, kvhal_rocm, kvhal_npu;"
        "print(sorted(m for m in ('torch_npu', 'vllm', 'vllm_ascend', 'cuda', 'pynvml') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
