"""kvhal-cuda's layout table against vLLM 0.32's own supported_kv_cache_layouts()."""

from __future__ import annotations

import importlib
import sys

import pytest

from kvhal.layouts import BLHNC, BLNHC, LBHNC, LHBNC, layout_by_name
from kvhal_cuda.layouts import (
    ANY_LAYOUT,
    CUDA_BACKEND_LAYOUTS,
    FLASHINFER_ANY,
    FLASHINFER_SM100,
    cuda_kv_layouts,
)
from kvhal_cuda.plugin import CUDAPlugin
from tests import vllm_backend_sources as sources

utils = pytest.importorskip("vllm.v1.attention.backends.utils")
registry = pytest.importorskip("vllm.v1.attention.backends.registry")
engine_backends = pytest.importorskip("tests.engine_backends")


def as_kvhal(vllm_layouts):
    return tuple(layout_by_name(layout.name) for layout in vllm_layouts)


def test_any_layout_is_vllms_default_preference():
    assert as_kvhal(utils._DEFAULT_LAYOUT_PREFERENCE) == ANY_LAYOUT


@pytest.mark.parametrize("name", sorted(CUDA_BACKEND_LAYOUTS))
def test_each_backend_entry_matches_vllms_class(name):
    for cls in engine_backends.vllm_backends(name):
        declared = cls.supported_kv_cache_layouts()
        expected = ANY_LAYOUT if declared is None else as_kvhal(declared)
        assert cuda_kv_layouts(name, capability_major=9) == expected, cls


@pytest.mark.parametrize("name", sorted(CUDA_BACKEND_LAYOUTS))
def test_each_backend_entry_matches_vllms_source(name):
    # Also covers the classes that need CUDA libraries to import.
    keys = engine_backends.class_paths(name)
    answers = {sources.declared(key) for key in keys}
    assert keys and sources.CONDITIONAL not in answers, f"{name}: {keys} {answers}"
    for answer in answers:
        expected = ANY_LAYOUT if answer is None else tuple(layout_by_name(x) for x in answer)
        assert cuda_kv_layouts(name, capability_major=9) == expected, f"{name}: {keys}"


def test_the_issue_backends_are_covered():
    for name in ("B12X", "HPC_ATTN", "KPOOL_TAIL"):
        assert name in CUDA_BACKEND_LAYOUTS
    assert cuda_kv_layouts("B12X", None) == (LBHNC, BLHNC)
    assert cuda_kv_layouts("hpc_attn", None) == (layout_by_name("LBNHC"),)
    assert cuda_kv_layouts("KPOOL_TAIL", None) == (BLHNC,)


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


def test_outside_an_engine_the_hook_answers_from_the_table(monkeypatch):
    monkeypatch.delitem(sys.modules, engine_backends.REGISTRY_MODULE)
    plugin = CUDAPlugin()
    assert plugin.kvhal_kv_layouts("FLEX_ATTENTION") == CUDA_BACKEND_LAYOUTS["FLEX_ATTENTION"]
    assert plugin.kvhal_kv_layouts("B12X") == (LBHNC, BLHNC)
    assert plugin.kvhal_kv_layouts(None) == ANY_LAYOUT
    with engine_backends.registered("CUSTOM", "KVHAL_TEST_CUDA", ("BLNHC",)):
        assert plugin.kvhal_kv_layouts("CUSTOM") == ANY_LAYOUT  # unknown to the table


def test_in_an_engine_vllms_class_answers():
    plugin = CUDAPlugin()
    with engine_backends.registered("CUSTOM", "KVHAL_TEST_CUDA", ("BLNHC",)):
        assert plugin.kvhal_kv_layouts("CUSTOM") == (BLNHC,)  # the table would say ANY_LAYOUT
    importlib.import_module("vllm.v1.attention.backends.b12x")
    assert plugin.kvhal_kv_layouts("B12X") == (LBHNC, BLHNC)


@pytest.mark.parametrize(
    ("declares", "expected"),
    [(None, FLASHINFER_ANY), (("LBHNC", "BLHNC"), FLASHINFER_SM100)],
    ids=["any", "sm100"],
)
def test_flashinfer_in_an_engine_needs_no_device_query(declares, expected):
    # vLLM's FlashInfer class already asked the device; the plugin must not (no GPU here:
    # torch.cuda.get_device_capability would raise). "Any" still excludes LHBNC.
    with engine_backends.registered("FLASHINFER", "FLASHINFER", declares):
        assert CUDAPlugin().kvhal_kv_layouts("FLASHINFER") == expected
