"""Every import path and public name the docs show works: read from the docs themselves.

The Python code blocks of README.md, conformance/README.md and docs/*.md are scanned for
``from kvhal... import ...``, ``import kvhal...`` and ``kvhal.NAME`` (the package's public
names), and the vendor guide's API table for its names and modules; each is imported. A doc
that names a path that moved fails here, and so does a move that breaks a path a doc shows.
The modules that moved into ``kvhal.offload`` and ``kvhal.tiers`` import from their real paths,
and their old paths at the package's root are gone (no re-export module came back).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "conformance" / "README.md", *(ROOT / "docs").glob("*.md")])
#: kvhal's own packages; the vendor guide's example plugin (``kvhal_acme``) is not installed.
OURS = re.compile(r"kvhal(_conformance)?(\.\w+)*$")
CODE_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)
FROM_IMPORT = re.compile(r"^\s*from\s+([\w.]+)\s+import\s+(\([^)]*\)|[^\n#]+)", re.M)
IMPORT = re.compile(r"^\s*import\s+([\w., ]+)", re.M)
ATTRIBUTE = re.compile(r"(?<![\w.])kvhal\.([A-Za-z_]\w*)")
#: The vendor guide's API table: ``| `A`, `B` | `kvhal.module` | what for |``.
TABLE_ROW = re.compile(r"^\| ((?:`\w+`(?:, )?)+) \| `(kvhal[\w.]*)` \|", re.M)

#: Old module paths at the package's root (removed before 0.1.0) and where each module lives.
MOVED = {
    "kvhal.manager": "kvhal.offload.manager",
    "kvhal.host_tier": "kvhal.offload.host_tier",
    "kvhal.transfer": "kvhal.offload.transfer",
    "kvhal.offloader": "kvhal.offload.offloader",
    "kvhal.tier_backend": "kvhal.tiers.backend",
    "kvhal.remote_store": "kvhal.tiers.remote.store",
}
#: The main names of each moved module, as users import them.
MOVED_NAMES = {
    "kvhal.offload.manager": ["STORING", "BlockState", "OffloadEvent", "OffloadingManager", "StorePlan"],
    "kvhal.offload.host_tier": ["HostTier", "SlotPool"],
    "kvhal.offload.transfer": ["TransferEngine", "TransferKind", "TransferResult"],
    "kvhal.offload.offloader": ["Offloader", "StoreJob"],
    "kvhal.tiers.backend": [
        "CORRUPT",
        "FOREIGN",
        "IO_ERROR",
        "MISSING",
        "OK",
        "READ_FAILURES",
        "TierBackend",
        "TierFactory",
        "TierSpec",
    ],
    "kvhal.tiers.remote.store": ["ABSENT", "FAILED", "RemoteStore", "StoreFactory", "StoreUnavailable"],
}


def shown_names() -> list[tuple[str, str | None, str]]:
    """``(module, name or None, where)`` for every import and public name the docs show."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        where = doc.relative_to(ROOT).as_posix()
        for block in CODE_BLOCK.findall(text):
            for module, names in FROM_IMPORT.findall(block):
                if OURS.match(module):
                    for name in names.strip("()").replace("\n", " ").split(","):
                        name = name.split(" as ")[0].strip()
                        if name:
                            found.append((module, name, where))
            for modules in IMPORT.findall(block):
                for module in modules.split(","):
                    module = module.split(" as ")[0].strip()
                    if OURS.match(module):
                        found.append((module, None, where))
            found += [("kvhal", name, where) for name in ATTRIBUTE.findall(block)]
        for names, module in TABLE_ROW.findall(text):
            found += [(module, name.strip("`"), where) for name in names.split(", ")]
    return found


SHOWN = shown_names()


def test_the_docs_show_imports() -> None:
    # the scan finds what it should: a doc rewritten in another form must not empty this test
    modules = {module for module, _, _ in SHOWN}
    assert {"kvhal", "kvhal.hookspecs", "kvhal.layouts", "kvhal_conformance.base"} <= modules, modules
    assert len(SHOWN) > 40


@pytest.mark.parametrize(("module", "name", "where"), SHOWN, ids=[f"{m}:{n or ''}" for m, n, _ in SHOWN])
def test_every_import_the_docs_show_works(module: str, name: str | None, where: str) -> None:
    imported = importlib.import_module(module)
    if name is not None and not hasattr(imported, name):
        importlib.import_module(f"{module}.{name}")  # a module path (``"kvhal.vllm"``), else an error


@pytest.mark.parametrize("module", sorted(MOVED_NAMES))
def test_moved_modules_import_from_their_real_paths(module: str) -> None:
    imported = importlib.import_module(module)
    missing = [name for name in MOVED_NAMES[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lacks {missing}"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_root_paths_are_gone(old: str) -> None:
    assert MOVED[old] in MOVED_NAMES
    assert not (ROOT / "src" / (old.replace(".", "/") + ".py")).exists(), old
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
