"""Layouts from vLLM's own backend classes (kvhal.layouts.layouts_from_engine), and the fallback."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import types

import pytest

from kvhal.cpu.plugin import VLLM_CPU_BACKEND_LAYOUTS, CPUPlugin
from kvhal.layouts import (
    BLHNC,
    BLNHC,
    LBHNC,
    LHBNC,
    STANDARD_LAYOUTS,
    layouts_from_engine,
)


def test_outside_an_engine_nothing_imports_vllm() -> None:
    # A fresh interpreter: the plugin answers from its table and never imports vLLM.
    code = textwrap.dedent(
        """
        import sys
        from kvhal.cpu.plugin import CPUPlugin
        from kvhal.layouts import LBHNC, STANDARD_LAYOUTS, layouts_from_engine
        assert layouts_from_engine("CPU_ATTN", STANDARD_LAYOUTS) is None
        assert tuple(CPUPlugin().kvhal_kv_layouts("CPU_ATTN")) == (LBHNC,)
        loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
        assert not loaded, loaded
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# Everything below asks the installed vLLM.


@pytest.fixture
def engine_backends() -> types.ModuleType:
    """Backends registered in the installed vLLM (skips without vLLM)."""
    return pytest.importorskip("tests.engine_backends")


@pytest.fixture
def backends(engine_backends: types.ModuleType) -> types.ModuleType:
    return importlib.import_module("kvhal.vllm.backends")


def test_cpu_attn_answers_lbhnc_from_vllms_class(backends: types.ModuleType) -> None:
    importlib.import_module("vllm.v1.attention.backends.cpu_attn")
    assert backends.declared_layouts("CPU_ATTN") == (LBHNC,) == VLLM_CPU_BACKEND_LAYOUTS["CPU_ATTN"]
    assert tuple(CPUPlugin().kvhal_kv_layouts("CPU_ATTN")) == (LBHNC,)
    assert tuple(CPUPlugin().kvhal_kv_layouts("cpu_attn")) == (LBHNC,)


def test_vllms_answer_wins_and_without_vllm_the_table_answers(
    engine_backends: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    with engine_backends.registered("CUSTOM", "KVHAL_TEST_WINS", ("BLNHC", "LHBNC")):
        assert tuple(CPUPlugin().kvhal_kv_layouts("CUSTOM")) == (BLNHC, LHBNC)
        # Outside an engine (no backend registry imported) the same question gets the table's answer.
        monkeypatch.delitem(sys.modules, engine_backends.REGISTRY_MODULE)
        assert layouts_from_engine("CUSTOM", STANDARD_LAYOUTS) is None
        assert tuple(CPUPlugin().kvhal_kv_layouts("CUSTOM")) == STANDARD_LAYOUTS


def test_an_enum_member_means_the_class_registered_for_it(
    engine_backends: types.ModuleType, backends: types.ModuleType
) -> None:
    # get_name() differs from the member's name: only the enum (its override) can lead to the class.
    with engine_backends.registered("CUSTOM", "KVHAL_TEST_OVERRIDE", ("BLHNC",)) as cls:
        assert backends.backend_classes("CUSTOM") == [cls]
        assert backends.backend_classes("custom") == [cls]
        assert layouts_from_engine("CUSTOM", STANDARD_LAYOUTS) == (BLHNC,)
    assert layouts_from_engine("CUSTOM", STANDARD_LAYOUTS) is None  # unregistered again


def test_names_vllm_reports_only_through_get_name(backends: types.ModuleType) -> None:
    importlib.import_module("vllm.v1.attention.backends.mla.aiter_triton_mla")
    importlib.import_module("vllm.v1.attention.backends.mla.indexer")
    [aiter] = backends.backend_classes("AITER_TRITON_MLA")  # enum name: ROCM_AITER_TRITON_MLA
    assert aiter.__name__ == "AiterTritonMLABackend"
    assert backends.declared_layouts("AITER_TRITON_MLA") is None  # any layout
    assert layouts_from_engine("AITER_TRITON_MLA", (LBHNC,)) == (LBHNC,)  # the caller's "any"
    assert backends.declared_layouts("KPOOL_TAIL") == (BLHNC,)


def test_a_backend_whose_module_is_not_imported_is_not_imported(
    engine_backends: types.ModuleType, backends: types.ModuleType
) -> None:
    missing = "kvhal_test_not_imported"
    with engine_backends.registered("CUSTOM", "KVHAL_TEST_ELSEWHERE", ("BLHNC",), path=f"{missing}.Backend"):
        assert backends.backend_classes("CUSTOM") == []
        assert layouts_from_engine("CUSTOM", STANDARD_LAYOUTS) is None
    assert missing not in sys.modules
    # An enum member no kvhal table or test imports: asking does not import it either.
    xpu = "vllm.v1.attention.backends.mla.xpu_mla_sparse"
    if xpu in sys.modules:
        pytest.skip("something imported vLLM's XPU_MLA_SPARSE backend")
    assert layouts_from_engine("XPU_MLA_SPARSE", STANDARD_LAYOUTS) is None
    assert xpu not in sys.modules


@pytest.mark.parametrize("declares", [RuntimeError("needs a GPU"), ()], ids=["raises", "empty"])
def test_an_unreadable_answer_falls_back_to_the_table(
    engine_backends: types.ModuleType, declares: object
) -> None:
    with engine_backends.registered("CUSTOM", "KVHAL_TEST_BROKEN", declares):
        assert layouts_from_engine("CUSTOM", STANDARD_LAYOUTS) is None
        assert tuple(CPUPlugin().kvhal_kv_layouts("CUSTOM")) == STANDARD_LAYOUTS


def test_backends_sharing_a_name_must_agree(
    engine_backends: types.ModuleType, backends: types.ModuleType
) -> None:
    with engine_backends.registered(None, "KVHAL_TEST_TWIN", ("LBHNC",)):
        with engine_backends.registered(None, "KVHAL_TEST_TWIN", ("LBHNC",)):
            assert layouts_from_engine("KVHAL_TEST_TWIN", STANDARD_LAYOUTS) == (LBHNC,)
        with engine_backends.registered(None, "KVHAL_TEST_TWIN", ("LHBNC",)):
            with pytest.raises(LookupError, match="disagree"):
                backends.declared_layouts("KVHAL_TEST_TWIN")
            assert layouts_from_engine("KVHAL_TEST_TWIN", STANDARD_LAYOUTS) is None


def test_declaring_any_layout_gives_the_callers_any(engine_backends: types.ModuleType) -> None:
    with engine_backends.registered("CUSTOM", "KVHAL_TEST_ANY", None):
        assert layouts_from_engine("CUSTOM", (LHBNC, LBHNC)) == (LHBNC, LBHNC)
        assert tuple(CPUPlugin().kvhal_kv_layouts("CUSTOM")) == STANDARD_LAYOUTS
