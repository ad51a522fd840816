"""The scheduler-call recordings' format (``scheduler_calls.py``): JSON lines, no pickle.

A recorded value is JSON with tags: bytes ``{"b": hex}``, tuple ``{"t": [...]}``, set
``{"s": [...]}``, dict ``{"m": [[k, v], ...]}`` (keys of any type), enum ``{"e": "module:name",
"v": value}``, object ``{"o": "module:name", "a": {attr: value}}``. Decoding imports kvhal's
modules only: kvhal's classes come back as themselves (made without ``__init__``, their
attributes set), this module's stand-ins as themselves, anything else (vLLM's
``KVConnectorOutput``) as an :class:`Obj` of its attributes, as kvhal reads it.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
from typing import Any

# -- what a recording holds (stand-ins for vLLM's objects, as JSON) ------------------------


class Req:
    """A request as kvhal reads it."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.block_hashes: list[bytes] = []
        self.num_tokens = self.num_computed_tokens = self.num_prompt_tokens = 0
        self.cache_salt: str | None = None


class Blocks:
    def __init__(self, ids: Any) -> None:
        self.ids = ids

    def get_block_ids(self) -> Any:
        return self.ids


class Tables:
    def __init__(self, tables: dict[str, Any]) -> None:
        self.tables = tables

    def get_block_ids(self, req_id: str) -> Any:
        return self.tables.get(req_id)


class Obj:
    """Attributes only (a scheduler output, its new requests, its cached requests)."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


_STAND_INS = {"Req": Req, "Blocks": Blocks, "Tables": Tables, "Obj": Obj}


def encode(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return {"b": bytes(value).hex()}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {"t": [encode(v) for v in value]}
    if isinstance(value, set | frozenset):
        return {"s": sorted((encode(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))}
    if isinstance(value, dict):
        return {"m": [[encode(k), encode(v)] for k, v in value.items()]}
    cls = type(value)
    name = f"{cls.__module__}:{cls.__qualname__}"
    if isinstance(value, enum.Enum):
        return {"e": name, "v": encode(value.value)}
    if dataclasses.is_dataclass(value):
        attrs = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    else:
        attrs = dict(getattr(value, "__dict__", {}))
        for klass in cls.__mro__:
            for slot in getattr(klass, "__slots__", ()):
                if slot not in attrs and hasattr(value, slot):
                    attrs[slot] = getattr(value, slot)
    return {"o": name, "a": {k: encode(v) for k, v in attrs.items()}}


def _kvhal_class(name: str) -> Any:
    module, _, qualname = name.partition(":")
    if module != "kvhal" and not module.startswith("kvhal."):
        return None
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    return cls if isinstance(cls, type) else None


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "b" in value:
        return bytes.fromhex(value["b"])
    if "t" in value:
        return tuple(decode(v) for v in value["t"])
    if "s" in value:
        return {decode(v) for v in value["s"]}
    if "m" in value:
        return {decode(k): decode(v) for k, v in value["m"]}
    if "e" in value:
        cls = _kvhal_class(value["e"])
        return cls(decode(value["v"])) if cls is not None else decode(value["v"])
    attrs = {k: decode(v) for k, v in value["a"].items()}
    module, _, qualname = value["o"].partition(":")
    cls = _kvhal_class(value["o"]) or (_STAND_INS.get(qualname) if module == __name__ else None)
    if cls is None:
        return Obj(**attrs)
    obj = cls.__new__(cls)
    for k, v in attrs.items():
        object.__setattr__(obj, k, v)
    return obj
