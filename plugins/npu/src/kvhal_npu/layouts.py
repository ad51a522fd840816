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

#: The names vllm-ascend's backends report (``get_name()``): ``CUSTOM`` for
#: ``AscendAttentionBackend``, registered as vLLM's ``AttentionBackendEnum.CUSTOM``
#: (``vllm_ascend/attention/attention_v1.py``, also ``fa3_v1.py``), ``ASCEND_MLA``
#: (``mla_v1.py``), ``ASCEND_SFA`` (``sfa_v1.py``), ``ASCEND_DSA`` and its
#: ``_C4``/``_C128`` variants (``dsa_v1.py``). Older releases used ``ASCEND``.
#: (vllm-ascend registers ``CUSTOM`` with the class path ``"ASCEND"``, which vLLM 0.32's
#: enum cannot resolve, so kvhal finds the class by its ``get_name()``.)
ASCEND_BACKEND_NAMES = frozenset(
    {"CUSTOM", "ASCEND", "ASCEND_MLA", "ASCEND_SFA", "ASCEND_DSA", "ASCEND_DSA_C4", "ASCEND_DSA_C128"}
)


def npu_kv_layouts(attention_backend: str | None) -> tuple[KVLayout, ...]:
    """Layouts an Ascend NPU's attention kernels accept, from the table: LBNHC, whatever the backend.

    Every backend on an NPU is one of vllm-ascend's (:data:`ASCEND_BACKEND_NAMES`;
    under the v2 model runner the MLA backend even reports ``FLASH_ATTN``), and all
    of them index ``(B, N, H, D)`` per layer and part. None of them declares
    ``supported_kv_cache_layouts()``, so vLLM's "any layout" says nothing about them:
    the plugin takes vLLM's answer only where one of them declares layouts (and
    never a CUDA or ROCm class's answer: those describe other kernels).
    """
    return ASCEND_LAYOUTS
