"""What the host tier holds, told as vLLM's KV cache events (``take_events``): a block stored,
a block removed, each under its KV cache group, in the medium :data:`MEDIUM`."""

from __future__ import annotations

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvhal.offload.manager import OffloadEvent
from kvhal.vllm.keys import split_offload_key

#: The medium kvhal's host tier appears as in vLLM's KV events.
MEDIUM = "CPU"


def kv_events(events: list[OffloadEvent], block_size: int) -> list[KVCacheEvent]:
    """vLLM's KV cache events for the host tier's ``events`` (one per block and group)."""
    out: list[KVCacheEvent] = []
    for event in events:
        for key in event.keys:
            block_hash, group_id = split_offload_key(key)
            if event.removed:
                out.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM, group_idx=group_id))
            else:
                out.append(
                    BlockStored(
                        block_hashes=[block_hash],
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=block_size,
                        lora_id=None,
                        medium=MEDIUM,
                        lora_name=None,
                        group_idx=group_id,
                    )
                )
    return out
