"""KV layouts of vLLM 0.32's ROCm attention backends (``supported_kv_cache_layouts()``).

kvhal is a KV connector, so where a backend answers differently with a
connector enabled, the connector's answer is the one here.
"""

from __future__ import annotations

from kvhal.layouts import BLHNC, LBHNC, LBNHC, LHBNC, KVLayout
from kvhal_cuda.layouts import ANY_LAYOUT

#: ``rocm_attn.py:232``: native HIP kernels need H outermost; the Triton path takes LBHNC.
ROCM_ATTN = (LHBNC, LBHNC)
#: ``rocm_aiter_unified_attn.py:123`` with a KV connector ("Connectors like MoRI assume
#: contiguous blocks"); without one it is (LBHNC, LHBNC).
ROCM_AITER_UNIFIED_ATTN = (LBHNC,)
#: ``rocm_aiter_fa.py:839``: layer outermost; H outermost first when the KV cache is shuffled.
ROCM_AITER_FA = (LBHNC, LHBNC)
ROCM_AITER_FA_SHUFFLED = (LHBNC, LBHNC)
#: ``mla/rocm_aiter_mla_sparse.py:394``.
ROCM_AITER_MLA_SPARSE = (LBNHC, LBHNC, BLHNC)
#: No backend named: LBHNC, the layout every ROCm backend vLLM picks with a connector
#: accepts (``platforms/rocm.py`` ``_get_backend_priorities``), then the rest.
ROCM_DEFAULT: tuple[KVLayout, ...] = (LBHNC, *(x for x in ANY_LAYOUT if x != LBHNC))

ROCM_BACKEND_LAYOUTS: dict[str, tuple[KVLayout, ...]] = {
    "ROCM_ATTN": ROCM_ATTN,
    "ROCM_AITER_UNIFIED_ATTN": ROCM_AITER_UNIFIED_ATTN,
    "ROCM_AITER_MLA_SPARSE": ROCM_AITER_MLA_SPARSE,
    # Declare None (any layout): Triton and the MLA backends.
    "TRITON_ATTN": ANY_LAYOUT,
    "TRITON_MLA": ANY_LAYOUT,
    "ROCM_AITER_MLA": ANY_LAYOUT,
    "ROCM_AITER_TRITON_MLA": ANY_LAYOUT,
    "TURBOQUANT": (LBNHC,),
}
#: AITER FA is ``ROCM_AITER_FA`` in vLLM's enum but calls itself ``FLASH_ATTN`` (get_name()).
AITER_FA_NAMES = frozenset({"ROCM_AITER_FA", "FLASH_ATTN"})


def shuffle_kv_enabled(environ: dict[str, str]) -> bool:
    """``VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT`` as vLLM's ``envs.py`` reads it."""
    return environ.get("VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT", "False").lower() in ("true", "1")


def rocm_kv_layouts(attention_backend: str | None, shuffled_kv: bool) -> tuple[KVLayout, ...]:
    """Layouts a ROCm device's attention kernels accept, preferred first."""
    if attention_backend is None:
        return ROCM_DEFAULT
    name = attention_backend.upper()
    if name in AITER_FA_NAMES:
        return ROCM_AITER_FA_SHUFFLED if shuffled_kv else ROCM_AITER_FA
    return ROCM_BACKEND_LAYOUTS.get(name, ANY_LAYOUT)
