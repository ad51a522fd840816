"""What vLLM's attention backends declare, read from the installed vLLM's source (no import).

Some backend classes cannot be imported on a machine without their GPU libraries
(and importing some aborts the process), so the layout tables are checked
against vLLM's source as well as against the classes that do import. This reads
every ``AttentionBackend`` subclass in the installed ``vllm`` package: its
``get_name()`` literal and its ``supported_kv_cache_layouts()`` when that is a
plain ``return (KVCacheLayout.X, ...)`` / ``return None``, following base classes
(resolved through ``from ... import``) for what a class inherits.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

#: A declaration this reader cannot evaluate (it depends on the platform or a setting).
CONDITIONAL = "conditional"
_METHOD = "supported_kv_cache_layouts"


@dataclass(frozen=True)
class BackendSource:
    module: str
    name: str  # the class name
    line: int
    bases: tuple[tuple[str, str], ...]  # (module, class name) of each base, as resolved
    get_name: str | None  # the literal its own get_name() returns
    declared: object  # own declaration: tuple of layout names, None, CONDITIONAL, or "inherit"
    defines_method: bool


def vllm_root() -> Path | None:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    return Path(spec.origin).parent if spec and spec.origin else None


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _returned(function: ast.FunctionDef) -> object:
    body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return):
        return CONDITIONAL
    value = body[0].value
    if value is None or (isinstance(value, ast.Constant) and value.value is None):
        return None
    if isinstance(value, ast.Tuple) and all(
        isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "KVCacheLayout"
        for e in value.elts
    ):
        return tuple(e.attr for e in value.elts)  # type: ignore[attr-defined]
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == _METHOD
        and isinstance(value.func.value, ast.Call)
        and getattr(value.func.value.func, "id", None) == "super"
    ):
        return "inherit"
    return CONDITIONAL


def _get_name_literal(function: ast.FunctionDef) -> str | None:
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant):
            return node.value.value if isinstance(node.value.value, str) else None
    return None


def _classes_in(root: Path, path: Path) -> list[BackendSource]:
    module = _module_name(root, path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                imported[alias.asname or alias.name] = (node.module, alias.name)
    found = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        bases = []
        for base in node.bases:
            base = base.value if isinstance(base, ast.Subscript) else base  # Generic[...]
            if isinstance(base, ast.Name):
                bases.append(imported.get(base.id, (module, base.id)))
        methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
        method = methods.get(_METHOD)
        found.append(
            BackendSource(
                module=module,
                name=node.name,
                line=node.lineno,
                bases=tuple(bases),
                get_name=_get_name_literal(methods["get_name"]) if "get_name" in methods else None,
                declared=_returned(method) if method else "inherit",
                defines_method=method is not None,
            )
        )
    return found


@functools.cache
def index() -> dict[tuple[str, str], BackendSource]:
    """Every class in the files that mention backend names or layouts, by (module, class)."""
    root = vllm_root()
    if root is None:
        return {}
    classes: dict[tuple[str, str], BackendSource] = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "def get_name" in text or _METHOD in text or "AttentionBackend" in text:
            for cls in _classes_in(root, path):
                classes[(cls.module, cls.name)] = cls
    return classes


def _ancestry(key: tuple[str, str]) -> list[BackendSource]:
    """The class and its first-base chain (the MRO for single inheritance)."""
    chain, classes = [], index()
    while key in classes and len(chain) < 50:
        cls = classes[key]
        chain.append(cls)
        if not cls.bases:
            break
        key = cls.bases[0]
    return chain


BASE = ("vllm.v1.attention.backend", "AttentionBackend")


def is_backend(key: tuple[str, str]) -> bool:
    return key != BASE and any((cls.module, cls.name) == BASE for cls in _ancestry(key))


def declared(key: tuple[str, str]) -> object:
    """What the class's ``supported_kv_cache_layouts()`` returns: layout names, None, or CONDITIONAL."""
    for cls in _ancestry(key):
        if cls.declared != "inherit":
            return cls.declared
    return None  # AttentionBackend's default


def reported_name(key: tuple[str, str]) -> str | None:
    for cls in _ancestry(key):
        if cls.get_name is not None:
            return cls.get_name
    return None


def backends_named(name: str) -> list[tuple[str, str]]:
    """The backend classes whose ``get_name()`` is ``name`` (their own or inherited)."""
    return [key for key in index() if is_backend(key) and reported_name(key) == name]
