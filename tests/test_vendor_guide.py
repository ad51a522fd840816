"""docs/vendor-guide.md stays true: ``kvhal new-plugin`` writes a package that loads, whose stubs
fail the conformance suite naming the guide's sections; the guide's example code, put into that
package and installed into a fresh virtual environment, passes ``kvhal conformance --quick``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest

from kvhal import hookspecs
from kvhal.cli import main
from kvhal.descriptor import Refusal
from kvhal.registry import PluginRegistry
from kvhal.scaffold import FILES

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "vendor-guide.md"
NAME = "acme"

#: A fenced block: its language, the rest of its info string (``file=PATH``), its text.
_BLOCK = re.compile(r"^```(?P<lang>\w+)(?P<info>[^\n]*)\n(?P<body>.*?)^```$", re.M | re.S)
_HEADING = re.compile(r"^#{1,6} (?P<title>.+)$", re.M)
_ANCHOR = re.compile(r"vendor-guide\.md#(?P<anchor>[a-z0-9-]+)")


def guide_text() -> str:
    return GUIDE.read_text()


def blocks(key: str) -> list[tuple[str, str]]:
    """``(value, text)`` of every block whose info string has ``key=value``, in guide order."""
    found = []
    for match in _BLOCK.finditer(guide_text()):
        info = dict(part.split("=", 1) for part in match["info"].split() if "=" in part)
        if key in info:
            found.append((info[key], match["body"]))
    return found


def guide_files() -> dict[str, str]:
    """The example plugin's files: the guide's ``file=PATH`` blocks, joined in guide order."""
    files: dict[str, list[str]] = {}
    for path, text in blocks("file"):
        files.setdefault(path, []).append(text)
    return {path: "\n".join(parts) for path, parts in files.items()}


def guide_anchors() -> set[str]:
    """GitHub's anchors of the guide's headings."""
    return {
        re.sub(r"[^a-z0-9 _-]", "", m["title"].strip().lower()).replace(" ", "-")
        for m in _HEADING.finditer(guide_text())
    }


def scaffold(tmp_path: Path) -> Path:
    assert main(["new-plugin", NAME, "--dir", str(tmp_path)]) == 0
    return tmp_path / f"kvhal-{NAME}"


def fill_in(package: Path) -> None:
    for path, text in guide_files().items():
        (package / path).write_text(text)


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clean_env() -> dict[str, str]:
    """The environment without anything that chooses plugins or adds import paths."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVHAL_", "PYTEST_"))}
    env.pop("PYTHONPATH", None)
    env["PYTHONNOUSERSITE"] = "1"
    return env


# -- the scaffold --------------------------------------------------------------------------


def test_new_plugin_writes_the_package_the_guide_describes(tmp_path: Path) -> None:
    package = scaffold(tmp_path)
    written = {str(p.relative_to(package)) for p in package.rglob("*") if p.is_file()}
    assert written == {target.format(module=f"kvhal_{NAME}") for target in FILES.values()}

    pyproject = (package / "pyproject.toml").read_text()
    [(_, excerpt)] = blocks("excerpt")
    assert excerpt.strip() in pyproject, "the guide's entry point is not the one the scaffold writes"
    assert 'name = "kvhal-acme"' in pyproject
    assert "Verified on:" in (package / "README.md").read_text()

    # The guide's package tree lists the files of the package once the example is filled in.
    fill_in(package)
    [(_, tree)] = blocks("layout")
    listed = set(re.findall(r"[\w/]+\.(?:py|toml|md)", tree))
    assert listed == {str(p.relative_to(package)) for p in package.rglob("*") if p.is_file()}


@pytest.mark.parametrize("name", ["cpu", "cuda", "Acme", "1acme", "ac-me", "", "a" * 41])
def test_new_plugin_refuses_unusable_names(tmp_path: Path, capsys: pytest.CaptureFixture, name: str) -> None:
    assert main(["new-plugin", name, "--dir", str(tmp_path)]) == 2
    assert "kvhal new-plugin: name:" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_new_plugin_overwrites_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    package = scaffold(tmp_path)
    plugin = package / "src" / "kvhal_acme" / "plugin.py"
    plugin.write_text("# the vendor's work\n")
    assert main(["new-plugin", NAME, "--dir", str(tmp_path)]) == 2
    assert "exists already" in capsys.readouterr().err
    assert plugin.read_text() == "# the vendor's work\n"


def test_every_stub_names_a_section_of_the_guide(tmp_path: Path) -> None:
    """The stub plugin loads with every device hook; its probe declines and every other hook
    raises, each naming a section the guide has."""
    package = scaffold(tmp_path)
    module = load_module(package / "src" / "kvhal_acme" / "plugin.py", "kvhal_acme_stub_plugin")
    registry = PluginRegistry(autoload=False, allow={"cpu", NAME}, block=())
    info = registry.register(module.AcmePlugin(), NAME)
    assert info.error is None
    assert registry.implemented_hooks(info) == set(hookspecs.DEVICE_HOOKS)

    anchors = guide_anchors()
    plugin = module.AcmePlugin()
    refusal = plugin.kvhal_probe()
    assert isinstance(refusal, Refusal)
    assert _ANCHOR.search(refusal.reason)["anchor"] == "the-probe"
    sections = {}
    for hook in hookspecs.DEVICE_HOOKS[1:]:
        arguments = getattr(hookspecs, hook).__code__.co_varnames
        arguments = arguments[: getattr(hookspecs, hook).__code__.co_argcount]
        with pytest.raises(NotImplementedError, match=hook) as raised:
            getattr(plugin, hook)(**dict.fromkeys(arguments))
        sections[hook] = _ANCHOR.search(str(raised.value))["anchor"]
    assert set(sections.values()) <= anchors, set(sections.values()) - anchors
    assert {"the-probe", "kv-layouts", "allocation", "host-memory", "streams-and-events", "copies"} <= anchors


def test_stubs_fail_conformance_naming_their_sections(tmp_path: Path) -> None:
    """With only the probe written, ``kvhal conformance`` fails, and its report names the guide's
    sections of the stubs it reached."""
    package = scaffold(tmp_path)
    (package / "src" / "probe_only.py").write_text(
        "import kvhal\n"
        "from kvhal_acme.plugin import AcmePlugin\n\n\n"
        "class ProbeOnly(AcmePlugin):\n"
        "    @kvhal.hookimpl\n"
        "    def kvhal_probe(self):\n"
        "        return kvhal.DeviceDescriptor(\n"
        "            name='acme', torch_device_type='cpu', vendor='Acme', priority=-10\n"
        "        )\n"
    )
    run = subprocess.run(
        [
            *(sys.executable, "-m", "kvhal.cli", "conformance", "--device", NAME, "--quick"),
            *("--plugin", "probe_only:ProbeOnly", "--throughput-floor", "0", "-p", "no:cacheprovider"),
        ],
        cwd=package / "src",
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    summary = run.stdout.split("kvhal conformance: plugin 'acme'")[-1]
    named = {m["anchor"] for m in _ANCHOR.finditer(summary)}
    # The checks reach layouts, host memory and streams first; allocation and copies need layouts
    # (and host memory), so their stubs are named once the hooks before them are written.
    stubs = {"kv-layouts", "allocation", "host-memory", "streams-and-events", "copies"}
    assert {"kv-layouts", "host-memory", "streams-and-events"} <= named <= stubs, summary[-3000:]


# -- the guide's example, installed --------------------------------------------------------


@pytest.mark.slow  # a fresh virtual environment, pip install and the whole suite
def test_guide_example_passes_conformance_when_installed(tmp_path: Path) -> None:
    """The scaffold filled in with the guide's code blocks, installed with pip into a fresh
    virtual environment (kvhal and the suite come from this one), is found through its entry
    point, leaves automatic selection to the CPU plugin, and passes the suite."""
    package = scaffold(tmp_path)
    fill_in(package)
    ruff = Path(sys.executable).with_name("ruff")
    if ruff.exists():  # the guide's code is lint-clean
        lint = subprocess.run(
            [str(ruff), "check", "--isolated", "--line-length", "110", "--select", "E,F,W,B,UP", "src"],
            cwd=package,
            capture_output=True,
            text=True,
        )
        assert lint.returncode == 0, lint.stdout

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_packages = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    ours = sysconfig.get_paths()["purelib"]  # kvhal, the suite, torch, pip, setuptools
    (site_packages / "kvhal-test-base.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    env = clean_env()

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(python), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
        )

    install = run(
        "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-e", f"{package}"
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    assert not (Path(ours) / "kvhal_acme").exists() and not list(Path(ours).glob("kvhal_acme*"))

    devices = run("-m", "kvhal.cli", "devices", "--json")
    assert devices.returncode == 0, devices.stderr
    report = json.loads(devices.stdout)
    [acme] = [row for row in report["plugins"] if row["plugin"] == NAME]
    assert acme["distribution"] == "kvhal-acme 0.1.0"
    assert (acme["status"], acme["device"], acme["priority"]) == ("present", NAME, -10)
    assert report["selected"] == "cpu", "the example must not take automatic selection from the CPU plugin"

    suite = run("-m", "kvhal.cli", "conformance", "--device", NAME, "--quick", "--throughput-floor", "0")
    assert suite.returncode == 0, suite.stdout[-6000:] + suite.stderr[-2000:]
    summary = suite.stdout.split("kvhal conformance: plugin 'acme'")[-1]
    for contract in ("Probe", "Layouts", "Allocation", "Host memory", "Streams and events", "Copies"):
        assert re.search(rf"^{contract} +pass", summary, re.M), summary
    # acme has no fault hook: said so, never a silent pass
    assert re.search(r"^Device faults +skip", summary, re.M), summary
    assert "device faults: not tested (no fault hook: plugin 'acme' does not declare test.faults)" in summary

    # The package's own tests collect every contract class; the probe's run through the entry point.
    own = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", "-k", "TestProbe"],
        cwd=package,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert own.returncode == 0 and " passed" in own.stdout, own.stdout[-3000:]
    shutil.rmtree(venv)
