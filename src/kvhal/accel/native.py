"""Vendor runtime libraries through ctypes: loading one, and binding its calls.

Plugins call a few C functions of their vendor runtime (libcudart,
libamdhip64, libascendcl) that torch does not bind. A missing library or
symbol is a reason to use another path, never a crash at import.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any


def load_library(path: str) -> tuple[ctypes.CDLL | None, str]:
    """``(library, "")``, or ``(None, why)`` when ``path`` cannot be loaded."""
    try:
        return ctypes.CDLL(path), ""
    except OSError as exc:
        return None, f"{path} could not be loaded ({exc})"


def bind(lib: Any, name: str, argtypes: Sequence[Any], restype: Any = ctypes.c_int) -> Callable[..., Any]:
    """``lib.name`` with its C prototype set; raises ``AttributeError`` if the library lacks it."""
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn
