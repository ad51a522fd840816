"""A worker trace's contents as JSON and back, each field checked on the way back and named
in the error (:class:`TraceError`): the step's jobs, the connector's configuration, the KV
cache tensors' structure (:mod:`kvhal.vllm.trace` records and writes them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvhal.errors import KVHALError
from kvhal.tiers.chain import TierRead
from kvhal.vllm.config import ConnectorConfig, GroupInfo, LowerTierConfig, RemoteTierConfig
from kvhal.vllm.metadata import Groups, KVHALMetadata, LoadJob, ReadJob, StoreJob, WriteJob


class TraceError(KVHALError):
    """A trace file kvhal cannot replay: the message names the field."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(f"trace {field_name}: {message}")


# -- the step's jobs as JSON ------------------------------------------------------------------


def _groups_json(groups: Groups) -> dict[str, list[list[int]]]:
    return {str(g): [list(ids), list(slots)] for g, (ids, slots) in groups.items()}


def read_json(read: TierRead) -> dict[str, Any]:
    return {
        "tier": read.tier,
        "keys": [k.hex() for k in read.keys],
        "slots": list(read.slots),
        "host_slots": list(read.host_slots),
    }


def _write_json(write: WriteJob) -> dict[str, Any]:
    return {
        "job_id": write.job_id,
        "tier": write.tier,
        "keys": [k.hex() for k in write.keys],
        "host_slots": list(write.host_slots),
        "slots": list(write.slots),
        "snapshot": write.snapshot,
    }


def meta_json(meta: KVHALMetadata) -> dict[str, Any]:
    """One step's metadata as JSON (bytes as hex, group ids as strings)."""
    return {
        "loads": [
            {
                "job_id": j.job_id,
                "req_id": j.req_id,
                "groups": _groups_json(j.groups),
                "reads": [read_json(r) for r in j.reads],
                "sync": j.sync,
                "doomed": j.doomed,
            }
            for j in meta.loads
        ],
        "stores": [
            {
                "job_id": j.job_id,
                "req_id": j.req_id,
                "groups": _groups_json(j.groups),
                "writes": [_write_json(w) for w in j.writes],
            }
            for j in meta.stores
        ],
        "prefetches": [
            {"job_id": j.job_id, "req_id": j.req_id, "reads": [read_json(r) for r in j.reads]}
            for j in meta.prefetches
        ],
        "writes": [_write_json(w) for w in meta.writes],
        "fence": list(meta.fence),
        "held": list(meta.held),
        "idle": meta.idle,
        "no_forward": meta.no_forward,
        "send_stats": meta.send_stats,
    }


class _Reader:
    """Reads a JSON value field by field, naming the field of any error."""

    def __init__(self, value: Any, where: str) -> None:
        self.value = value
        self.where = where

    def get(self, key: str, kind: type | tuple[type, ...]) -> Any:
        if not isinstance(self.value, dict):
            raise TraceError(self.where, f"expected an object, found {type(self.value).__name__}")
        if key not in self.value:
            raise TraceError(f"{self.where}.{key}", "missing")
        value = self.value[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _tuple(kind)):
            raise TraceError(f"{self.where}.{key}", f"expected {_names(kind)}, found {type(value).__name__}")
        return value

    def sub(self, key: str) -> _Reader:
        return _Reader(self.get(key, dict), f"{self.where}.{key}")

    def items(self, key: str) -> list[_Reader]:
        return [_Reader(v, f"{self.where}.{key}[{i}]") for i, v in enumerate(self.get(key, list))]

    def ints(self, key: str) -> list[int]:
        values = self.get(key, list)
        for i, v in enumerate(values):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TraceError(f"{self.where}.{key}[{i}]", f"expected an integer, found {v!r}")
        return values

    def hexes(self, key: str) -> list[bytes]:
        out = []
        for i, v in enumerate(self.get(key, list)):
            try:
                out.append(bytes.fromhex(v))
            except (TypeError, ValueError):
                raise TraceError(f"{self.where}.{key}[{i}]", f"expected hex bytes, found {v!r}") from None
        return out


def _tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _tuple(kind))


def _groups_from(r: _Reader) -> dict[int, tuple[list[int], list[int]]]:
    groups = r.get("groups", dict)
    out = {}
    for key in groups:
        pair = _Reader(groups, f"{r.where}.groups")
        ids_slots = pair.get(key, list)
        if len(ids_slots) != 2:
            raise TraceError(f"{r.where}.groups.{key}", "expected [block ids, host slots]")
        both = _Reader({"ids": ids_slots[0], "slots": ids_slots[1]}, f"{r.where}.groups.{key}")
        ids, slots = both.ints("ids"), both.ints("slots")
        if len(ids) != len(slots) or not key.isdigit():
            raise TraceError(f"{r.where}.groups.{key}", "block ids and host slots of unequal length")
        out[int(key)] = (ids, slots)
    return out


def read_from(r: _Reader) -> TierRead:
    return TierRead(r.get("tier", str), r.hexes("keys"), r.ints("slots"), r.ints("host_slots"))


def _write_from(r: _Reader) -> WriteJob:
    return WriteJob(
        r.get("job_id", int),
        r.get("tier", str),
        r.hexes("keys"),
        r.ints("host_slots"),
        r.ints("slots"),
        r.get("snapshot", bool),
    )


def meta_from(r: _Reader) -> KVHALMetadata:
    """:func:`meta_json`'s inverse, checked field by field."""
    return KVHALMetadata(
        loads=[
            LoadJob(
                j.get("job_id", int),
                j.get("req_id", str),
                _groups_from(j),
                [read_from(x) for x in j.items("reads")],
                j.get("sync", bool),
                j.get("doomed", bool),
            )
            for j in r.items("loads")
        ],
        stores=[
            StoreJob(
                j.get("job_id", int),
                j.get("req_id", str),
                _groups_from(j),
                [_write_from(w) for w in j.items("writes")],
            )
            for j in r.items("stores")
        ],
        prefetches=[
            ReadJob(j.get("job_id", int), j.get("req_id", str), [read_from(x) for x in j.items("reads")])
            for j in r.items("prefetches")
        ],
        writes=[_write_from(w) for w in r.items("writes")],
        fence=r.ints("fence"),
        held=list(r.get("held", list)),
        idle=r.get("idle", bool),
        no_forward=r.get("no_forward", bool),
        send_stats=r.get("send_stats", bool),
    )


# -- the configuration and the caches ---------------------------------------------------------


def config_json(config: ConnectorConfig) -> dict[str, Any]:
    """The connector's configuration, its stores named by kind only (URLs and secrets stay out)."""
    tiers = []
    for tier in config.tiers:
        if isinstance(tier, LowerTierConfig):
            options = {k: v for k, v in tier.options.items() if k != "path"}  # the replay's own
            tiers.append({"kind": "local", **dataclasses.asdict(tier), "options": options})
        else:
            tiers.append({"kind": "store", "name": tier.name, "scheme": tier.url.split(":", 1)[0]})
    return {
        "cpu_bytes_to_use": config.cpu_bytes_to_use,
        "device": config.device,
        "eviction_policy": config.eviction_policy,
        "offload_prompt_only": config.offload_prompt_only,
        "block_size": config.block_size,
        "groups": [dataclasses.asdict(g) for g in config.groups],
        "world_size": config.world_size,
        "layout": config.layout,
        "load_mode": config.load_mode,
        "tiers": tiers,
        "tenant_labels": config.tenant_labels,
    }


def config_from(r: _Reader, tier_path: Path | None) -> tuple[ConnectorConfig, list[str]]:
    """The configuration to replay with (local tiers under ``tier_path``), and the stores the
    trace used (which the replay cannot reach)."""
    groups = tuple(
        GroupInfo(
            g.get("group_id", int),
            tuple(g.get("layer_names", list)),
            g.get("page_bytes", int),
            g.get("head_size", int),
        )
        for g in r.items("groups")
    )
    tiers: list[LowerTierConfig | RemoteTierConfig] = []
    stores = []
    for t in r.items("tiers"):
        if t.get("kind", str) == "store":
            stores.append(t.get("name", str))
            continue
        options = dict(t.get("options", dict))
        if tier_path is not None:
            options["path"] = str(tier_path / t.get("name", str))
        tiers.append(
            LowerTierConfig(
                backend=t.get("backend", str),
                options=options,
                write=t.get("write", str),
                eviction_policy=t.get("eviction_policy", str),
                config_keys=dict(t.get("config_keys", dict)),
                wait_ms=t.get("wait_ms", (int, type(None))),
                prefetch_blocks=t.get("prefetch_blocks", (int, type(None))),
                wait_policy=t.get("wait_policy", str),
                name=t.get("name", str),
            )
        )
    config = ConnectorConfig(
        cpu_bytes_to_use=r.get("cpu_bytes_to_use", int),
        device=r.get("device", (str, type(None))),
        eviction_policy=r.get("eviction_policy", str),
        offload_prompt_only=r.get("offload_prompt_only", bool),
        block_size=r.get("block_size", int),
        groups=groups,
        world_size=r.get("world_size", int),
        layout=r.get("layout", str),
        load_mode=r.get("load_mode", str),
        fingerprint={"model": "kvhal-replay"},
        tiers=tuple(tiers),
        tenant_labels=r.get("tenant_labels", int),
    )
    return config, stores


def _tensor_json(t: torch.Tensor, storages: dict[int, int], sizes: list[int]) -> dict[str, Any]:
    storage = t.untyped_storage()
    base = storage.data_ptr()
    index = storages.setdefault(base, len(storages))
    if index == len(sizes):
        sizes.append(storage.nbytes())
    return {
        "storage": index,
        "offset_bytes": t.data_ptr() - base,
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype).removeprefix("torch."),
    }


def caches_json(kv_caches: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's KV cache tensors' structure: per layer a tensor, or a list of them (a
    (K, V) pair, a 1-tuple), each a view of one of ``storages`` (by index, with its bytes)."""
    storages: dict[int, int] = {}
    sizes: list[int] = []
    layers: dict[str, Any] = {}
    for name, value in kv_caches.items():
        if isinstance(value, torch.Tensor):
            layers[name] = _tensor_json(value, storages, sizes)
        elif isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
            layers[name] = {"parts": [_tensor_json(v, storages, sizes) for v in value]}
        else:
            layers[name] = {"unsupported": type(value).__name__}
    return {"storages": sizes, "layers": layers}


def reader(value: Any, where: str) -> _Reader:
    return _Reader(value, where)
