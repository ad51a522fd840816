"""Run a vLLM scenario in a fresh subprocess and get its JSON result (no vLLM import here).

A scenario is a dict: ``model`` (a folder), ``steps`` (see
:mod:`kvhal.vllm.testing.runner`), ``kvhal`` (``kv_connector_extra_config``, or
``None`` to run without kvhal), ``engine`` (``vllm.LLM`` argument overrides),
``multiprocessing`` (``VLLM_ENABLE_V1_MULTIPROCESSING``) and ``env``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Environment every engine runs with on these machines (../shared/docs/vllm-cpu.md).
BASE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class ScenarioError(RuntimeError):
    """The engine process failed; the message ends with its stderr."""


def run_scenario(
    scenario: dict[str, Any], *, timeout: float = 900, python: str | None = None
) -> dict[str, Any]:
    """Run ``scenario`` with ``python -m kvhal.vllm.testing.runner`` and return its result."""
    env = {**os.environ, **BASE_ENV, **{k: str(v) for k, v in scenario.get("env", {}).items()}}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if scenario.get("multiprocessing") else "0"
    with tempfile.TemporaryDirectory(prefix="kvhal-scenario-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(
            json.dumps({k: v for k, v in scenario.items() if k not in ("env", "multiprocessing")})
        )
        log = Path(tmp) / "engine.log"
        faults_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        with log.open("w") as sink:  # a file, not a pipe: the engine never waits on its reader
            proc = subprocess.run(
                [python or sys.executable, "-m", "kvhal.vllm.testing.runner", str(spec), str(out)],
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        # Children's counts only grow, and scenarios run one at a time: the difference is this one's.
        minor_faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - faults_before
        output = log.read_text(errors="replace")
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(output.splitlines()[-40:])
            raise ScenarioError(f"engine process exited with {proc.returncode}:\n{tail}")
        result = json.loads(out.read_text())
    result["stderr"] = output
    result["minor_faults"] = minor_faults
    return result
