"""KV layouts of vLLM 0.32's ROCm attention backends (``supported_kv_cache_layouts()``).

Inside a vLLM engine the backend class vLLM runs answers
(:func:`kvhal.layouts.layouts_from_engine`); these tables answer everywhere
else and whenever vLLM has no answer. kvhal is a KV connector, so where a
backend answers differently with a connector enabled, the connector's answer
is the one here. Keys are vLLM's enum names and, where they differ, the
backends' ``get_name()``.
"""

from __future__ import annotations

from kvhal.layouts import BLHNC, BLNHC, LBHNC, LBNHC, LHBNC, KVLayout
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
    # rocm_segmented_attn.py: RocmSegmentedAttentionBackend inherits ROCM_ATTN's.
    "ROCM_SEGMENTED_ATTN": ROCM_ATTN,
    "ROCM_AITER_UNIFIED_ATTN": ROCM_AITER_UNIFIED_ATTN,
    "ROCM_AITER_MLA_SPARSE": ROCM_AITER_MLA_SPARSE,
    # Declare None (any layout): Triton and the MLA backends.
    "TRITON_ATTN": ANY_LAYOUT,
    "TRITON_MLA": ANY_LAYOUT,
    "ROCM_AITER_MLA": ANY_LAYOUT,
    # mla/aiter_triton_mla.py: enum ROCM_AITER_TRITON_MLA, get_name() AITER_TRITON_MLA.
    "ROCM_AITER_TRITON_MLA": ANY_LAYOUT,
    "AITER_TRITON_MLA": ANY_LAYOUT,
    "TURBOQUANT": (LBNHC,),  # turboquant_attn.py:160
    # ultraquant_attn.py: UltraQuantAttentionBackend inherits TURBOQUANT's (FlyDSL decode kernels).
    "ULTRAQUANT": (LBNHC,),
    # Model-driven caches vLLM names only by get_name(), as on CUDA.
    "KPOOL_TAIL": (BLHNC,),  # mla/indexer.py:313
    "DEEPSEEK_V4_INDEXER": (BLHNC, BLNHC),  # mla/indexer.py:348
    "DEEPSEEK_V41_INDEXER": (BLHNC, BLNHC),  # mla/indexer.py: inherits DEEPSEEK_V4_INDEXER's
    "DEEPSEEK_V41_SPARSE_INDEXER": (BLHNC, BLNHC),  # mla/sparse_indexer.py: inherits the same
    "DEEPSEEK_V41_ROCM_MXFP4_INDEXER": (BLHNC, BLNHC),  # mla/rocm_paged_mxfp4_indexer.py: the same
    "QWEN4_EXP_EXP_QSA_STATE": (BLNHC, BLHNC),  # models/qwen4_exp/common/qsa_cache.py:754
}
#: AITER FA is ``ROCM_AITER_FA`` in vLLM's enum but calls itself ``FLASH_ATTN`` (get_name()).
AITER_FA_NAMES = frozenset({"ROCM_AITER_FA", "FLASH_ATTN"})


def rocm_engine_name(attention_backend: str) -> str:
    """The name to ask vLLM about: on ROCm, ``FLASH_ATTN`` is AITER FA (its ``get_name()``),
    not the CUDA FlashAttention class vLLM's enum calls ``FLASH_ATTN``."""
    return "ROCM_AITER_FA" if attention_backend.upper() in AITER_FA_NAMES else attention_backend


def shuffle_kv_enabled(environ: dict[str, str]) -> bool:
    """``VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT`` as vLLM's ``envs.py`` reads it."""
    return environ.get("VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT", "False").lower() in ("true", "1")


def rocm_kv_layouts(attention_backend: str | None, shuffled_kv: bool) -> tuple[KVLayout, ...]:
    """Layouts a ROCm device's attention kernels accept, preferred first, from the tables."""
    if attention_backend is None:
        return ROCM_DEFAULT
    name = attention_backend.upper()
    if name in AITER_FA_NAMES:
        return ROCM_AITER_FA_SHUFFLED if shuffled_kv else ROCM_AITER_FA
    return ROCM_BACKEND_LAYOUTS.get(name, ANY_LAYOUT)
