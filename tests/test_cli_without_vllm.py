"""A device vendor's machine has kvhal, its plugin and the conformance suite, and no vLLM:
`kvhal devices` and `kvhal bench copy` must run there (on a GPU machine they once failed at
parser build, importing the chat benchmark's vLLM config)."""

from __future__ import annotations

import importlib.metadata
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


def test_version_names_kvhal_every_plugin_distribution_and_the_extensions() -> None:
    done = run_without_vllm("--version")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"kvhal {importlib.metadata.version('kvhal')}"
    plugins = {ep.dist.name for ep in importlib.metadata.entry_points(group="kvhal.plugins") if ep.dist}
    if not plugins:
        pytest.skip("no plugin distribution installed (scripts/setup.sh installs three)")
    for dist in plugins:
        assert f"{dist} {importlib.metadata.version(dist)}" in lines, done.stdout
    assert "C extensions: 4 of 4 built" in lines, done.stdout
