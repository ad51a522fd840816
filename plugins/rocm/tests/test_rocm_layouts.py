"""kvhal-rocm's layout table against vLLM 0.32's ROCm backends."""

from __future__ import annotations

import importlib

import pytest

from kvhal.layouts import LBHNC, layout_by_name
from kvhal_cuda.layouts import ANY_LAYOUT
from kvhal_rocm.layouts import (
    ROCM_AITER_FA,
    ROCM_AITER_FA_SHUFFLED,
    ROCM_BACKEND_LAYOUTS,
    ROCM_DEFAULT,
    rocm_kv_layouts,
    shuffle_kv_enabled,
)
from kvhal_rocm.plugin import ROCmPlugin

registry = pytest.importorskip("vllm.v1.attention.backends.registry")


def as_kvhal(vllm_layouts):
    return ANY_LAYOUT if vllm_layouts is None else tuple(layout_by_name(x.name) for x in vllm_layouts)


def backend(name):
    module, _, cls = registry.AttentionBackendEnum[name].value.rpartition(".")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, RuntimeError, OSError, AssertionError) as exc:
        pytest.skip(f"{name} does not import here: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("name", sorted(set(ROCM_BACKEND_LAYOUTS) - {"ROCM_AITER_UNIFIED_ATTN"}))
def test_backend_entries_match_vllm(name):
    assert rocm_kv_layouts(name, shuffled_kv=False) == as_kvhal(backend(name).supported_kv_cache_layouts())


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


def test_the_default_puts_lbhnc_first_which_every_rocm_backend_accepts():
    assert ROCM_DEFAULT[0] == LBHNC and set(ROCM_DEFAULT) == set(ANY_LAYOUT)
    for layouts in (*ROCM_BACKEND_LAYOUTS.values(), ROCM_AITER_FA, ROCM_AITER_FA_SHUFFLED):
        if layouts != (layout_by_name("LBNHC"),):  # TurboQuant is not in vLLM's connector list
            assert LBHNC in layouts


def test_the_hook_reads_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT", "true")
    assert ROCmPlugin().kvhal_kv_layouts("FLASH_ATTN") == ROCM_AITER_FA_SHUFFLED
    assert ROCmPlugin().kvhal_kv_layouts(None) == ROCM_DEFAULT
