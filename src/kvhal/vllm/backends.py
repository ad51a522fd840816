"""The KV layouts vLLM's own attention backend classes declare.

Each vLLM attention backend says which KV cache layouts its kernels read,
most preferred first, through the classmethod ``supported_kv_cache_layouts()``
(``None``: any layout). Device plugins ask through
:func:`kvhal.layouts.layouts_from_engine`, which calls :func:`declared_layouts`
once :mod:`kvhal.vllm` is imported (it hands it over with
:func:`~kvhal.layouts.answer_layouts_from`); it answers only inside a vLLM
engine (vLLM's backend registry already imported), and the plugins fall back to
their own tables whenever this module has no answer.

Only classes already imported are consulted; this module never imports a
backend's module. vLLM imports the backends it runs, and importing one it does
not run can be slow, fail without the vendor's libraries, or (a backend
registering vLLM's native ops a second time) abort the process.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator

from kvhal.layouts import KVLayout

#: Imported by vLLM when it selects attention backends: the sign kvhal runs in an engine.
VLLM_BACKEND_REGISTRY = "vllm.v1.attention.backends.registry"
_BASE = "vllm.v1.attention.backend"


def _loaded_class(path: str) -> type | None:
    """The class at ``module.Class`` if its module is already imported."""
    module_name, _, class_name = path.rpartition(".")
    module = sys.modules.get(module_name) if module_name else None
    cls = getattr(module, class_name, None) if module is not None else None
    return cls if isinstance(cls, type) else None


def _subclasses(base: type) -> Iterator[type]:
    seen: set[type] = set()
    stack = list(base.__subclasses__())
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.add(cls)
            yield cls
            stack.extend(cls.__subclasses__())


def _name_of(cls: type) -> str | None:
    try:
        name = cls.get_name()  # type: ignore[attr-defined]
    except Exception:  # abstract bases raise NotImplementedError
        return None
    return name.upper() if isinstance(name, str) else None


def backend_classes(attention_backend: str) -> list[type]:
    """The imported vLLM backend classes ``attention_backend`` names, best match first.

    A name of vLLM's ``AttentionBackendEnum`` (``"ROCM_AITER_FA"``) means the class
    the enum points at, overrides registered through ``register_backend`` included;
    otherwise the imported ``AttentionBackend`` subclasses whose ``get_name()`` it is
    (``"AITER_TRITON_MLA"``, ``"KPOOL_TAIL"``, vllm-ascend's ``"CUSTOM"``). Several
    classes share some ``get_name()`` values (AITER FA calls itself ``FLASH_ATTN``).

    :param attention_backend: an enum name or a ``get_name()`` value, any case.
    """
    name = attention_backend.upper()
    registry = importlib.import_module(VLLM_BACKEND_REGISTRY)  # light: it imports no backend module
    member = registry.AttentionBackendEnum.__members__.get(name)
    if member is not None:
        try:
            path = member.get_path()
        except ValueError:  # CUSTOM before anything registered it
            path = ""
        cls = _loaded_class(path) if path else None
        if cls is not None:
            return [cls]
    base = getattr(sys.modules.get(_BASE), "AttentionBackend", None)
    if not isinstance(base, type):
        return []
    return sorted(
        (cls for cls in _subclasses(base) if _name_of(cls) == name),
        key=lambda cls: f"{cls.__module__}.{cls.__qualname__}",
    )


def _as_kvhal(declared: object, cls: type) -> tuple[KVLayout, ...] | None:
    """vLLM's ``KVCacheLayout`` members as kvhal layouts (same names, same stride orders)."""
    if declared is None:
        return None
    layouts = tuple(KVLayout(member.name, tuple(member.value)) for member in declared)  # type: ignore[attr-defined]
    if not layouts:
        raise LookupError(f"{cls.__module__}.{cls.__qualname__}.supported_kv_cache_layouts() is empty")
    return layouts


def declared_layouts(attention_backend: str) -> tuple[KVLayout, ...] | None:
    """What vLLM's class for ``attention_backend`` declares, preferred first.

    :param attention_backend: an enum name or a ``get_name()`` value (see :func:`backend_classes`).
    :return: the declared layouts, or ``None`` when the backend declares that it
        reads any layout.
    :raises LookupError: not inside a vLLM engine, no imported class has that name, or
        several disagree.
    :raises Exception: whatever the backend's ``supported_kv_cache_layouts()`` raised.
    """
    if VLLM_BACKEND_REGISTRY not in sys.modules:
        raise LookupError("not inside a vLLM engine (its attention backend registry is not imported)")
    classes = backend_classes(attention_backend)
    if not classes:
        raise LookupError(f"no imported vLLM attention backend is named {attention_backend!r}")
    answers = {cls: _as_kvhal(cls.supported_kv_cache_layouts(), cls) for cls in classes}  # type: ignore[attr-defined]
    distinct = set(answers.values())
    if len(distinct) > 1:
        described = "; ".join(
            f"{cls.__module__}.{cls.__qualname__}: {'any' if a is None else [str(x) for x in a]}"
            for cls, a in answers.items()
        )
        raise LookupError(f"vLLM backends named {attention_backend!r} disagree: {described}")
    return distinct.pop()
