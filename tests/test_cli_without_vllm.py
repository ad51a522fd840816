"""A device vendor's machine has kvhal, its plugin and the conformance suite, and no vLLM:
`kvhal devices` and `kvhal bench copy` must run there (on a GPU machine they once failed at
parser build, importing the chat benchmark's vLLM config)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# vLLM made unimportable in the child: `import vllm` raises ImportError, as where it is absent.
WITHOUT_VLLM = "import sys; sys.modules['vllm'] = None; from kvhal.cli import main; sys.exit(main({argv!r}))"


def run_without_vllm(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_VLLM.format(argv=list(argv))],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_devices_runs_without_vllm() -> None:
    done = run_without_vllm("devices", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["selected"] == "cpu"


@pytest.mark.parametrize("bench", ["copy", "chat"])
def test_bench_help_builds_without_vllm(bench: str) -> None:
    done = run_without_vllm("bench", bench, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: kvhal bench" in done.stdout


def test_the_connector_itself_still_needs_vllm() -> None:
    """The control: the child really has no vLLM (the connector's import fails), so the tests
    above prove the CLI does not import it."""
    code = "import sys; sys.modules['vllm'] = None; from kvhal.vllm import KVHALConnector"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "vllm" in done.stderr
