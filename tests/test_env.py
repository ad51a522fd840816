"""Every KVHAL_* setting lives in kvhal.env: read there, at use, and documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvhal import env
from kvhal.cpu.copy_engine import CopyEngine
from kvhal.registry import PluginRegistry

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_table_is_the_settings_table():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert env.markdown_table() in doc


def test_no_module_reads_a_kvhal_variable_but_kvhal_env():
    sources = [*(ROOT / "src").rglob("*.py"), *(ROOT / "plugins").glob("*/src/**/*.py")]
    offenders = []
    for path in sources:
        if path.name == "env.py" and path.parent.name == "kvhal":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(os\.environ|getenv)\b.*KVHAL_|environ\.get\((ENV_|[A-Z_]*_ENV)", line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "read KVHAL_* settings through kvhal.env.read:\n" + "\n".join(offenders)


def test_every_kvhal_variable_named_in_the_code_is_declared():
    names = set()
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "plugins").glob("*/src/**/*.py")]:
        names |= set(re.findall(r"\bKVHAL_[A-Z0-9_]+\b", path.read_text()))
    assert names - set(env.SETTINGS) == set()


def test_settings_are_read_at_use_not_at_import(monkeypatch):
    monkeypatch.setenv("KVHAL_CPU_NT_THRESHOLD", "12345")
    assert CopyEngine(1).nt_threshold == 12345
    monkeypatch.setenv("KVHAL_DISABLE_PLUGINS", "cpu")
    assert [p.name for p in PluginRegistry(autoload=False).plugins if p.blocked_by] == ["cpu"]


def test_an_undeclared_setting_is_refused():
    with pytest.raises(KeyError, match=r"declare it in kvhal\.env\.SETTINGS"):
        env.read("KVHAL_NO_SUCH_THING")
    assert env.read("KVHAL_DEVICE", {"KVHAL_DEVICE": ""}) is None
