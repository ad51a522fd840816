"""What kvhal's tiers hold, told as vLLM's KV cache events (``take_events``): a block stored,
a block removed, each under its KV cache group.

The host tier appears in the medium :data:`MEDIUM` (vLLM's ``"CPU"``). A tier below it
appears as vLLM's own secondary tiers do (``vllm/v1/kv_offload/tiering``): the medium
:data:`STORAGE_MEDIUM`, ``locality`` ``"LOCAL"`` for a local tier (this engine's disk, a
plugin's backend) and ``"REMOTE"`` for a shared store (every engine of the fleet can load
it), and, where vLLM's events have the field (0.32; not 0.27.1), ``ownership`` the tier's
name (``"disk"``, ``"redis"``). A block hash is published as vLLM publishes its own
(``maybe_convert_block_hash``: a 64-bit int unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``),
so a router matches kvhal's blocks to the GPU's.

The tiers track what they would tell only where vLLM publishes events
(:func:`kv_events_enabled` of its ``kv_events_config``, read by the connector): a local
tier's slot keys cost about 150 bytes a block, kept for nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvhal.offload.manager import OffloadEvent
from kvhal.tiers.chain import TierEvent
from kvhal.vllm.keys import split_offload_key

#: The medium kvhal's host tier appears as in vLLM's KV events.
MEDIUM = "CPU"
#: The medium of every tier below the host tier (vLLM's ``MEDIUM_STORAGE``).
STORAGE_MEDIUM = "STORAGE"
LOCAL, REMOTE = "LOCAL", "REMOTE"
#: Whether this vLLM's events carry ``ownership`` (0.32 does, 0.27.1 not).
HAS_OWNERSHIP = "ownership" in BlockStored.__struct_fields__


def kv_events_enabled(kv_events_config: Any) -> bool:
    """Whether vLLM publishes KV events: as its scheduler decides (``kv_events_config`` set
    with ``enable_kv_cache_events``; the same on 0.27.1 and 0.32)."""
    return kv_events_config is not None and bool(getattr(kv_events_config, "enable_kv_cache_events", False))


def kv_events(events: list[OffloadEvent], block_size: int) -> list[KVCacheEvent]:
    """vLLM's KV cache events for the host tier's ``events`` (one per block and group)."""
    out: list[KVCacheEvent] = []
    for event in events:
        out += _events(event.keys, event.removed, block_size, {"medium": MEDIUM})
    return out


def tier_kv_events(events: list[TierEvent], shared: Iterable[str], block_size: int) -> list[KVCacheEvent]:
    """vLLM's KV cache events for the tiers below's ``events``; ``shared``: the stores' names."""
    stores = set(shared)
    out: list[KVCacheEvent] = []
    for event in events:
        where: dict = {"medium": STORAGE_MEDIUM, "locality": REMOTE if event.tier in stores else LOCAL}
        if HAS_OWNERSHIP:
            where["ownership"] = event.tier
        out += _events(event.keys, event.removed, block_size, where)
    return out


def _events(keys: list[bytes], removed: bool, block_size: int, where: dict) -> list[KVCacheEvent]:
    out: list[KVCacheEvent] = []
    for key in keys:
        block_hash, group_id = split_offload_key(key)
        hashes = [maybe_convert_block_hash(block_hash)]  # type: ignore[arg-type] - a BlockHash's bytes
        if removed:
            out.append(BlockRemoved(block_hashes=hashes, group_idx=group_id, **where))
        else:
            out.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=block_size,
                    lora_id=None,
                    lora_name=None,
                    group_idx=group_id,
                    **where,
                )
            )
    return out
