"""KV layouts of vllm-ascend's attention backends.

``AscendAttentionBackend.get_kv_cache_shape`` is ``(2, num_blocks, block_size,
num_kv_heads, head_size)`` and the model runner keeps K and V as separate
tensors per layer (``_allocate_kv_cache``/``_reshape_kv_cache``): each is
``(B, N, H, D)``, i.e. the per-layer order ``B N H C`` of :data:`~kvhal.layouts.LBNHC`
with layers in separate allocations. The MLA backend keeps (nope, rope)
caches of shape ``(B, N, H, kv_lora_rank)`` and ``(B, N, H, rope_dim)``: the
same order. Ascend kernels take no cross-layer layout (vllm-ascend RFC #4140
asks for it). Not covered: 310P's NZ format ``(2, B, H*D/16, N, 16)``, which
splits the content dimension and has no ``[L, B, H, N, C]`` order.
"""

from __future__ import annotations

from kvhal.layouts import LBNHC, KVLayout

ASCEND_LAYOUTS: tuple[KVLayout, ...] = (LBNHC,)


def npu_kv_layouts(attention_backend: str | None) -> tuple[KVLayout, ...]:
    """Layouts an Ascend NPU's attention kernels accept: LBNHC, whatever the backend.

    Every backend on an NPU is one of vllm-ascend's (``ASCEND``, ``ASCEND_MLA``,
    ``ASCEND_SFA``; under the v2 model runner the MLA backend even reports
    ``FLASH_ATTN``), and all of them index ``(B, N, H, D)`` per layer and part.
    """
    return ASCEND_LAYOUTS
