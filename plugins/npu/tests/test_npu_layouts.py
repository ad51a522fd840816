"""kvhal-npu's layouts: LBNHC from its table unless vllm-ascend's class declares layouts.

vllm-ascend registers its attention backend as vLLM's ``CUSTOM`` member, through
vLLM's ``register_backend``; these tests register backends the same way in the
installed vLLM (no torch_npu or vllm-ascend here).
"""

from __future__ import annotations

import sys

import pytest

from kvhal.layouts import BLHNC, LBHNC, LBNHC
from kvhal_npu.layouts import ASCEND_BACKEND_NAMES, ASCEND_LAYOUTS, npu_kv_layouts
from kvhal_npu.plugin import NPUPlugin


def test_the_table_answers_lbnhc_for_every_backend():
    for backend in (None, "CUSTOM", "ASCEND", "ASCEND_MLA", "ASCEND_SFA", "FLASH_ATTN"):
        assert npu_kv_layouts(backend) == ASCEND_LAYOUTS == (LBNHC,)
    assert "CUSTOM" in ASCEND_BACKEND_NAMES  # vllm-ascend's AscendAttentionBackend.get_name()


@pytest.fixture
def engine_backends():
    """Backends registered in the installed vLLM (skips without vLLM)."""
    return pytest.importorskip("tests.engine_backends")


def test_vllm_ascends_any_layout_leaves_lbnhc(engine_backends):
    # vllm-ascend's classes declare nothing (vLLM's "any"), and allocate (K, V) as BNHC.
    with engine_backends.registered("CUSTOM", "CUSTOM", None):
        assert NPUPlugin().kvhal_kv_layouts("CUSTOM") == (LBNHC,)


def test_a_declaration_by_vllm_ascend_wins(engine_backends, monkeypatch):
    with engine_backends.registered("CUSTOM", "CUSTOM", ("LBHNC", "BLHNC")):
        assert NPUPlugin().kvhal_kv_layouts("CUSTOM") == (LBHNC, BLHNC)
        assert NPUPlugin().kvhal_kv_layouts("custom") == (LBHNC, BLHNC)
        monkeypatch.delitem(sys.modules, engine_backends.REGISTRY_MODULE)  # outside an engine: the table
        assert NPUPlugin().kvhal_kv_layouts("CUSTOM") == (LBNHC,)


def test_vllm_ascend_backends_found_by_get_name(engine_backends):
    # ASCEND_MLA is no member of vLLM's enum: its class is found by the name it reports.
    with engine_backends.registered(None, "ASCEND_MLA", ("BLHNC",)):
        assert NPUPlugin().kvhal_kv_layouts("ASCEND_MLA") == (BLHNC,)


def test_other_vendors_classes_are_not_asked(engine_backends):
    # A CUDA class's declaration describes CUDA kernels, not Ascend's.
    with engine_backends.registered(None, "KVHAL_TEST_NOT_ASCEND", ("LBHNC",)):
        assert NPUPlugin().kvhal_kv_layouts("KVHAL_TEST_NOT_ASCEND") == (LBNHC,)


def test_vllm_ascends_own_registration_is_followed(engine_backends):
    # vllm-ascend calls register_backend(AttentionBackendEnum.CUSTOM, "ASCEND"): vLLM 0.32 stores
    # "ASCEND" as the class path, which names no class; the class is found by get_name() "CUSTOM".
    with engine_backends.registered("CUSTOM", "CUSTOM", ("LBHNC",), path="ASCEND"):
        assert NPUPlugin().kvhal_kv_layouts("CUSTOM") == (LBHNC,)
