"""The load's blocks: keys, and content that is a function of the key, so every byte read is checked.

A key names ``(origin, n)`` within a run: ``origin`` 0 is the pool every client writes
(a shared prefix: many engines race to store the same blocks), origin ``i + 1`` the blocks only
client row ``i`` writes. A block's content is 64-bit words, word ``w`` the key's BLAKE2b words
(``w mod 4``) XOR ``w * golden``: no two positions and no two keys hold the same word, so a
block served under another name, shifted, torn or stale differs in every word it got wrong.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from kvhal.bench.common import KEY_BYTES

#: the origin of the blocks every client writes (a shared prefix)
SHARED = 0
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
#: an acknowledged write's record in a client's log: origin, n, monotonic ns at which the write began
ACK = struct.Struct("<IQq")


def key(nonce: bytes, origin: int, n: int) -> bytes:
    """The key of block ``n`` of ``origin`` in the run ``nonce`` (8 bytes)."""
    head = nonce + origin.to_bytes(4, "big") + n.to_bytes(8, "big")
    return head + bytes(KEY_BYTES - len(head))


class Content:
    """Blocks of ``block_bytes`` (a multiple of 32) whose content is a function of their key."""

    def __init__(self, block_bytes: int) -> None:
        if block_bytes % 32:
            raise ValueError(f"block_bytes must be a multiple of 32, got {block_bytes}")
        self.words = block_bytes // 8
        self._mixed = np.arange(self.words, dtype=np.uint64) * _GOLDEN
        self._scratch = np.empty(self.words, dtype=np.uint64)

    def fill(self, out: np.ndarray, block_key: bytes) -> None:
        """Write ``block_key``'s content into ``out`` (``words`` uint64)."""
        digest = np.frombuffer(hashlib.blake2b(block_key, digest_size=32).digest(), dtype=np.uint64)
        np.bitwise_xor(np.resize(digest, self.words), self._mixed, out=out)

    def matches(self, found: np.ndarray, block_key: bytes) -> bool:
        """Whether ``found`` (``words`` uint64) is ``block_key``'s content, every byte."""
        self.fill(self._scratch, block_key)
        return bool(np.array_equal(found, self._scratch))
