"""kvhal-cuda's layout table against vLLM 0.32's own supported_kv_cache_layouts()."""

from __future__ import annotations

import importlib

import pytest

from kvhal.layouts import BLHNC, LBHNC, LHBNC, layout_by_name
from kvhal_cuda.layouts import (
    ANY_LAYOUT,
    CUDA_BACKEND_LAYOUTS,
    FLASHINFER_ANY,
    FLASHINFER_SM100,
    cuda_kv_layouts,
)
from kvhal_cuda.plugin import CUDAPlugin

utils = pytest.importorskip("vllm.v1.attention.backends.utils")
registry = pytest.importorskip("vllm.v1.attention.backends.registry")


def as_kvhal(vllm_layouts):
    return tuple(layout_by_name(layout.name) for layout in vllm_layouts)


def vllm_backend(name: str):
    """The backend class of vLLM's enum member ``name``; skips where it needs a GPU library."""
    path = registry.AttentionBackendEnum[name].value
    module, _, cls = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, RuntimeError, OSError, AssertionError) as exc:
        pytest.skip(f"{name} does not import without a GPU: {type(exc).__name__}: {exc}")


def test_any_layout_is_vllms_default_preference():
    assert as_kvhal(utils._DEFAULT_LAYOUT_PREFERENCE) == ANY_LAYOUT


@pytest.mark.parametrize("name", sorted(CUDA_BACKEND_LAYOUTS))
def test_each_backend_entry_matches_vllm(name):
    declared = vllm_backend(name).supported_kv_cache_layouts()
    expected = ANY_LAYOUT if declared is None else as_kvhal(declared)
    assert cuda_kv_layouts(name, capability_major=9) == expected


def test_mla_backends_inherit_any_layout_from_mla_common():
    # Some MLA backend classes need CUDA libraries to import; their base does not.
    mla = pytest.importorskip("vllm.model_executor.layers.attention.mla_attention")
    assert mla.MLACommonBackend.supported_kv_cache_layouts() is None
    for name in ("FLASHMLA", "CUTLASS_MLA", "TRITON_MLA", "FLASHINFER_MLA", "FLASH_ATTN_MLA"):
        assert cuda_kv_layouts(name, None) == ANY_LAYOUT


def test_flashinfer_matches_vllms_source():
    # flashinfer.py imports the flashinfer package, absent from the CPU wheel: compare
    # with the values read from flashinfer.py:604 (vendor-apis.md section 2.2).
    assert cuda_kv_layouts("FLASHINFER", capability_major=10) == FLASHINFER_SM100 == (LBHNC, BLHNC)
    # Elsewhere it declares None, but get_flashinfer_layout_string() has no name for LHBNC.
    assert cuda_kv_layouts("FLASHINFER", capability_major=9) == FLASHINFER_ANY
    assert LHBNC not in FLASHINFER_ANY
    assert set(utils._FLASHINFER_LAYOUT_NAMES) == {x.name for x in FLASHINFER_ANY}


def test_default_and_unknown_backends_accept_any_layout():
    assert cuda_kv_layouts(None, None) == ANY_LAYOUT
    assert cuda_kv_layouts("SOME_FUTURE_BACKEND", None) == ANY_LAYOUT
    assert cuda_kv_layouts("flex_attention", None) == CUDA_BACKEND_LAYOUTS["FLEX_ATTENTION"]


def test_the_hook_answers_without_a_device_for_non_flashinfer_backends():
    plugin = CUDAPlugin()
    assert plugin.kvhal_kv_layouts("FLEX_ATTENTION") == CUDA_BACKEND_LAYOUTS["FLEX_ATTENTION"]
    assert plugin.kvhal_kv_layouts(None) == ANY_LAYOUT
