"""``kvhal new-plugin NAME``: write the package of a new device plugin, every hook stubbed.

The package (``kvhal-NAME``) has the ``kvhal.plugins`` entry point, a plugin class whose
hooks each fail the conformance suite naming the section of ``docs/vendor-guide.md`` that
explains them, tests that run the suite, and a README with a "Verified on" line to fill in
from the published report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

from kvhal.errors import ValidationError

TEMPLATES = Path(__file__).with_name("templates")

#: A plugin name: what ``KVHAL_DEVICE`` and ``kvhal conformance --device`` take, and the
#: suffix of the module (``kvhal_NAME``) and of the distribution (``kvhal-NAME``).
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,39}")

#: Names kvhal's own plugins use: the built-in one, and those kvhal ships beside it.
TAKEN = frozenset({"cpu", "cuda", "rocm", "npu"})

#: template -> path in the package (``{module}`` is replaced).
FILES = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "init.py.tmpl": "src/{module}/__init__.py",
    "plugin.py.tmpl": "src/{module}/plugin.py",
    "test_conformance.py.tmpl": "tests/test_conformance.py",
}


@dataclass(frozen=True)
class PluginNames:
    """The names a plugin called ``name`` goes by."""

    name: str

    @property
    def module(self) -> str:
        return f"kvhal_{self.name}"

    @property
    def distribution(self) -> str:
        return f"kvhal-{self.name.replace('_', '-')}"

    @property
    def plugin_class(self) -> str:
        return "".join(part.capitalize() for part in self.name.split("_")) + "Plugin"


def check_name(name: str) -> PluginNames:
    """The names for plugin ``name``, or :class:`ValidationError` saying what is wrong with it."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValidationError(
            "name",
            f"{name!r} is no plugin name: use 1 to 40 lowercase letters, digits and '_', starting "
            "with a letter (it becomes the entry-point name and the module kvhal_NAME)",
        )
    if name in TAKEN:
        raise ValidationError("name", f"{name!r} is the name of one of kvhal's own plugins; choose another")
    return PluginNames(name)


def write_plugin(name: str, parent: Path | str = ".") -> Path:
    """Write the package of plugin ``name`` into ``parent/kvhal-NAME`` and return its path.

    :raises ValidationError: the name is not usable (see :func:`check_name`), or the
        directory exists already (nothing is overwritten).
    """
    from kvhal import __version__

    names = check_name(name)
    root = Path(parent) / names.distribution
    if root.exists():
        raise ValidationError("name", f"{root} exists already; remove it or choose another directory")
    values = {
        "name": names.name,
        "module": names.module,
        "dist": names.distribution,
        "cls": names.plugin_class,
        "kvhal_version": __version__,
    }
    for template, target in FILES.items():
        text = Template((TEMPLATES / template).read_text()).substitute(values)
        path = root / target.format(module=names.module)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
