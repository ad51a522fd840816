"""kvhal as shipped: its wheels installed (not editable, not the source tree) in a fresh venv
beside vLLM, and an OpenAI server run from that venv serving a kvhal hit after
``POST /reset_prefix_cache``. scripts/check-wheels.sh builds the wheels and the venv and runs
this file with KVHAL_WHEEL_VENV set (scripts/test.sh runs it after the other tests)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvhal.vllm.testing.runner import api_server_command
from tests.e2e.common import prompts
from tests.e2e.openai_server import OpenAIServer

VENV = os.environ.get("KVHAL_WHEEL_VENV")
#: resolved now: a test that changes the working directory must still find it
VENV_DIR = Path(VENV).absolute() if VENV else None
pytestmark = pytest.mark.skipif(
    not VENV, reason="needs the venv of scripts/check-wheels.sh (KVHAL_WHEEL_VENV)"
)

#: 200-token prompts of TEST_MODEL (32-token blocks): kvhal serves 6 full blocks of each
LENGTH, SERVED = 200, 192
KVHAL = {"cpu_bytes_to_use": "64MiB"}
ENGINE = {"enable_prompt_tokens_details": True}

WHAT_RUNS = """
import json, sysconfig, kvhal, kvhal.vllm.connector
from kvhal import build_info
print(json.dumps({
    "kvhal": kvhal.__file__,
    "connector": kvhal.vllm.connector.__file__,
    "site": sysconfig.get_paths()["platlib"],
    "extensions": build_info.extension_status(),
    "versions": build_info.distribution_versions(),
}))
"""


def python() -> Path:
    assert VENV_DIR is not None
    return VENV_DIR / "bin" / "python"


def test_the_venv_runs_kvhal_from_its_wheel_with_every_c_extension(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(python()), "-c", WHAT_RUNS], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    site = Path(found["site"])
    assert VENV_DIR is not None and site.is_relative_to(VENV_DIR), found
    for module in ("kvhal", "connector"):
        assert Path(found[module]).is_relative_to(site), found  # not src/, not an editable finder
    assert not list(site.glob("__editable__*kvhal*")), "an editable install of kvhal is in the venv"
    assert found["extensions"] and all(reason is None for reason in found["extensions"].values()), found
    assert {"kvhal", "kvhal-cuda", "kvhal-rocm", "kvhal-npu", "kvhal-conformance"} <= set(
        found["versions"]
    ), found


def test_an_openai_server_from_the_wheels_serves_a_hit_after_reset_prefix_cache(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # `python -m` puts the working directory first on sys.path
    batch = prompts(1, LENGTH, seed=36)
    server = OpenAIServer(model, kvhal=KVHAL, engine=ENGINE)
    server.command = api_server_command(
        model, port=server.port, kvhal=KVHAL, engine=ENGINE, python=str(python())
    )
    with server:
        first = server.complete(batch[0])
        assert server.reset_prefix_cache(), f"POST /reset_prefix_cache kept failing:\n{server.log_tail()}"
        second = server.complete(batch[0])
        metrics = server.metrics()
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert (second.get("kv_transfer_params") or {}).get("kvhal_loaded_tokens") == SERVED, second
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == SERVED, second["usage"]
    assert metrics["vllm:kvhal_hit_tokens_total"] == SERVED
