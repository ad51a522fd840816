"""The offloading manager's key for one block of one KV cache group, both ways.

vLLM 0.32's ``OffloadKey`` is packed the same way: the block hash followed by
the group index in 4 big-endian bytes. Keys stay opaque everywhere else.
"""

from __future__ import annotations

GROUP_BYTES = 4


def offload_key(block_hash: bytes, group_id: int) -> bytes:
    """The key of block ``block_hash`` in KV cache group ``group_id``."""
    return block_hash + group_id.to_bytes(GROUP_BYTES, "big")


def offload_keys(block_hashes: list[bytes], group_id: int) -> list[bytes]:
    """:func:`offload_key` of each of ``block_hashes`` in group ``group_id``."""
    suffix = group_id.to_bytes(GROUP_BYTES, "big")
    return [block_hash + suffix for block_hash in block_hashes]


def split_offload_key(key: bytes) -> tuple[bytes, int]:
    """``(block_hash, group_id)`` of a key from :func:`offload_key`."""
    return key[:-GROUP_BYTES], int.from_bytes(key[-GROUP_BYTES:], "big")
