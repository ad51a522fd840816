"""An install says what it is: the C extensions built or missing (a missing one is a warning
with its cost and the fix, never silence), and the versions of kvhal and its plugins.

A missing extension is made real in a child process: a meta-path finder refuses that one
module, as a Python without the built ``.so`` would, and the module that uses it falls back.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

import kvhal
from kvhal import build_info

#: Run in a child: refuse one extension's import, then print what build_info and the fallback say.
REFUSED = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Refuse())
{code}
"""


def run_refusing(module: str, code: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", REFUSED.format(module=module, code=code)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_every_extension_setup_py_builds_is_reported() -> None:
    from pathlib import Path

    setup_py = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    built = {line.split('"')[1] for line in setup_py.splitlines() if line.strip().startswith('"kvhal.')}
    assert built == {ext.module for ext in build_info.EXTENSIONS}


def test_here_every_extension_is_built() -> None:
    # scripts/setup.sh builds them (this machine has a compiler): none may be missing here
    assert build_info.extension_status() == dict.fromkeys(e.module for e in build_info.EXTENSIONS)


@pytest.mark.parametrize(
    ("module", "fallback"),
    [
        ("kvhal._copyplan", "import kvhal.copyplan as m; print('fallback', m.native is None)"),
        ("kvhal.cpu._memcpy", "import kvhal.cpu.copy_engine as m; print('fallback', m.native is None)"),
        ("kvhal.offload._keyindex", "import kvhal.offload.keyindex as m; print('fallback', not m.NATIVE)"),
        (
            "kvhal.tiers.stores._resp",
            "import kvhal.tiers.stores.redis_direct as m; print('fallback', m._resp is None)",
        ),
    ],
)
def test_a_missing_extension_is_reported_with_its_cost_and_the_fix(module: str, fallback: str) -> None:
    code = (
        "from kvhal import build_info\n"
        "status = build_info.extension_status()\n"
        "print(sorted(m for m, why in status.items() if why))\n"
        "ext = next(e for e in build_info.EXTENSIONS if e.module == "
        f"{module!r})\n"
        f"print(build_info.missing_extension_warning(ext, status[{module!r}]))\n"
        f"{fallback}\n"
    )
    out = run_refusing(module, code).stdout.splitlines()
    assert out[0] == str([module])  # that one only
    warning = out[1]
    assert f"the C extension {module}" in warning and "No module named" in warning
    ext = next(e for e in build_info.EXTENSIONS if e.module == module)
    assert ext.cost in warning and build_info.FIX in warning
    assert out[2] == "fallback True"  # the control: the module using it really runs its fallback


def test_version_says_which_extension_is_missing() -> None:
    code = "import sys\nfrom kvhal.cli import main\nsys.exit(main(['--version']))"
    out = run_refusing("kvhal.tiers.stores._resp", code).stdout
    assert "C extensions: 3 of 4 built" in out
    assert "kvhal.tiers.stores._resp" in out and "valkey-glide" in out and "Fix: install a C compiler" in out


def test_versions_are_the_installed_distributions() -> None:
    versions = build_info.distribution_versions()
    assert next(iter(versions)) == "kvhal"
    assert versions["kvhal"] == importlib.metadata.version("kvhal") == kvhal.__version__
    for ep in importlib.metadata.entry_points(group=build_info.PLUGIN_GROUP):
        if ep.dist is not None:
            assert versions[ep.dist.name] == ep.dist.version
