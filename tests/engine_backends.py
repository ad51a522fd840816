"""Attention backends registered in the installed vLLM through its own ``register_backend``.

The same public extension point vllm-ascend uses for its ``CUSTOM`` backend: a
test declares a backend whose layouts differ from kvhal's tables and sees whose
answer wins. Each backend lives in a throw-away module and is unregistered (and
garbage-collected, so vLLM's subclass lists forget it) on exit.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import itertools
import sys
import types
from collections.abc import Iterator

import pytest

from tests import vllm_backend_sources as sources

registry = pytest.importorskip("vllm.v1.attention.backends.registry")
backend_module = pytest.importorskip("vllm.v1.attention.backend")
kv_cache_layout = pytest.importorskip("vllm.v1.kv_cache_layout")
# What an engine loads as its connector: it hands vLLM's layouts to kvhal.layouts.
pytest.importorskip("kvhal.vllm")
#: Deleted from sys.modules, it puts the test outside an engine (kvhal then reads its tables).
REGISTRY_MODULE = registry.__name__

MODULE = "kvhal_test_engine_backends"
_serial = itertools.count()


def backend_class(get_name: str, declares: object, class_name: str = "Backend") -> type:
    """A vLLM ``AttentionBackend`` subclass: ``declares`` is layout names, ``None`` (any),
    or an exception its ``supported_kv_cache_layouts()`` raises."""

    def supported_kv_cache_layouts(cls: type) -> object:
        if isinstance(declares, BaseException):
            raise declares
        if declares is None:
            return None
        return tuple(kv_cache_layout.KVCacheLayout[name] for name in declares)

    def body(namespace: dict) -> None:
        namespace["__module__"] = MODULE
        namespace["get_name"] = staticmethod(lambda: get_name)
        namespace["supported_kv_cache_layouts"] = classmethod(supported_kv_cache_layouts)

    return types.new_class(class_name, (backend_module.AttentionBackend,), exec_body=body)


@contextlib.contextmanager
def registered(
    enum_name: str | None, get_name: str, declares: object, path: str | None = None
) -> Iterator[type]:
    """A backend class, imported (its module in ``sys.modules``) and, when ``enum_name``
    is given, registered as that ``AttentionBackendEnum`` member (as vllm-ascend registers
    ``CUSTOM``); ``path`` registers another class path instead of the class's own."""
    module = sys.modules.get(MODULE) or types.ModuleType(MODULE)
    sys.modules[MODULE] = module
    cls = backend_class(get_name, declares, class_name=f"Backend{next(_serial)}")
    setattr(module, cls.__name__, cls)
    member = registry.AttentionBackendEnum[enum_name] if enum_name else None
    previous = member.get_path() if member is not None and member.is_overridden() else None
    if member is not None:
        registry.register_backend(member, path or f"{MODULE}.{cls.__name__}")
    try:
        yield cls
    finally:
        if member is not None:
            if previous is not None:
                registry.register_backend(member, previous)
            else:
                member.clear_override()
        delattr(module, cls.__name__)
        del cls
        gc.collect()  # AttentionBackend.__subclasses__() holds weak references


def class_paths(name: str) -> list[tuple[str, str]]:
    """(module, class) of what vLLM calls ``name``: its enum member, else the classes
    whose get_name() it is (read from vLLM's source, so nothing is imported to find them)."""
    member = registry.AttentionBackendEnum.__members__.get(name)
    if member is not None:
        module, _, cls = member.value.rpartition(".")
        return [(module, cls)]
    return sources.backends_named(name)


def vllm_backends(name: str) -> list[type]:
    """vLLM's classes for ``name``, imported; skips where they need a GPU library to import.

    Only for names in kvhal's tables: each of their modules imports cleanly or raises here
    (some other backend modules abort the interpreter when imported without their GPU).
    """
    classes = []
    for module, cls in class_paths(name):
        try:
            classes.append(getattr(importlib.import_module(module), cls))
        except (ImportError, RuntimeError, OSError, AssertionError, AttributeError) as exc:
            pytest.skip(f"{name} does not import here: {type(exc).__name__}: {exc}")
    assert classes, f"vLLM knows no backend {name!r}"
    return classes
