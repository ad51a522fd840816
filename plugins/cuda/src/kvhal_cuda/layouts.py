"""KV layouts of vLLM 0.32's CUDA attention backends.

Inside a vLLM engine the backend class vLLM runs answers
(:func:`kvhal.layouts.layouts_from_engine`); these tables answer everywhere
else and whenever vLLM has no answer. Values are the backends'
``supported_kv_cache_layouts()`` (first preferred), keyed by vLLM's enum name
and, where it differs, the backend's ``get_name()``. A backend that declares
``None`` accepts any layout; vLLM then prefers ``_DEFAULT_LAYOUT_PREFERENCE``
(``vllm/v1/attention/backends/utils.py``), which :data:`ANY_LAYOUT` mirrors.
Tests cross-check every table entry against the installed vLLM (the class, or
its source where the class needs a GPU library to import).
"""

from __future__ import annotations

from kvhal.layouts import BHLNC, BLHNC, BLNHC, LBHNC, LBNHC, LHBNC, KVLayout

#: vLLM 0.32's preference when no backend declares layouts (``utils.py:195``).
ANY_LAYOUT: tuple[KVLayout, ...] = (LBNHC, LBHNC, BLNHC, BLHNC, BHLNC, LHBNC)

#: ``get_flashinfer_layout_string`` has no name for LHBNC and asserts on it
#: (``utils.py:175-190``), so FlashInfer's "any" excludes it.
FLASHINFER_ANY: tuple[KVLayout, ...] = tuple(x for x in ANY_LAYOUT if x != LHBNC)
#: FlashInfer's trtllm-gen kernels on compute capability 10.x (``flashinfer.py:604``).
FLASHINFER_SM100: tuple[KVLayout, ...] = (LBHNC, BLHNC)

#: Backends that declare a fixed set (backend name -> layouts, preferred first).
CUDA_BACKEND_LAYOUTS: dict[str, tuple[KVLayout, ...]] = {
    "FLASH_ATTN": ANY_LAYOUT,  # flash_attn.py:286 inherits None
    "TRITON_ATTN": ANY_LAYOUT,  # triton_attn.py:282 inherits None
    "FLEX_ATTENTION": (LBNHC,),  # flex_attention.py:130: only LBNHC's strides flatten (B, N)
    "TURBOQUANT": (LBNHC,),  # turboquant_attn.py:160
    # triton_flash_attn.py: a composite (composite.py:502) of two backends that declare None.
    "TRITON_FLASH_ATTN": ANY_LAYOUT,
    "B12X": (LBHNC, BLHNC),  # b12x.py:248 (compute capability 12.x)
    "HPC_ATTN": (LBNHC,),  # hpc_attn.py:321 (Hopper)
    # Model-driven caches vLLM names only by get_name(): their pages sit beside the
    # attention pages inside a block, so B is outermost.
    "KPOOL_TAIL": (BLHNC,),  # mla/indexer.py:313, GLM-5.3-Flash's kpool tail
    "DEEPSEEK_V4_INDEXER": (BLHNC, BLNHC),  # mla/indexer.py:348
    "DEEPSEEK_V41_INDEXER": (BLHNC, BLNHC),  # mla/indexer.py: inherits DEEPSEEK_V4_INDEXER's
    "DEEPSEEK_V41_SPARSE_INDEXER": (BLHNC, BLNHC),  # mla/sparse_indexer.py: inherits the same
    "DOTS3_NOTE_PADDED_MLA_SPARSE": (BLHNC,),  # models/dots3_note/nvidia/attention.py:697
    "QWEN4_EXP_EXP_QSA_STATE": (BLNHC, BLHNC),  # models/qwen4_exp/common/qsa_cache.py:754
    # MLA backends inherit None from MLACommonBackend.
    "FLASHMLA": ANY_LAYOUT,
    "CUTLASS_MLA": ANY_LAYOUT,
    "TRITON_MLA": ANY_LAYOUT,
    "FLASHINFER_MLA": ANY_LAYOUT,
    "FLASH_ATTN_MLA": ANY_LAYOUT,
}


def cuda_any_layout(attention_backend: str) -> tuple[KVLayout, ...]:
    """What "any layout" means for ``attention_backend`` on a CUDA device."""
    return FLASHINFER_ANY if attention_backend.upper() == "FLASHINFER" else ANY_LAYOUT


def cuda_kv_layouts(attention_backend: str | None, capability_major: int | None) -> tuple[KVLayout, ...]:
    """Layouts a CUDA device's attention kernels accept, preferred first, from the tables.

    :param attention_backend: vLLM's backend name, or ``None`` for the default kernels.
    :param capability_major: the device's compute capability major (FlashInfer
        changes its answer on 10.x), or ``None`` when unknown.
    """
    if attention_backend is None:
        return ANY_LAYOUT
    name = attention_backend.upper()
    if name == "FLASHINFER":
        return FLASHINFER_SM100 if capability_major == 10 else FLASHINFER_ANY
    # Undeclared backends accept any layout, as vLLM treats them.
    return CUDA_BACKEND_LAYOUTS.get(name, ANY_LAYOUT)
