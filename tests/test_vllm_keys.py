"""One key codec: the offload key of a block and group, and back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvhal.vllm.keys import offload_key, split_offload_key


@given(st.binary(min_size=1, max_size=64), st.integers(0, 2**32 - 1))
def test_a_key_splits_back_into_its_hash_and_group(block_hash, group_id):
    key = offload_key(block_hash, group_id)
    assert split_offload_key(key) == (block_hash, group_id)


def test_groups_of_one_block_get_different_keys():
    assert offload_key(b"h" * 32, 0) != offload_key(b"h" * 32, 1)
    assert offload_key(b"h" * 32, 1) == b"h" * 32 + b"\x00\x00\x00\x01"
