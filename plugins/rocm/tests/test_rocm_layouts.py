"""kvhal-rocm's layout table against vLLM 0.32's ROCm backends."""

from __future__ import annotations

import importlib
import sys

import pytest

from kvhal.layouts import BLNHC, LBHNC, LHBNC, layout_by_name
from kvhal_cuda.layouts import ANY_LAYOUT
from kvhal_rocm.layouts import (
    ROCM_AITER_FA,
    ROCM_AITER_FA_SHUFFLED,
    ROCM_ATTN,
    ROCM_BACKEND_LAYOUTS,
    ROCM_DEFAULT,
    rocm_kv_layouts,
    shuffle_kv_enabled,
)
from kvhal_rocm.plugin import ROCmPlugin
from tests import vllm_backend_sources as sources

registry = pytest.importorskip("vllm.v1.attention.backends.registry")
engine_backends = pytest.importorskip("tests.engine_backends")

#: Answers that depend on the run (connector, settings): checked by the tests below them.
CONDITIONAL = {"ROCM_AITER_UNIFIED_ATTN"}


def as_kvhal(vllm_layouts):
    return ANY_LAYOUT if vllm_layouts is None else tuple(layout_by_name(x.name) for x in vllm_layouts)


def backend(name):
    [cls] = engine_backends.vllm_backends(name)
    return cls


@pytest.mark.parametrize("name", sorted(set(ROCM_BACKEND_LAYOUTS) - CONDITIONAL))
def test_backend_entries_match_vllms_classes(name):
    for cls in engine_backends.vllm_backends(name):
        assert rocm_kv_layouts(name, shuffled_kv=False) == as_kvhal(cls.supported_kv_cache_layouts()), cls


@pytest.mark.parametrize("name", sorted(set(ROCM_BACKEND_LAYOUTS) - CONDITIONAL))
def test_backend_entries_match_vllms_source(name):
    # Also covers ULTRAQUANT, whose module needs Triton's GPU backend to import.
    keys = engine_backends.class_paths(name)
    answers = {sources.declared(key) for key in keys}
    assert keys and sources.CONDITIONAL not in answers, f"{name}: {keys} {answers}"
    for answer in answers:
        expected = ANY_LAYOUT if answer is None else tuple(layout_by_name(x) for x in answer)
        assert rocm_kv_layouts(name, shuffled_kv=False) == expected, f"{name}: {keys}"


def test_the_issue_backends_are_covered():
    assert rocm_kv_layouts("ROCM_SEGMENTED_ATTN", False) == ROCM_ATTN
    assert rocm_kv_layouts("ULTRAQUANT", False) == rocm_kv_layouts("TURBOQUANT", False)
    assert rocm_kv_layouts("AITER_TRITON_MLA", False) == ANY_LAYOUT  # vLLM's get_name()
    assert rocm_kv_layouts("KPOOL_TAIL", False) == (layout_by_name("BLHNC"),)


def test_aiter_unified_answers_as_with_a_kv_connector(monkeypatch):
    cls = backend("ROCM_AITER_UNIFIED_ATTN")
    module = importlib.import_module(cls.__module__)
    monkeypatch.setattr(module, "_kv_connector_enabled", lambda: True)
    assert rocm_kv_layouts("ROCM_AITER_UNIFIED_ATTN", False) == as_kvhal(cls.supported_kv_cache_layouts())
    monkeypatch.setattr(module, "_kv_connector_enabled", lambda: False)
    assert as_kvhal(cls.supported_kv_cache_layouts())[0] == LBHNC  # still its first choice


@pytest.mark.parametrize("shuffled", [False, True])
def test_aiter_fa_follows_the_shuffle_setting(monkeypatch, shuffled):
    cls = backend("ROCM_AITER_FA")
    aiter = importlib.import_module("vllm._aiter_ops")
    monkeypatch.setattr(aiter.rocm_aiter_ops, "is_shuffle_kv_cache_enabled", classmethod(lambda c: shuffled))
    expected = as_kvhal(cls.supported_kv_cache_layouts())
    assert rocm_kv_layouts("ROCM_AITER_FA", shuffled) == expected
    assert rocm_kv_layouts(cls.get_name(), shuffled) == expected  # it calls itself FLASH_ATTN
    assert expected == (ROCM_AITER_FA_SHUFFLED if shuffled else ROCM_AITER_FA)


def test_shuffle_setting_is_read_like_vllm():
    assert shuffle_kv_enabled({"VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "1"})
    assert shuffle_kv_enabled({"VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "True"})
    assert not shuffle_kv_enabled({})


def test_the_default_puts_lbhnc_first_which_every_rocm_attention_backend_accepts():
    assert ROCM_DEFAULT[0] == LBHNC and set(ROCM_DEFAULT) == set(ANY_LAYOUT)
    for name, layouts in ROCM_BACKEND_LAYOUTS.items():
        # Not among the backends vLLM picks for attention with a connector: the quantized
        # formats (LBNHC only) and the model-driven caches kept beside attention pages.
        if layouts != (layout_by_name("LBNHC"),) and not layouts[0].is_cross_layer:
            assert LBHNC in layouts, name
    for layouts in (ROCM_AITER_FA, ROCM_AITER_FA_SHUFFLED):
        assert LBHNC in layouts


def test_outside_an_engine_the_hook_reads_the_environment(monkeypatch):
    monkeypatch.delitem(sys.modules, engine_backends.REGISTRY_MODULE)
    monkeypatch.setenv("VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT", "true")
    assert ROCmPlugin().kvhal_kv_layouts("FLASH_ATTN") == ROCM_AITER_FA_SHUFFLED
    assert ROCmPlugin().kvhal_kv_layouts("ROCM_AITER_UNIFIED_ATTN") == (LBHNC,)
    assert ROCmPlugin().kvhal_kv_layouts(None) == ROCM_DEFAULT


@pytest.mark.parametrize("shuffled", [False, True])
def test_in_an_engine_vllms_aiter_fa_answers_not_the_environment(monkeypatch, shuffled):
    backend("ROCM_AITER_FA")
    # vLLM's AITER state (not the environment variable) decides, as it did for the engine.
    monkeypatch.setenv("VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT", "false" if shuffled else "true")
    aiter = importlib.import_module("vllm._aiter_ops")
    monkeypatch.setattr(aiter.rocm_aiter_ops, "is_shuffle_kv_cache_enabled", classmethod(lambda c: shuffled))
    expected = ROCM_AITER_FA_SHUFFLED if shuffled else ROCM_AITER_FA
    assert ROCmPlugin().kvhal_kv_layouts("FLASH_ATTN") == expected  # AITER FA's get_name()
    assert ROCmPlugin().kvhal_kv_layouts("ROCM_AITER_FA") == expected


def test_in_an_engine_vllms_answer_wins_where_the_table_differs(monkeypatch):
    cls = backend("ROCM_AITER_UNIFIED_ATTN")
    # Without a KV connector in vLLM's current config, AITER unified also takes LHBNC.
    monkeypatch.setattr(importlib.import_module(cls.__module__), "_kv_connector_enabled", lambda: False)
    assert ROCmPlugin().kvhal_kv_layouts("ROCM_AITER_UNIFIED_ATTN") == (LBHNC, LHBNC)
    assert rocm_kv_layouts("ROCM_AITER_UNIFIED_ATTN", False) == (LBHNC,)  # the table's answer
    with engine_backends.registered("CUSTOM", "KVHAL_TEST_ROCM", ("BLNHC",)):
        assert ROCmPlugin().kvhal_kv_layouts("CUSTOM") == (BLNHC,)
